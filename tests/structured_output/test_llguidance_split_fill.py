"""The llguidance backend's split fill (`fill_mode="split"`): whole templates a thread, and the
same masks as the library's pool fill."""

from __future__ import annotations

import numpy as np
import pytest

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.split_fill import split_by_group

STRINGS = {"type": "object", "properties": {
    "a": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 3},
    "b": {"type": "integer"}}, "required": ["a", "b"]}  # fmt: skip


def _assert_whole_groups(groups: list, parts: list[list]) -> None:
    """Every index in exactly one part, and every group's indices in one part."""
    assert sorted(i for p in parts for i in p) == list(range(len(groups)))
    owner = {}
    for k, part in enumerate(parts):
        for i in part:
            assert owner.setdefault(groups[i], k) == k, f"group {groups[i]} split"


def test_split_by_group_keeps_groups_whole_and_balances_rows():
    groups = [7, 3, 7, 9, 3, 7, 5, 9, 7, 1]  # sizes: 7 -> 4, 3 -> 2, 9 -> 2, 5 -> 1, 1 -> 1
    parts = split_by_group(groups, 2)
    _assert_whole_groups(groups, parts)
    assert sorted(len(p) for p in parts) == [5, 5]
    assert parts[0][:4] == [0, 2, 5, 8]  # a group's rows together, in their order
    assert split_by_group(groups, 1) == [[0, 2, 5, 8, 1, 4, 3, 7, 6, 9]]
    assert len(split_by_group([4, 4, 4], 3)) == 1  # one group: one part, no empty ones
    assert split_by_group([], 4) == []
    assert split_by_group(groups, 10) == [[0, 2, 5, 8], [1, 4], [3, 7], [6], [9]]  # "pull"


def test_split_fill_masks_equal_the_pool_fill(embedded_tokenizer_dir, monkeypatch):
    """9 copies of 2 x 2 templates and the compile's own matcher, each under the split, the
    pull and the pool fill, advanced by the same sampled tokens: the same masks bit for bit at every step,
    and the split's parts hold whole templates."""
    from transformers import AutoTokenizer

    from phloem.structured_output import tokenizer_data
    from phloem.structured_output.backend import bitmask_width
    from phloem.structured_output.llguidance_backend import LLGuidanceBackend

    tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir))
    vocab, data = len(tok), tokenizer_data(tok, len(tok), tok.eos_token_id)
    monkeypatch.setenv("PHLOEM_GRAMMAR_FILL", "split")
    split = LLGuidanceBackend(data, num_threads=2, templates_per_thread=2)
    pool = LLGuidanceBackend(data, 2, 2, same_tokenizer_as=split, fill_mode="pool")
    pull = LLGuidanceBackend(data, 2, 2, same_tokenizer_as=split, fill_mode="pull")
    assert (split.fill_mode, pool.fill_mode) == ("split", "pool")
    with pytest.raises(ValueError, match="fill mode"):
        LLGuidanceBackend(data, 2, 2, same_tokenizer_as=split, fill_mode="steal")
    params = StructuredOutputsParams(json=STRINGS)
    made = []
    backends = (split, pool, pull)
    for backend in backends:
        compiled, first = backend.compile_with_matcher(params)
        made.append([first] + [backend.matcher(compiled) for _ in range(9)])
    rows = [int(r) for r in np.random.default_rng(1).permutation(10)]
    masks = np.zeros((3, 10, bitmask_width(vocab)), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(12):
        for k, backend in enumerate(backends):
            backend.fill_bitmasks(made[k], masks[k], rows)
        assert (masks[0] == masks[1]).all() and (masks[2] == masks[1]).all()
        bits = np.unpackbits(masks[0].view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        tokens = [int(rng.choice(np.flatnonzero(bits[r]))) for r in rows]
        advanced = [b.advance(m, tokens) for b, m in zip(backends, made)]
        assert advanced[0] == advanced[1] == advanced[2]
    assert len(pull._fill_pairs[2]) == 5  # a part a template (and the compile's own)
    parts = split._fill_pairs[2]
    group_of = {id(m.inner): m.group for m in made[0]}
    assert len(parts) == 2
    assert sorted(len(p) for p in parts) == [5, 5]  # templates of 3, 2, 2, 2 rows; 1 own
    index = {id(m.inner): i for i, m in enumerate(made[0])}
    _assert_whole_groups(
        [group_of[id(m.inner)] for m in made[0]],
        [[index[id(inner)] for inner, _ in part] for part in parts],
    )
