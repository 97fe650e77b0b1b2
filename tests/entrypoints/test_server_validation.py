"""Reliability suite items 1-6: client mistakes are 4xx in OpenAI's error shape, never 5xx."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import API_KEY

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert len(error["message"]) <= 500
    if param is not None:
        assert error["param"] == param, error
        assert param.split(".")[0] in error["message"], error
    return error


# -- 1. parameter-validation matrix ----------------------------------------------------------------

CASES = [
    # (endpoint, extra fields, the parameter the error must name)
    (COMPLETIONS, {"temperature": -0.5}, "temperature"),
    (COMPLETIONS, {"top_p": 0.0}, "top_p"),
    (COMPLETIONS, {"top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"top_p": -1}, "top_p"),
    (COMPLETIONS, {"n": 0}, "n"),
    (COMPLETIONS, {"n": -3}, "n"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"frequency_penalty": 3}, "frequency_penalty"),
    (COMPLETIONS, {"logprobs": 50}, "logprobs"),
    (COMPLETIONS, {"unknown_field": 1}, "unknown_field"),
    (COMPLETIONS, {"temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"temperature": True}, "temperature"),
    (COMPLETIONS, {"max_tokens": "16"}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 1.5}, "max_tokens"),
    (COMPLETIONS, {"n": [1]}, "n"),
    (COMPLETIONS, {"stop": 5}, "stop"),
    (COMPLETIONS, {"stream": "yes"}, "stream"),
    (COMPLETIONS, {"seed": "x"}, "seed"),
    (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"stop_token_ids": [10**6]}, "stop_token_ids"),  # beyond the vocabulary
    (COMPLETIONS, {"seed": 2**64}, "seed"),
    (CHAT, {"stop_token_ids": [10**6]}, "stop_token_ids"),
    (CHAT, {"temperature": -1}, "temperature"),
    (CHAT, {"top_p": 2}, "top_p"),
    (CHAT, {"n": 0}, "n"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"bogus": None}, "bogus"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages.0.extra"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), CASES)
def test_invalid_parameter_is_400_naming_it(client, endpoint, fields, param):
    base = {"prompt": "Hello"} if endpoint == COMPLETIONS else {"messages": MESSAGES}
    assert_error(client.post(endpoint, json={**base, "max_tokens": 4, **fields}), 400, param)


def test_missing_prompt_is_400(client):
    assert_error(client.post(COMPLETIONS, json={"max_tokens": 4}), 400, "prompt")
    assert_error(client.post(CHAT, json={"max_tokens": 4}), 400, "messages")


def test_sdk_raises_bad_request(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", temperature=-2)
    assert "temperature" in str(e.value)


# -- 2. context overflow ---------------------------------------------------------------------------


def test_context_overflow_is_400(client, openai_client):
    long_prompt = "hello " * 600  # > 512 tokens
    error = assert_error(client.post(COMPLETIONS, json={"prompt": long_prompt}), 400)
    assert "maximum context length is 512 tokens" in error["message"]
    error = assert_error(
        client.post(COMPLETIONS, json={"prompt": "hello " * 300, "max_tokens": 400}), 400
    )
    assert "maximum context length is 512 tokens" in error["message"]
    assert error["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "hello " * 450}],
            max_tokens=100,
        )
    assert "maximum context length is 512 tokens" in str(e.value)
    # Fits exactly: prompt + max_tokens == 512 is accepted (never silently truncated).
    ids = client.post("/tokenize", json={"prompt": "hello " * 600}).json()["tokens"][:500]
    r = client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 12})
    assert r.status_code == 200, r.text
    assert_error(
        client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 13}), 400, "max_tokens"
    )


# -- 3. malformed and truncated JSON ---------------------------------------------------------------

MALFORMED = [
    b"",
    b"{",
    b'{"prompt": "x",',
    b'{"prompt": "x", "max_tokens": ',
    b'{"prompt": "' + b"a" * 100_000,
    b"nul",
    b"\xff\xfe\x00garbage",
    b"[" * 100_000,
    b'{"prompt": "x"}}',
    b"[1, 2, 3]",
    b'"just a string"',
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT, "/tokenize"])
def test_malformed_json_is_400_bounded(main_server, endpoint, body):
    headers = {**main_server.headers, "Content-Type": "application/json"}
    r = httpx.post(main_server.url + endpoint, content=body, headers=headers, timeout=30)
    assert_error(r, 400)


# -- 4. token ids outside the vocabulary -----------------------------------------------------------


@pytest.mark.parametrize("ids", [[1, 2, 49152], [-1, 5], [10**12], [[1, 2], [3, 10**6]]])
def test_out_of_vocab_ids_are_400(client, ids):
    assert_error(client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 2}), 400, "prompt")


def test_detokenize_out_of_vocab_is_400(client):
    assert_error(client.post("/detokenize", json={"tokens": [1, 10**9]}), 400, "tokens")
    assert client.post("/detokenize", json={"tokens": [28120]}).status_code == 200


def test_empty_prompt_is_400(client):
    assert_error(client.post(COMPLETIONS, json={"prompt": [], "max_tokens": 2}), 400, "prompt")


# -- 5. unknown model --------------------------------------------------------------------------------


def test_unknown_model_is_404(client, openai_client):
    error = assert_error(client.post(COMPLETIONS, json={"prompt": "x", "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    models = openai_client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


# -- 6. API key --------------------------------------------------------------------------------------


def test_api_key(main_server):
    url = main_server.url + COMPLETIONS
    body = {"prompt": "Hi", "max_tokens": 2}
    assert_error(httpx.post(url, json=body, timeout=30), 401)
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401)
    assert_error(httpx.post(url, json=body, headers={"Authorization": API_KEY}), 401)
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert httpx.get(main_server.url + "/health").status_code == 200  # health needs no key
    bad = openai.OpenAI(base_url=main_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- the other endpoints -------------------------------------------------------------------------


def test_tokenize_detokenize_version(client):
    r = client.post("/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) and r.json()["max_model_len"] == 512
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "Hello world"
    chat = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > len(tokens)
    assert_error(client.post("/tokenize", json={}), 400)
    assert client.get("/version").json()["version"]
    assert_error(client.get("/no/such/path"), 404)
    assert_error(client.get(COMPLETIONS), 405)
