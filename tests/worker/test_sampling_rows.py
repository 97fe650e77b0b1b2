"""The model runner's per-request sampling rows: built once when nothing in them depends on the
step, rebuilt every step while min_tokens bans apply."""

import torch

from phloem.core.request import Request
from phloem.sampling_params import SamplingParams
from phloem.worker.model_runner import ModelRunner


def runner() -> ModelRunner:
    r = object.__new__(ModelRunner)  # only the sampling-row state, no model
    r.device, r.eos_token_id, r._generators, r._rows = torch.device("cpu"), 2, {}, {}
    return r


def test_static_rows_are_built_once_and_see_new_outputs():
    r = runner()
    req = Request("a", [5, 6], SamplingParams(temperature=0.0, max_tokens=4))
    row = r._sampling_row(req)
    req.output_token_ids.append(9)  # the update appends in place
    again = r._sampling_row(req)
    assert again is row and list(again.output_token_ids) == [9]
    other = Request("a", [5, 6], SamplingParams(temperature=0.0, max_tokens=4))  # same id, new
    assert r._sampling_row(other) is not row


def test_min_tokens_rows_follow_the_step():
    r = runner()
    req = Request("b", [5], SamplingParams(temperature=0.0, max_tokens=4, min_tokens=1,
                                            stop_token_ids=[7]))  # fmt: skip
    assert sorted(r._sampling_row(req).banned_token_ids) == [2, 7]
    req.output_token_ids.append(3)
    assert list(r._sampling_row(req).banned_token_ids) == []
    assert "b" not in r._rows
