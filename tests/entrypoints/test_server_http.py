"""HTTP conventions and server limits (issue 23) against the running test server.

`Allow` on 405, HEAD on /health and /metrics, /openapi.json and /docs behind the key, which
routes the key leaves open, `stream_options.continuous_usage_stats`, the `param` of
context-length errors, and the limits on `n`, prompts per request and the body size.
"""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.test_server_streaming import sse_events
from tests.entrypoints.test_server_validation import CHAT, COMPLETIONS, MESSAGES, assert_error


def test_405_names_the_allowed_methods(main_server, client):
    r = client.post("/health")
    assert_error(r, 405)
    assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
    r = client.get(COMPLETIONS)
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_head(main_server, path):
    r = httpx.head(main_server.url + path, timeout=10)
    assert r.status_code == 200 and r.content == b""


def test_open_and_protected_routes(main_server):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(main_server.url + path, timeout=10).status_code == 200, path
    for path in ("/openapi.json", "/docs", "/v1/models"):
        assert_error(httpx.get(main_server.url + path, timeout=10), 401)
    assert_error(httpx.post(main_server.url + "/tokenize", json={"prompt": "x"}, timeout=10), 401)


def test_openapi_document_and_docs(client):
    r = client.get("/openapi.json")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for path, name in ((COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert {"max_tokens", "seed", "stream_options"} <= set(schemas[name]["properties"])
    refs = {ref for ref in _refs(doc)}
    assert all(ref.rsplit("/", 1)[1] in schemas for ref in refs), refs
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert "/openapi.json" in docs.text


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_continuous_usage_stats(client, endpoint):
    base = {"prompt": "Count: one, two,"} if endpoint == COMPLETIONS else {"messages": MESSAGES}
    body = {**base, "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    with client.stream("POST", endpoint, json={**body, "stream_options": options}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages), chunks
    prompt = usages[-1]["prompt_tokens"]
    assert prompt > 0 and all(u["prompt_tokens"] == prompt for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 6
    assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == []  # the final usage chunk, as with include_usage alone
    assert completion[-2] == 6  # the chunk with the last token already counts it
    # include_usage alone: usage is null until the final chunk
    with client.stream(
        "POST", endpoint, json={**body, "stream_options": {"include_usage": True}}
    ) as r:
        plain = sse_events(r)[:-1]
    assert (
        all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6
    )


def test_context_length_error_names_the_field_at_fault(client):
    ids = client.post("/tokenize", json={"prompt": "hello " * 600}).json()["tokens"]
    # The prompt alone fills the context: the prompt is at fault.
    error = assert_error(client.post(COMPLETIONS, json={"prompt": ids[:512]}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    # The prompt fits, max_tokens does not.
    error = assert_error(
        client.post(COMPLETIONS, json={"prompt": ids[:500], "max_tokens": 13}), 400, "max_tokens"
    )
    assert "at most 12" in error["message"]
    long = [{"role": "user", "content": "hello " * 600}]
    assert_error(client.post(CHAT, json={"messages": long, "max_tokens": 4}), 400, "messages")
    assert_error(
        client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 600}), 400, "max_tokens"
    )
    r = client.post(CHAT, json={"messages": MESSAGES, "max_completion_tokens": 600})
    assert_error(r, 400, "max_completion_tokens")


def test_n_and_prompt_count_limits(client):
    error = assert_error(client.post(COMPLETIONS, json={"prompt": "x", "n": 129}), 400, "n")
    assert "128" in error["message"] and "--max-n" in error["message"]
    assert_error(client.post(CHAT, json={"messages": MESSAGES, "n": 10**6}), 400, "n")
    r = client.post(COMPLETIONS, json={"prompt": ["x"] * 129, "max_tokens": 1})
    error = assert_error(r, 400, "prompt")
    assert "128" in error["message"] and "--max-prompts-per-request" in error["message"]
    r = client.post(COMPLETIONS, json={"prompt": [[1, 2]] * 129, "max_tokens": 1})
    assert_error(r, 400, "prompt")


def test_body_limit_is_413(main_server):
    headers = {**main_server.headers, "Content-Type": "application/json"}
    body = b'{"prompt": "' + b"a" * (16 << 20) + b'"}'  # the default limit is 16 MiB
    r = httpx.post(main_server.url + COMPLETIONS, content=body, headers=headers, timeout=60)
    error = assert_error(r, 413)
    assert error["code"] == "request_too_large" and str(16 << 20) in error["message"]
