"""`gc_frozen` (engine/gc_control.py): objects frozen by another party are never unfrozen, and the
permanent generation is not counted again once it may hold everything (counting walks it: 60 ms a
batch on a GPU process)."""

from __future__ import annotations

import gc

import pytest

from phloem.engine import gc_control


@pytest.fixture
def counted(monkeypatch):
    """The number of `gc.get_freeze_count` calls; the module's state and gc's restored after."""
    calls = []
    real = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or real())
    monkeypatch.setattr(gc_control, "_foreign_frozen", False)
    yield calls
    gc.unfreeze()


def test_own_freeze_is_undone_and_nested_blocks_leave_it_to_the_outer(counted):
    with gc_control.gc_frozen():
        with gc_control.gc_frozen():
            pass
        assert gc.get_freeze_count() > 0  # the inner block did not unfreeze the outer's batch
    assert gc.get_freeze_count() == 0
    with gc_control.gc_frozen():
        pass
    assert gc.get_freeze_count() == 0
    assert len(counted) == 2 + 3  # one count per outermost block (+ the test's own three)


def test_foreign_frozen_objects_stay_frozen_and_are_counted_once(counted):
    gc.freeze()  # another party's objects
    for _ in range(3):
        with gc_control.gc_frozen():
            pass
        assert gc.get_freeze_count() > 0
    assert len(counted) == 1 + 3  # one count by the first block (+ the test's own three)
