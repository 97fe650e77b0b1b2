"""The streaming HTTP/1.1 client of `phloem bench serve`'s measured requests: one connection per
request, one write of the request with its JSON body encoded in advance, and the `data:` lines
of the server-sent events as they arrive (chunked or plain body), on asyncio's streams.

Why not httpx for these: a benchmark client that cannot keep up measures itself. Against a
server producing ~25,000 tokens a second (800 streams, a decode step every ~32 ms: the H200
shared-prefix burst of benchmarks/results/2026-11-26d-h200-serving), httpx's pool (a scan of
every open connection per request and per response event) and its five async generators per
line kept one client core busy throughout: the first request reached the engine only after
0.26-0.34 s, and the last tokens ~0.4 s after the engine's last step (measured in
benchmarks/results/2026-11-26f-cpu-serving-burst). Here a request costs a connection and a write,
an event a slice of a bytes buffer. The other calls (`/v1/models`, `/health`, `/detokenize`) stay
on httpx, and so do https URLs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

_READ_SIZE = 1 << 16


class HTTPStatusError(Exception):
    """The server answered with a status other than 200 (`status`, the body's start in
    `text`)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
        self.text = text


@dataclass(frozen=True)
class Target:
    """Where the requests go: host, port, the URL's path prefix, and extra header lines
    (`Name: value\\r\\n` each, as bytes)."""

    host: str
    port: int
    prefix: str
    headers: bytes = b""

    @classmethod
    def from_url(cls, base_url: str, headers: dict[str, str] | None = None) -> Target | None:
        """The target of an http:// base URL; None for any other scheme (https: use httpx)."""
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            return None
        lines = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        return cls(url.hostname, url.port or 80, url.path.rstrip("/"), lines.encode("latin-1"))


class ChunkedBody:
    """Incremental decoder of a `Transfer-Encoding: chunked` body (RFC 9112 §7.1): `feed` takes
    the bytes read, returns the payload they complete; `done` once the last (empty) chunk came.
    Chunk extensions are ignored; trailers are not read (the connection closes after)."""

    def __init__(self) -> None:
        self._pending = b""  # an unfinished chunk-size line
        self._data_left = 0  # payload bytes of the current chunk still to come
        self._crlf_left = 0  # bytes of the CRLF after it still to come
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Payload bytes in `data` (and in what earlier calls left unfinished).

        Raises:
            ValueError: a chunk-size line that is not hexadecimal.
        """
        buf = self._pending + data if self._pending else data
        self._pending = b""
        out = []
        pos, end = 0, len(buf)
        while pos < end and not self.done:
            if self._data_left:
                take = min(self._data_left, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._data_left -= take
            elif self._crlf_left:
                take = min(self._crlf_left, end - pos)
                pos += take
                self._crlf_left -= take
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    self._pending = buf[pos:]
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                pos = eol + 2
                if size == 0:
                    self.done = True
                else:
                    self._data_left, self._crlf_left = size, 2
        return b"".join(out)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    """The status code and the lower-cased header fields of the response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    fields = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return int(parts[1]), fields


async def _body(reader: asyncio.StreamReader, fields: dict[bytes, bytes]) -> AsyncIterator[bytes]:
    """The response body's payload as it arrives (chunked, Content-Length, or until close).

    Raises:
        ConnectionError: the connection closed before a chunked or sized body ended.
    """
    chunked = ChunkedBody() if fields.get(b"transfer-encoding", b"").lower() == b"chunked" else None
    length = fields.get(b"content-length")
    left = int(length) if chunked is None and length is not None else -1
    while left:
        data = await reader.read(_READ_SIZE if left < 0 else min(left, _READ_SIZE))
        if not data:
            if chunked is not None or left > 0:
                raise ConnectionError("the server closed the connection mid-response")
            return
        if chunked is not None:
            payload = chunked.feed(data)
            if payload:
                yield payload
            if chunked.done:
                return
        else:
            left = left - len(data) if left > 0 else left
            yield data


async def stream_data_lines(target: Target, path: str, body: bytes) -> AsyncGenerator[bytes, None]:
    """POST `body` (JSON bytes) to `path` under `target` and yield the payload of each
    server-sent event `data:` line (bytes, without "data: "), as they arrive, until the server
    ends the response. The caller bounds the time (e.g. `asyncio.timeout`).

    Raises:
        HTTPStatusError: a status other than 200 (with the body's first 200 characters).
        OSError / ConnectionError: the connection failed or closed mid-response.
        ValueError: the answer is not HTTP/1.x or its chunked framing is broken.
    """
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        host = f"[{target.host}]" if ":" in target.host else target.host  # an IPv6 literal
        head = (
            f"POST {target.prefix}{path} HTTP/1.1\r\nHost: {host}:{target.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        ).encode("latin-1")
        writer.write(head + target.headers + b"\r\n" + body)
        status, fields = await _read_head(reader)
        if status != 200:
            text = b"".join([piece async for piece in _body(reader, fields)])
            raise HTTPStatusError(status, text[:200].decode("utf-8", "replace"))
        rest = b""
        async for piece in _body(reader, fields):
            lines = (rest + piece).split(b"\n")
            rest = lines.pop()
            for line in lines:
                if line.startswith(b"data: "):
                    yield line[6:].rstrip(b"\r")
        if rest.startswith(b"data: "):
            yield rest[6:].rstrip(b"\r")
    finally:
        writer.close()
