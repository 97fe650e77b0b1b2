"""Reliability suite item 17: a bounded load test against the embedded model.

N concurrent streaming clients (default 200) each send requests back to back for D seconds
(default 10 in the regular run; the issue's full test is 60 s):

    PHLOEM_LOAD_TEST_SECONDS=60 PHLOEM_LOAD_TEST_CLIENTS=200 \
        pytest tests/entrypoints/test_server_load.py

Every response must be 200, every stream must end with `data: [DONE]` after at least one token,
and when the clients stop, nothing runs or waits and the KV pool is back at its idle level.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx

SECONDS = float(os.environ.get("PHLOEM_LOAD_TEST_SECONDS", "10"))
CLIENTS = int(os.environ.get("PHLOEM_LOAD_TEST_CLIENTS", "200"))


async def _client(base_url, headers, index: int, deadline: float, stats: dict) -> None:
    limits = httpx.Limits(max_connections=1)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits) as client:
        k = 0
        while k == 0 or time.monotonic() < deadline:  # every client sends at least one request
            k += 1
            chat = (index + k) % 2 == 0
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body = {"max_tokens": 4 + (index % 5), "stream": True, "temperature": 0.7}
            if chat:
                body["messages"] = [{"role": "user", "content": f"Say a number: {index}"}]
            else:
                body["prompt"] = f"Client {index} request {k}: the answer is"
            if index % 7 == 0:
                body["stream_options"] = {"include_usage": True}
            try:
                async with client.stream("POST", path, json=body, timeout=300) as r:
                    stats["status"][r.status_code] = stats["status"].get(r.status_code, 0) + 1
                    if r.status_code != 200:
                        await r.aread()
                        stats["bodies"].append(r.text[:300])
                        continue
                    events = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
            except httpx.HTTPError as e:
                stats["transport_errors"].append(repr(e))
                continue
            if not events or events[-1] != "[DONE]":
                stats["unterminated"] += 1
                continue
            payloads = [json.loads(e) for e in events[:-1]]
            if any("error" in p for p in payloads):
                stats["in_band_errors"].append(str(payloads[-1])[:300])
            if not any(p.get("choices") for p in payloads):
                stats["empty"] += 1
            stats["completed"] += 1


def test_bounded_load(main_server):
    main_server.wait_idle()
    stats = {
        "status": {},
        "bodies": [],
        "transport_errors": [],
        "unterminated": 0,
        "in_band_errors": [],
        "empty": 0,
        "completed": 0,
    }

    async def main() -> None:
        deadline = time.monotonic() + SECONDS
        await asyncio.gather(
            *[
                _client(main_server.url, main_server.headers, i, deadline, stats)
                for i in range(CLIENTS)
            ]
        )

    asyncio.run(main())
    server_errors = {s: n for s, n in stats["status"].items() if s >= 500}
    assert not server_errors, (server_errors, stats["bodies"][:3])
    assert set(stats["status"]) == {200}, (stats["status"], stats["bodies"][:3])
    assert not stats["transport_errors"], stats["transport_errors"][:3]
    assert stats["unterminated"] == 0
    assert not stats["in_band_errors"], stats["in_band_errors"][:3]
    assert stats["empty"] == 0
    assert stats["completed"] >= CLIENTS, stats  # every client finished at least one stream
    metrics = main_server.wait_idle(timeout=60)
    assert metrics["phloem:kv_cache_usage_perc"] == 0.0
    assert main_server.proc.poll() is None, "the server died under load"
