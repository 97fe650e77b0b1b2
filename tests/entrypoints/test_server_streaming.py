"""Reliability suite items 7, 9, 13, 14: disconnects, aborts, Unicode and SSE conformance."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.entrypoints.server_utils import raw_request

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "In 1969, the first person to walk on the Moon",
    "A haiku about autumn:",
    "The quick brown fox",
    "My favourite programming language is",
    "The recipe for pancakes needs",
]


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body into a list of JSON objects and the final "[DONE]" string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def greedy(client, prompt, max_tokens=24, **extra) -> dict:
    r = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


# -- 7. client disconnect mid-stream ---------------------------------------------------------------


def test_disconnect_mid_stream_frees_kv(main_server):
    main_server.wait_idle()
    before = main_server.metrics()
    body = {
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=main_server.url, headers=main_server.headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # Read 5 chunks without abandoning the iterator: a generator dropped by `break` is
            # finalized, and httpcore then closes the connection (a real disconnect, too early).
            lines = r.iter_lines()
            chunks = 0
            while chunks < 5:
                if next(lines).startswith("data: "):
                    chunks += 1
            running = main_server.metrics()
            assert running["phloem:num_requests_running"] >= 1, {
                k: v for k, v in running.items() if "abort" in k or "running" in k or "fail" in k
            }
            assert running["phloem:kv_cache_usage_perc"] > 0, running
            lines.close()
    # The connection is closed: the request is aborted and its blocks return.
    after = main_server.wait_idle(timeout=20)
    key = 'phloem:request_aborted_total{phase="running"}'
    assert after.get(key, 0) == before.get(key, 0) + 1
    generated = after["phloem:generation_tokens_total"] - before["phloem:generation_tokens_total"]
    assert generated < 400, "the aborted request kept generating"


def test_disconnect_non_streaming_frees_kv(main_server):
    main_server.wait_idle()
    before = main_server.metrics()
    body = json.dumps({"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True})
    sock = raw_request(main_server.port, "/v1/completions", body.encode(), main_server.headers)
    deadline = time.monotonic() + 30
    while main_server.metrics()["phloem:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.close()
    after = main_server.wait_idle(timeout=20)
    key = 'phloem:request_aborted_total{phase="running"}'
    assert after.get(key, 0) == before.get(key, 0) + 1


# -- 9. aborting some of many concurrent requests --------------------------------------------------


def test_abort_some_of_many(main_server, client):
    alone = [greedy(client, p, max_tokens=16)["text"] for p in PROMPTS[::2]]
    main_server.wait_idle()
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = greedy(client, PROMPTS[i], max_tokens=16)["text"]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    aborted_socks = []
    threads = [threading.Thread(target=run, args=(i,)) for i in range(0, len(PROMPTS), 2)]
    for t in threads:
        t.start()
    for i in range(1, len(PROMPTS), 2):  # the odd ones are abandoned mid-flight
        body = json.dumps(
            {"prompt": PROMPTS[i], "max_tokens": 200, "ignore_eos": True, "stream": True}
        )
        sock = raw_request(main_server.port, "/v1/completions", body.encode(), main_server.headers)
        aborted_socks.append(sock)
    time.sleep(1.0)
    for sock in aborted_socks:
        sock.close()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for k, i in enumerate(range(0, len(PROMPTS), 2)):
        assert results[i] == alone[k], f"prompt {i} changed when others were aborted"
    main_server.wait_idle(timeout=30)


# -- 13. multi-byte Unicode split across tokens ------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Ünïcödé ëmöjï: 🎉🎉🎉🎉", "你好你好你好你好你好"])
def test_multibyte_unicode_streams_without_replacement_chars(client, prompt):
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert any(ord(ch) > 0x7FF for ch in full), f"expected multi-byte output, got {full!r}"
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == full
    tokens = client.post("/tokenize", json={"prompt": full, "add_special_tokens": False}).json()
    assert tokens["count"] > len(full), "characters should span several tokens"


# -- 14. SSE and usage conformance with the openai SDK -----------------------------------------------


def test_completions_sdk_stream_and_not(openai_client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0)
    full = openai_client.completions.create(**kw)
    assert full.object == "text_completion" and full.model == MODEL
    assert full.usage.completion_tokens == 10 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.choices[0].finish_reason == "length"
    chunks = list(
        openai_client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_sdk_stream_and_not(openai_client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three fruits."}],
        max_tokens=16,
        temperature=0,
        seed=7,
    )
    full = openai_client.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.choices[0].finish_reason in ("stop", "length")
    stream = openai_client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_without_usage_and_raw_done(client):
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    assert all("usage" not in e for e in events[:-1])


def test_n_logprobs_stop_seed(openai_client):
    out = openai_client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0, n=2, logprobs=3
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text  # greedy: identical samples
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 12
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert out.usage.completion_tokens == 24
    stopped = openai_client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[" 5"]
    )
    assert stopped.choices[0].finish_reason == "stop" and " 5" not in stopped.choices[0].text
    streamed = openai_client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[" 5"], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text
    seeded = [
        openai_client.completions.create(
            model=MODEL, prompt="Once", max_tokens=8, temperature=1.0, seed=1234
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)
    streamed_n = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            n=2,
            stream=True,
        )
    )
    finished = {c.choices[0].index for c in streamed_n if c.choices[0].finish_reason}
    assert finished == {0, 1}


# -- a slow reader holds back neither the engine nor other clients ---------------------------------


def _dechunk(data: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (`data`: everything after the headers)."""
    body, pos = b"", 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end], 16)
        if size == 0:
            return body
        body += data[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


def test_slow_reader_never_holds_back_the_core_or_others(main_server, client):
    """A stream whose client reads nothing (a tiny receive window; whether the server's send
    then waits depends on the kernel's buffers) still runs to its end in the core while another
    request is served; read later, its frames give the same text as the same request
    unstreamed. (The coalescing itself: test_server_merge.py and `RequestStream`'s one output.)"""
    import socket

    main_server.wait_idle()
    body = {"prompt": "Tell me a very long story about a lighthouse keeper.", "max_tokens": 120,
            "ignore_eos": True, "temperature": 0, "logprobs": 5}  # fmt: skip
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: small window
    sock.settimeout(60)
    sock.connect(("127.0.0.1", main_server.port))
    head = ["POST /v1/completions HTTP/1.1", f"Host: 127.0.0.1:{main_server.port}",
            "Content-Type: application/json", f"Content-Length: {len(data)}",
            *(f"{k}: {v}" for k, v in main_server.headers.items())]  # fmt: skip
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    try:
        # another client is served meanwhile, and the core finishes the slow one unread
        assert greedy(client, PROMPTS[0], max_tokens=8)["finish_reason"] == "length"
        deadline = time.monotonic() + 300  # generous: CI runs two test workers on 2 cores
        while time.monotonic() < deadline:
            m = main_server.metrics()
            if m["phloem:num_requests_running"] == 0 and m["phloem:num_requests_waiting"] == 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the core did not finish the slow reader's request")
        raw = b""
        while b"data: [DONE]" not in raw or not raw.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, "connection closed early"
            raw += chunk
    finally:
        sock.close()
    headers, _, rest = raw.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 200"), headers
    events = [e[len(b"data: ") :] for e in _dechunk(rest).split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    choices = [json.loads(e)["choices"] for e in events[:-1]]
    text = "".join(c[0]["text"] for c in choices if c)
    assert choices[-1][0]["finish_reason"] == "length"
    unstreamed = client.post("/v1/completions", json=body).json()["choices"][0]
    assert text == unstreamed["text"]
