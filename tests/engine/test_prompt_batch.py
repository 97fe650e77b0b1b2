"""The batch prompt check of `LLM.generate` (engine/prompt_batch.py): the packed fast path
gives check_prompt's verdict and the engine's own message, and the planner gets packed ids."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phloem.engine.input_checks import check_prompt
from phloem.engine.prompt_batch import CheckedBatch, check_id_list, pack_checked, planner_input

VOCAB, MAX_LEN = 1000, 16


class FakeEngine:
    """What CheckedBatch reads of an engine; counts the full checks it asks for."""

    max_model_len = MAX_LEN
    hf_config = SimpleNamespace(vocab_size=VOCAB)

    def __init__(self) -> None:
        self.full_checks = 0

    def validate_prompt(self, ids: list[int]) -> None:
        self.full_checks += 1
        check_prompt(ids, MAX_LEN, VOCAB)


def verdict(fn, *args) -> str | None:
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return None


ID = st.one_of(
    st.integers(0, VOCAB - 1),
    st.sampled_from([-1, VOCAB, 2**32 - 1, 2**32, -(2**40), 0, 1]),
)


@given(st.lists(ID, max_size=MAX_LEN + 2))
def test_batch_check_gives_check_prompts_verdict_and_message(ids: list[int]) -> None:
    engine = FakeEngine()
    batch = CheckedBatch(engine)
    expected = verdict(check_prompt, ids, MAX_LEN, VOCAB)
    assert verdict(batch.add, None, ids) == expected
    packed = pack_checked(ids, MAX_LEN, VOCAB)
    assert engine.full_checks == (packed is None)  # the full check only off the fast path
    if packed is not None:
        assert expected is None and list(packed) == ids
    if expected is None:
        assert batch == [(None, ids)] and batch[0][1] is ids  # the caller's list, no copy
        assert list(planner_input(batch)[0]) == ids


def test_planner_input_packs_once_and_reads_plain_pairs() -> None:
    batch = CheckedBatch(FakeEngine())
    batch.add("a", [3, 4, 5])
    batch.add(None, [VOCAB - 1])
    assert [type(p) for p in planner_input(batch)] == [array, array]
    assert planner_input(batch)[1].typecode == "I"
    pairs = [("a", [3, 4, 5])]
    assert planner_input(pairs) == [[3, 4, 5]]


class MyInt(int):
    pass


@pytest.mark.parametrize(
    "ids, ok",
    [
        ([1, 2, 3], True),
        ([], True),
        ([MyInt(4), 5], True),  # int subclasses pass, as before the fast path
        ([1, True], False),
        ([False], False),
        ([1, np.int64(2)], False),
        ([1, 2.0], False),
        ([1, "2"], False),
        ((1, 2), False),
        (np.array([1, 2]), False),
        (None, False),
    ],
)
def test_check_id_list(ids, ok: bool) -> None:
    expected = None if ok else "prompt_token_ids must be a list of integers"
    assert verdict(check_id_list, ids) == expected
