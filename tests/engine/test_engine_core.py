"""The engine core's side of the process split (issue 24): `LLMEngine` in DELTA mode sends
token deltas whose concatenation is the offline (FINAL) output, applies no stop strings, and
`stop_sequences` finishes one child of n > 1 (or the whole prompt) the way the front asks; the
messages round-trip through msgspec."""

from __future__ import annotations

import msgspec
import pytest

from phloem import SamplingParams
from phloem.engine.core_messages import (
    CoreAbort,
    CoreRequest,
    CoreStats,
    CoreStep,
    RequestDelta,
    SeqDelta,
    core_decoder,
    front_decoder,
    params_to_dict,
)
from phloem.engine.llm_engine import LLMEngine, OutputMode
from phloem.engine_args import EngineArgs
from tests.engine.tiny_models import tiny_model_dir

PROMPT = [3, 40, 41, 42, 43, 44, 45, 5]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_core", 6)


def engine(model_path, mode: OutputMode) -> LLMEngine:
    args = EngineArgs(str(model_path), block_size=4, max_num_batched_tokens=32)
    return LLMEngine(args.create_engine_config(), output_mode=mode)


def run(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_deltas_add_up_to_the_offline_output(model_path):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, logprobs=1, stop=["a"])
    final = engine(model_path, OutputMode.FINAL)
    final.add_request(PROMPT, params, "r")
    (offline,) = run(final)
    core = engine(model_path, OutputMode.DELTA)
    core.add_request(PROMPT, params, "r")
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    deltas = run(core)
    assert all(isinstance(d, RequestDelta) for d in deltas) and deltas[-1].finished
    for delta in deltas:
        for sd in delta.seqs:
            tokens[sd.index] += sd.token_ids
            assert sd.logprobs is not None and len(sd.logprobs) == len(sd.token_ids)
            finish[sd.index] = sd.finish_reason or finish.get(sd.index)
    # no stop strings in the core: it runs to max_tokens (the offline output may stop early)
    for c in offline.outputs:
        assert tokens[c.index][: len(c.token_ids)] == c.token_ids
        assert len(tokens[c.index]) == 12 and finish[c.index] == "length"


def test_stop_sequences_finishes_a_child_then_the_prompt(model_path):
    core = engine(model_path, OutputMode.DELTA)
    core.add_request(PROMPT, SamplingParams(n=2, max_tokens=50, ignore_eos=True), "r")
    core.step()
    core.stop_sequences(["r#0"])
    assert core.is_unfinished("r")
    core.step()
    core.stop_sequences(["r#1", "unknown"])
    assert not core.is_unfinished("r") and not core.has_unfinished_requests()
    assert core.kv_manager.num_reclaimable_blocks == core.kv_manager.num_blocks


def test_messages_round_trip():
    params = SamplingParams(n=2, stop=["x"], seed=3, logprobs=2)
    encoder = msgspec.msgpack.Encoder()
    request = CoreRequest("r", [1, 2], params_to_dict(params), 1.5)
    decoded = core_decoder().decode(encoder.encode(request))
    assert decoded == request
    assert SamplingParams.from_dict(decoded.sampling_params) == params
    abort = CoreAbort(["a"], ["b#1"])
    assert core_decoder().decode(encoder.encode(abort)) == abort
    step = CoreStep(
        [RequestDelta("r", [SeqDelta(0, [5], [{5: -0.5}], -0.5, "stop", 7)], True, 4)],
        CoreStats(1, 2, 3, 4, 5, 6, 7, 8, 9),
    )
    assert front_decoder().decode(encoder.encode(step)) == step
