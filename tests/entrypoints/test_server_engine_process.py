"""The server's engine core in its own process (issue 24): a separate pid, greedy outputs equal to
the offline `LLM`'s, 120 streams with 30 cancelled mid-stream leave nothing running or waiting,
and `kill -9` of the core turns /health 503 and makes the server exit non-zero.

The read-only tests share the session's `main_server`; the kill test starts its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess
from tests.entrypoints.test_server_streaming import PROMPTS


def core_pid(server: ServerProcess) -> int:
    """The engine core's pid, from the server's start-up line."""
    match = re.search(r"engine core pid (\d+)", server.log_path.read_text(errors="replace"))
    assert match, server.log_tail()
    return int(match.group(1))


def test_engine_core_runs_in_its_own_process(main_server):
    pid = core_pid(main_server)
    assert pid != main_server.proc.pid
    os.kill(pid, 0)  # alive


def test_greedy_outputs_equal_offline_llm(main_server):
    """Same prompts, float32, greedy: the server's completions equal `LLM.generate`'s, with a
    stop string applied by the front (text cut, finish_reason "stop") as the engine does."""
    from phloem import LLM, SamplingParams

    params = [
        {"max_tokens": 20, "temperature": 0},
        {"max_tokens": 20, "temperature": 0, "stop": ["the", "\n"]},
    ]

    async def send_all() -> list:
        async with httpx.AsyncClient(
            base_url=main_server.url, headers=main_server.headers, timeout=120
        ) as client:
            bodies = [{"prompt": p, **k} for k in params for p in PROMPTS[:4]]
            answers = await asyncio.gather(
                *[client.post("/v1/completions", json=b) for b in bodies]
            )
        return [r.json() for r in answers]

    answers = asyncio.run(send_all())  # batched together: greedy outputs must not change
    served = [answers[:4], answers[4:]]
    assert any(isinstance(r["choices"][0]["stop_reason"], str) for r in served[1])
    llm = LLM(max_model_len=512, dtype="float32")
    for k, responses in zip(params, served):
        outputs = llm.generate(PROMPTS[:4], SamplingParams(**k), use_tqdm=False)
        for response, output in zip(responses, outputs):
            choice = response["choices"][0]
            assert choice["text"] == output.outputs[0].text
            assert choice["finish_reason"] == output.outputs[0].finish_reason
            assert choice["stop_reason"] == output.outputs[0].stop_reason
            assert response["usage"]["completion_tokens"] == len(output.outputs[0].token_ids)


async def _stream(client: httpx.AsyncClient, i: int, cancel: bool) -> str:
    body = {"prompt": f"Request {i}: count to ten.", "max_tokens": 8, "stream": True}
    body["ignore_eos"] = True
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        last = ""
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if cancel and last != "[DONE]" and json.loads(last)["choices"]:
                return "cancelled"  # leaving the block closes the connection mid-stream
    return last


def test_cancelled_streams_leave_nothing_behind(main_server):
    """120 concurrent streams, every fourth cancelled after its first token: the 90 others end
    with [DONE], and then nothing runs or waits and the KV pool is free."""
    main_server.wait_idle()
    before = main_server.metrics()

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(
            base_url=main_server.url, headers=main_server.headers, timeout=300, limits=limits
        ) as client:
            return await asyncio.gather(*[_stream(client, i, i % 4 == 0) for i in range(120)])

    results = asyncio.run(main())
    assert results.count("cancelled") == 30
    assert [r for i, r in enumerate(results) if i % 4] == ["[DONE]"] * 90
    after = main_server.wait_idle(timeout=60)
    assert after["phloem:kv_cache_usage_perc"] == 0.0
    aborted = sum(
        after.get(f'phloem:request_aborted_total{{phase="{p}"}}', 0) for p in ("waiting", "running")
    )
    aborted -= sum(
        before.get(f'phloem:request_aborted_total{{phase="{p}"}}', 0)
        for p in ("waiting", "running")
    )
    assert 0 < aborted <= 30  # a cancel that lands after the last token aborts nothing


@pytest.fixture
def own_server(tmp_path):
    server = ServerProcess(["--max-model-len", "256"], tmp_path / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_kill_9_of_the_core_fails_streams_and_exits_nonzero(own_server):
    server = own_server
    url = server.url + "/v1/completions"
    body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the stream is running
        os.kill(core_pid(server), signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "engine loop has died" in json.loads(events[-2])["error"]["message"]
    deadline = time.monotonic() + 10
    health = None
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            health = httpx.get(server.url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            break
        if health == 503:
            break
        time.sleep(0.05)
    assert health == 503
    assert server.proc.wait(30) != 0, server.log_tail()


def test_serve_rejects_data_parallel(capsys):
    from phloem.entrypoints.cli import main

    assert main(["serve", "--data-parallel-size", "2"]) == 2
    assert "--data-parallel-size 2: phloem serve runs one engine" in capsys.readouterr().err


def test_no_engine_process_serves_the_same(main_server, tmp_path):
    """`--no-engine-process` (the engine in a thread of the server) answers as the default."""
    prompt = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "stop": ["\n\n"]}
    with httpx.Client(base_url=main_server.url, headers=main_server.headers, timeout=60) as c:
        expected = c.post("/v1/completions", json=prompt).json()["choices"][0]
    server = ServerProcess(["--max-model-len", "512", "--no-engine-process"], tmp_path / "log")
    try:
        server.wait_ready()
        assert "engine thread" in server.log_tail()
        got = httpx.post(server.url + "/v1/completions", json=prompt, timeout=60).json()
        assert got["choices"][0] == expected
    finally:
        server.stop()
