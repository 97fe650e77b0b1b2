"""The engine core process writes its step trace (`phloem serve --step-trace`,
phloem.bench.step_trace_file): a header with the engine's limits, then one line per step whose
counts add up to what the requests computed (every prompt token once, in chunks under the token
budget), flushed when the core shuts down."""

from __future__ import annotations

import asyncio

import pytest

from phloem import SamplingParams
from phloem.bench.step_analysis import analyze, step_kind, with_durations
from phloem.bench.step_trace_file import read_step_trace
from phloem.engine.core_client import EngineCoreClient
from phloem.engine_args import EngineArgs
from tests.engine.tiny_models import tiny_model_dir

PROMPT_LENS = (40, 23, 57)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_trace", 8)


async def _serve(client: EngineCoreClient) -> list:
    client.start()
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)

    async def one(i: int, n: int):
        await asyncio.sleep(0.05 * i)  # later arrivals join running decodes: mixed steps
        prompt = [100 + 37 * i + j for j in range(n)]  # distinct: no prefix cache hits
        async for output in client.generate(prompt, params, f"r{i}"):
            last = output
        return last

    return await asyncio.gather(*(one(i, n) for i, n in enumerate(PROMPT_LENS)))


def test_engine_core_process_writes_the_step_trace(model_path, tmp_path):
    path = tmp_path / "steps.jsonl"
    args = EngineArgs(str(model_path), block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                      max_model_len=256, dtype="float32")  # fmt: skip
    client = EngineCoreClient(args, ready_timeout_s=240, step_trace=str(path))
    try:
        outputs = asyncio.run(_serve(client))
    finally:
        client.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * 3
    header, steps = read_step_trace(path)
    assert header["max_num_batched_tokens"] == 16 and header["max_num_seqs"] == 8
    assert header["cuda_graphs"] is False and header["async_scheduling"] is True
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert sum(s["prefill_tokens"] for s in steps) == sum(PROMPT_LENS)
    assert sum(s["prefill_chunks"] for s in steps) >= sum(-(-n // 16) for n in PROMPT_LENS)
    for s in steps:
        assert s["t0"] < s["t1"] and s["tokens"] <= 16 and not s["graph"]
        assert s["tokens"] == s["prefill_tokens"] + s["decode_seqs"]
        assert s["seqs"] == s["decode_seqs"] + s["prefill_chunks"]
    # each request decodes MAX_TOKENS - 1 tokens after the one its last chunk sampled; async
    # scheduling may run one more step of a request that is about to finish
    decoded = sum(s["decode_seqs"] for s in steps)
    assert 3 * (MAX_TOKENS - 1) <= decoded <= 3 * MAX_TOKENS
    kinds = {step_kind(s) for s in steps}
    assert {"decode", "prefill"} <= kinds
    analysis = analyze(with_durations(steps))
    assert sum(k["steps"] for k in analysis["kinds"].values()) == len(steps)
