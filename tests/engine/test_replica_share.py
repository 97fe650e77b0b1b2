"""The wire form of a data-parallel share (`engine.replica_share`): packed and unpacked, every
prompt comes back token for token with its own sampling parameters, the plan it carries is the
driver's groups over the share, each shared prefix travels once, and malformed input is refused."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from phloem.core.replica_partition import share_plan
from phloem.engine.replica_share import decode_share, encode_share
from phloem.sampling_params import SamplingParams

PREFIX = list(range(100, 116))  # 16 tokens: 2 blocks of 8


def _batch():
    encoded = [(f"text {i}", PREFIX + [200 + i, 300 + i]) for i in range(4)]
    encoded += [(None, [7, 8, 9]), (None, [2**32 - 1, 0])]
    greedy = SamplingParams(temperature=0, max_tokens=3)
    params = [greedy, SamplingParams(max_tokens=5, n=2), greedy, greedy, greedy,
              SamplingParams(seed=1)]  # fmt: skip
    return encoded, params


def test_planned_share_round_trip():
    encoded, params = _batch()
    groups = [(16, (2, 0, 3)), (0, (5,)), (16, (1,))]  # one member of a split group last
    share = encode_share(encoded, params, groups, 8, planned=True)
    assert len(share.tokens) == 4 * (16 + 3 * 2 + 2 + 16 + 2)  # each prefix once per group
    assert len(share.params) == 3  # distinct objects once
    got, got_params, plan = decode_share(pickle.loads(pickle.dumps(share)))
    order = [2, 0, 3, 5, 1]
    assert share.indices == order
    assert [ids for _, ids in got] == [encoded[i][1] for i in order]
    assert all(text is None for text, _ in got)  # texts are the driver's to put back
    assert got_params == [params[i] for i in order]
    assert got_params[0] is got_params[1]  # still one object where it was one
    lens = [len(encoded[i][1]) for i in order]
    assert plan == share_plan([16, 0, 16], [3, 1, 1], lens, 8)
    assert [g.prefix_len for g in plan.groups] == [16, 0, 0]


def test_contiguous_share_carries_no_plan():
    encoded, params = _batch()
    share = encode_share(encoded, params, [(0, (i,)) for i in (4, 5)], 8, planned=False)
    got, got_params, plan = decode_share(share)
    assert plan is None
    assert [ids for _, ids in got] == [encoded[4][1], encoded[5][1]]
    assert got_params == [params[4], params[5]]


def test_bad_input_is_refused():
    encoded, params = _batch()
    with pytest.raises(ValueError, match=r"token id outside \[0, 2\*\*32\)"):
        encode_share([(None, [1, 2**32])], params[:1], [(0, (0,))], 8, planned=False)
    share = encode_share(encoded, params, [(16, (0, 1))], 8, planned=True)
    broken = dataclasses.replace(share, suffix_lens=[2, 1])
    with pytest.raises(ValueError, match="its lengths add up to"):
        decode_share(broken)
