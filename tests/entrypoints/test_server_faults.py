"""Reliability suite items 8, 10, 11, 12: waiting aborts, preemption, NaN logits, engine death.

The faults (items 11, 12) run on servers started by the test-only launcher
(`tests.entrypoints.fault_server`: `phloem serve` over an engine with `FaultExecutor`): a request
whose prompt holds `NAN_TOKEN` gets NaN logits, one holding `DIE_TOKEN` kills the engine loop.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.entrypoints.fault_executor import DIE_TOKEN, NAN_TOKEN
from tests.entrypoints.server_utils import ServerProcess, raw_request
from tests.entrypoints.test_server_streaming import PROMPTS, greedy, sse_events

# -- 8. disconnect while still waiting --------------------------------------------------------------


def test_disconnect_while_waiting_never_runs(small_server):
    """max_num_seqs=2: two long requests run, a third waits; its client leaves; it never runs."""
    small_server.wait_idle()
    before = small_server.metrics()
    blockers = []
    for prompt in PROMPTS[:2]:
        body = json.dumps({"prompt": prompt, "max_tokens": 100, "ignore_eos": True, "stream": True})
        blockers.append(raw_request(small_server.port, "/v1/completions", body.encode()))
    deadline = time.monotonic() + 30
    while small_server.metrics()["phloem:num_requests_running"] < 2:
        assert time.monotonic() < deadline, "blockers did not start"
        time.sleep(0.05)
    for stream in (False, True):
        waiting = json.dumps({"prompt": "never run me " * 20, "max_tokens": 50, "stream": stream})
        sock = raw_request(small_server.port, "/v1/completions", waiting.encode())
        while small_server.metrics()["phloem:num_requests_waiting"] < 1:
            assert time.monotonic() < deadline, "the third request did not queue"
            time.sleep(0.05)
        sock.close()
        while small_server.metrics()["phloem:num_requests_waiting"] > 0:
            assert time.monotonic() < deadline, "the waiting request was not aborted"
            time.sleep(0.05)
    for sock in blockers:
        sock.close()
    after = small_server.wait_idle(timeout=30)
    key = 'phloem:request_aborted_total{phase="waiting"}'
    assert after.get(key, 0) == before.get(key, 0) + 2
    # Its prompt never ran: only the two blockers' prompts were counted.
    ran = after["phloem:prompt_tokens_total"] - before["phloem:prompt_tokens_total"]
    assert ran < 40, f"{ran} prompt tokens ran; the waiting request's ~60 should not have"


# -- 10. KV exhaustion: preemption and recompute, same outputs ---------------------------------------


def test_kv_exhaustion_preempts_and_recomputes(small_server):
    """16 blocks x 16 tokens = 256 slots; two requests of ~100 + 40 tokens cannot both fit."""
    prompts = [f"{p} " * 20 for p in ("The sky is blue.", "Cats like to sleep.")]
    with httpx.Client(base_url=small_server.url, timeout=300) as client:
        alone = [greedy(client, p, max_tokens=40, ignore_eos=True)["text"] for p in prompts]
        before = small_server.metrics()
        results: dict[int, str] = {}

        def run(i: int) -> None:
            results[i] = greedy(client, prompts[i], max_tokens=40, ignore_eos=True)["text"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        after = small_server.wait_idle(timeout=30)
    assert after["phloem:num_preemptions_total"] > before["phloem:num_preemptions_total"]
    for i in range(len(prompts)):
        assert results[i] == alone[i], f"request {i} changed after preemption"


# -- 11. NaN logits in one request ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory):
    server = ServerProcess(
        ["--max-model-len", "512"], tmp_path_factory.mktemp("faults") / "server.log", faults=True
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


NAN_PROMPT = [NAN_TOKEN, 504, 3303, 314]  # token ids: the marker, then a few ordinary tokens


def test_nan_logits_fail_only_that_request(fault_server):
    client = httpx.Client(base_url=fault_server.url, timeout=120)
    alone = [greedy(client, p)["text"] for p in PROMPTS[:4]]
    results: dict[int, httpx.Response] = {}

    def run(i: int, prompt) -> None:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        results[i] = client.post("/v1/completions", json=body)

    threads = [threading.Thread(target=run, args=(i, PROMPTS[i])) for i in range(4)]
    threads.append(threading.Thread(target=run, args=(4, NAN_PROMPT)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    bad = results[4]
    assert bad.status_code == 500, bad.text
    assert "non-finite logits" in bad.json()["error"]["message"]
    for i in range(4):
        assert results[i].status_code == 200
        assert results[i].json()["choices"][0]["text"] == alone[i]
    # Streaming: the error arrives in-band, then [DONE].
    body = {"prompt": NAN_PROMPT, "max_tokens": 8, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert "non-finite" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    metrics = fault_server.wait_idle()
    assert metrics["phloem:request_failed_total"] >= 2
    assert httpx.get(fault_server.url + "/health").status_code == 200
    assert greedy(client, PROMPTS[0])["text"] == alone[0]  # the engine goes on
    client.close()


# -- 12. engine loop death --------------------------------------------------------------------------


@pytest.fixture
def doomed_server(tmp_path):
    server = ServerProcess(["--max-model-len", "512"], tmp_path / "server.log", faults=True)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_engine_death(doomed_server):
    server = doomed_server
    url = server.url + "/v1/completions"
    in_flight: dict[str, list] = {}

    def stream() -> None:
        body = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            in_flight["events"] = sse_events(r)

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 30
    while server.metrics()["phloem:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    died = httpx.post(url, json={"prompt": [DIE_TOKEN, 504]}, timeout=60)
    assert died.status_code == 503, died.text
    assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    refused = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_dead"
    t.join(30)
    events = in_flight["events"]
    assert events[-1] == "[DONE]"
    assert "engine loop has died" in events[-2]["error"]["message"]
    assert server.proc.wait(30) != 0, server.log_tail()
