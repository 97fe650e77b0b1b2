"""The data-parallel parent's prompt check (`DataParallelEngine.validate_prompt`, its fast path
over the packed ids) raises exactly what `input_checks.check_prompt` raises, and passes what it
passes; no replica is started."""

from __future__ import annotations

import pytest

from phloem.engine.data_parallel import DataParallelEngine
from phloem.engine.input_checks import check_prompt
from phloem.engine_args import EngineArgs
from tests.engine.tiny_models import VOCAB, tiny_model_dir


@pytest.fixture(scope="module")
def parent(tmp_path_factory, embedded_tokenizer_dir):
    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "dp_inputs", 2)
    args = EngineArgs(model=str(path), data_parallel_size=2, dtype="float32")
    return DataParallelEngine(args, start=False)


@pytest.mark.parametrize(
    "ids",
    [[], [5] * 600, [VOCAB], [3, VOCAB + 7, 4], [-1, 5], [2**32, 1], [0, VOCAB - 1], [3.0, 4]],
)
def test_same_verdict_as_check_prompt(parent, ids):
    limit = parent.max_model_len
    assert limit == 512  # the tiny model's positions: [5] * 600 is too long
    try:
        check_prompt(ids, limit, VOCAB)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            parent.validate_prompt(ids)
        assert str(got.value) == str(e)
    else:
        parent.validate_prompt(ids)
    assert parent.pids == [None, None]  # nothing started
