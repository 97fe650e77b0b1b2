"""An offline batch's prompts checked as `LLM.generate` encodes them, each one's token ids
packed once (`array('I')`, 4 bytes an id) in C: the check of a prompt's ids costs one packing
and numpy's max instead of Python's min and max over the list, and the global prefix planner
takes the packed ids as they are instead of packing every prompt again."""

from __future__ import annotations

import operator
from array import array
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    from phloem.engine.data_parallel import DataParallelEngine
    from phloem.engine.llm_engine import LLMEngine

_PACKED_TYPECODE = "I"  # C unsigned int: the planner's token encoding (core.prefix_planner)


def check_id_list(ids: object) -> None:
    """Raise ValueError("prompt_token_ids must be a list of integers") unless `ids` is a list
    whose items are all ints (subclasses of int count, bool does not).

    The common case, every item exactly an int, is one pass in C (counting `type(t) is int`);
    anything else is decided item by item."""
    if isinstance(ids, list) and operator.countOf(map(type, ids), int) == len(ids):
        return
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise ValueError("prompt_token_ids must be a list of integers")


def pack_checked(ids: list[int], max_model_len: int, vocab_size: int) -> array | None:
    """`ids` packed as an `array('I')` when it surely passes `input_checks.check_prompt`
    (non-empty, fewer than `max_model_len` tokens, every id in [0, vocab_size)); None when it
    may not (an id negative, >= 2**32 or not an integer, or the max id >= vocab_size): the
    caller then runs the full check, which names the failure. Raises nothing."""
    if not ids or len(ids) >= max_model_len:
        return None
    try:
        packed = array(_PACKED_TYPECODE, ids)
    except (OverflowError, TypeError):
        return None
    if int(np.frombuffer(packed, dtype=np.uintc).max()) >= vocab_size:
        return None
    return packed


class CheckedBatch(list):
    """A batch's (text, token ids) pairs, each checked as `engine.validate_prompt` checks it,
    and `packed`: per pair, its ids as an `array('I')` (the list itself in the rare case the
    ids did not pack), for `plan_prefix_groups`.

    Both engines' `validate_prompt` is `input_checks.check_prompt` with their max_model_len
    and vocabulary; a prompt that packs within the vocabulary passes it, any other is checked
    by `engine.validate_prompt` itself (so its ValueError is the engine's, word for word)."""

    def __init__(self, engine: LLMEngine | DataParallelEngine) -> None:
        super().__init__()
        self.packed: list[list[int] | array] = []
        self._engine = engine
        self._limits = (engine.max_model_len, engine.hf_config.vocab_size)

    def add(self, text: str | None, ids: list[int]) -> None:
        """Check one prompt and append it. Raises the engine's ValueError for a bad one."""
        packed = pack_checked(ids, *self._limits)
        if packed is None:
            self._engine.validate_prompt(ids)
        self.append((text, ids))
        self.packed.append(ids if packed is None else packed)


def planner_input(
    encoded: Sequence[tuple[str | None, list[int]]],
) -> list[list[int] | array]:
    """The token ids of each pair of `encoded`, packed where a `CheckedBatch` packed them."""
    if isinstance(encoded, CheckedBatch):
        return encoded.packed
    return [ids for _, ids in encoded]
