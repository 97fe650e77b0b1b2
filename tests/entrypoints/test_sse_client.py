"""The benchmark's streaming client (phloem/entrypoints/sse_client.py, issue 24): chunked bodies
cut at every byte, SSE lines split across chunks, plain bodies read to the close, error statuses
with their text; and the server's intake (request_body.read_and_prepare): one trip to the preparation
thread per request, the fast JSON parse giving what the standard one gives."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from phloem.entrypoints.openai.protocol import APIError, CompletionRequest
from phloem.entrypoints.openai.request_body import parse_json, read_and_prepare
from phloem.entrypoints.sse_client import ChunkedBody, HTTPStatusError, Target, stream_data_lines

EVENTS = [b'{"choices": [{"text": "h\\u00e9"}]}', b'{"usage": {"x": 1}}', b"[DONE]"]


def _sse() -> bytes:
    return b"".join(b"data: " + e + b"\r\n\r\n" for e in EVENTS)


def _chunked(payload: bytes, sizes: list[int]) -> bytes:
    out, pos = [], 0
    for size in sizes:
        piece = payload[pos : pos + size]
        pos += size
        out.append(b"%x;ext=1\r\n" % len(piece) + piece + b"\r\n")
    assert pos >= len(payload)
    return b"".join(out) + b"0\r\n\r\n"


def test_chunked_body_cut_anywhere() -> None:
    payload = _sse()
    wire = _chunked(payload, [5, 40, 1, len(payload)])
    for cut in range(len(wire) + 1):
        body = ChunkedBody()
        got = body.feed(wire[:cut]) + body.feed(wire[cut:])
        assert got == payload and body.done, cut
    body = ChunkedBody()
    assert b"".join(body.feed(wire[i : i + 1]) for i in range(len(wire))) == payload
    with pytest.raises(ValueError):
        ChunkedBody().feed(b"zz\r\n")


def test_target_from_url() -> None:
    t = Target.from_url("http://127.0.0.1:8123/api/", {"Authorization": "Bearer k"})
    assert (t.host, t.port, t.prefix, t.headers) == (
        "127.0.0.1",
        8123,
        "/api",
        b"Authorization: Bearer k\r\n",
    )
    assert Target.from_url("https://example.com") is None


async def _serve_once(answer: bytes, seen: list[bytes]):
    """A one-connection server writing `answer` in small pieces, recording the request."""

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        seen.append(head + await reader.readexactly(length))
        for i in range(0, len(answer), 7):
            writer.write(answer[i : i + 7])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _lines(answer: bytes) -> tuple[list[bytes], list[bytes]]:
    seen: list[bytes] = []
    server, port = await _serve_once(answer, seen)
    async with server:
        target = Target("127.0.0.1", port, "/p", b"X-Key: v\r\n")
        got = [line async for line in stream_data_lines(target, "/v1/completions", b'{"a": 1}')]
    return got, seen


def test_stream_data_lines_chunked_and_plain() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(_sse(), [9, 3, 50, 200])
    got, seen = asyncio.run(_lines(chunked))
    assert got == EVENTS
    assert seen[0].startswith(b"POST /p/v1/completions HTTP/1.1\r\n")
    assert b"X-Key: v\r\n" in seen[0] and seen[0].endswith(b'\r\n\r\n{"a": 1}')
    got, _ = asyncio.run(_lines(head + b"\r\n" + _sse()))  # no framing: read to the close
    assert got == EVENTS


def test_stream_data_lines_error_status_and_cut_stream() -> None:
    text = b'{"error": {"message": "Incorrect API key"}}'
    answer = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n\r\n" % len(text) + text
    with pytest.raises(HTTPStatusError) as e:
        asyncio.run(_lines(answer))
    assert e.value.status == 401 and "Incorrect API key" in e.value.text
    cut = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(_sse(), [30, 100])[:50]
    )
    with pytest.raises(ConnectionError):
        asyncio.run(_lines(cut))


def test_parse_json_matches_the_standard_parser() -> None:
    ok = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.5}
    req = parse_json([json.dumps(ok).encode()], CompletionRequest)
    assert req.prompt == [1, 2, 3] and req.max_tokens == 4 and req.temperature == 0.5
    with pytest.raises(APIError) as e:  # msgspec refuses NaN; json reads it; pydantic decides
        parse_json([b'{"prompt": [1], "temperature": NaN}'], CompletionRequest)
    assert e.value.status_code == 400 and "temperature" in str(e.value.body())
    with pytest.raises(APIError) as e:
        parse_json([b'{"prompt": [1],\n "max_tokens": }'], CompletionRequest)
    assert "(line 2, column 16)" in e.value.body()["error"]["message"]


def test_a_request_makes_one_trip_to_the_preparation_thread() -> None:
    trips: list[str] = []

    async def off_loop(fn, *args, undo=None):
        trips.append(fn.__name__)
        return fn(*args)

    async def stream():
        yield b'{"prompt": [5, 6], '
        yield b'"max_tokens": 3, "n": 1}'

    state = SimpleNamespace(
        off_loop=off_loop,
        model_name="m",
        limits=SimpleNamespace(max_request_body_bytes=1 << 20, max_n=4, max_prompts_per_request=8),
    )
    request = SimpleNamespace(headers={}, stream=stream)
    req, prep, started = asyncio.run(
        read_and_prepare(
            state,
            request,
            CompletionRequest,
            lambda s, r: ("prep", r.prompt),
            lambda r: 1,
            start=lambda s, p: ("started", p),
        )
    )
    assert trips == ["_parse_and_prepare"]  # parsed, prepared and started in that one trip
    assert req.max_tokens == 3 and prep == ("prep", [5, 6])
    assert started == ("started", ("prep", [5, 6]))
