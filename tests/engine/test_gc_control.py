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


def test_freeze_start_up_freezes_what_lives_and_collects_young_objects_less_often(counted):
    thresholds = gc.get_threshold()
    try:
        survivor = [[i] for i in range(1000)]  # start-up state: lives as long as the process
        cycle: list = []
        cycle.append(cycle)  # garbage in a cycle: collected first, never frozen
        del cycle
        frozen = gc_control.freeze_start_up()
        assert frozen == gc.get_freeze_count() >= len(survivor)
        assert gc.get_threshold()[0] == max(thresholds[0], gc_control.YOUNG_GC_THRESHOLD)
        assert gc.collect() == 0  # nothing unfrozen left over from before the freeze
    finally:
        gc.set_threshold(*thresholds)
