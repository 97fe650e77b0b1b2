"""Hostile requests against the app in-process (issue 23): no 5xx, and the engine lives on.

Property-based (hypothesis) requests over every field of /v1/completions and
/v1/chat/completions: each field takes a plausible value, an integer or float extreme (2^64,
-2^63-1, 1e308, NaN and Infinity as raw JSON text, ...) or a random JSON value. After each one,
no 5xx (in-band stream errors of the server's kind included) and `/health` is 200.

The app runs on a tiny random-weight Llama (2 layers) through Starlette's TestClient, with small
server limits (`--max-n 4`, a 64 KiB body limit) so that every example is cheap.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import event as count_event
from hypothesis import strategies as st

from phloem.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.engine.tiny_models import tiny_model_dir

MAX_MODEL_LEN = 96
BODY_LIMIT = 64 << 10

INT_EXTREMES = [2**64, 2**64 - 1, 2**63, 2**63 - 1, -(2**63), -(2**63) - 1, -(2**64), 2**31,
                10**30, -1, 0, 1]  # fmt: skip
FLOAT_EXTREMES = [1e308, -1e308, 1.7976931348623157e308, 5e-324, -0.0, 0.5, 2.5,
                  float("nan"), float("inf"), float("-inf")]  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory, embedded_tokenizer_dir):
    from starlette.testclient import TestClient

    from phloem.entrypoints.cli import build_parser
    from phloem.entrypoints.openai.app import build_app
    from phloem.entrypoints.serve import build_state

    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_fuzz", 7)
    args = build_parser().parse_args(
        ["serve", "--model", str(path), "--max-model-len", str(MAX_MODEL_LEN), "--max-n", "4",
         "--max-prompts-per-request", "4", "--max-request-body-bytes", str(BODY_LIMIT)]
    )  # fmt: skip
    state = build_state(args)
    with TestClient(build_app(state), raise_server_exceptions=False) as c:
        yield c


# -- strategies -----------------------------------------------------------------------------------


def _mostly(common, rare, one_in: int = 6):
    """`rare` about once in `one_in` draws, else `common` (st.one_of weighs by branch only)."""
    return st.integers(1, one_in).flatmap(lambda k: rare if k == 1 else common)


scalars = st.one_of(
    st.sampled_from(INT_EXTREMES),
    st.sampled_from(FLOAT_EXTREMES),
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
token_ids = _mostly(
    st.lists(st.integers(0, 49151), min_size=1, max_size=6),
    st.lists(st.one_of(st.integers(0, 49151), st.sampled_from(INT_EXTREMES)), max_size=4),
)
ROLES = ["system", "user", "assistant", "developer", "tool"]
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": _mostly(st.sampled_from(ROLES), json_values, 10),
            "content": _mostly(
                st.one_of(
                    st.text(min_size=1, max_size=40),
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.just("text"), "text": st.text(max_size=20)}
                        ),
                        min_size=1,
                        max_size=2,
                    ),
                ),
                st.one_of(st.none(), json_values),
                10,
            ),
        },
        optional={"name": _mostly(st.text(max_size=8), json_values)},
    ),
    min_size=1,
    max_size=3,
)
PLAUSIBLE = {
    "prompt": st.one_of(
        st.text(min_size=1, max_size=60),
        token_ids,
        st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=5),
        st.lists(token_ids, min_size=1, max_size=5),
    ),  # fmt: skip
    "messages": messages,
    "max_tokens": st.integers(-2, 6),
    "max_completion_tokens": st.integers(-2, 6),
    "n": st.integers(-1, 5),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 60000),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-(2**64), 2**65),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": token_ids,
    "logprobs": st.one_of(st.integers(-1, 25), st.booleans()),
    "top_logprobs": st.integers(-1, 25),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(-100, 100), max_size=2),
}


PLAUSIBLE.update(
    {
        name: st.booleans()
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "echo",
            "add_generation_prompt",
            "parallel_tool_calls",
        )
    }  # fmt: skip
)
PLAUSIBLE.update(
    {
        "model": st.none(),
        "user": st.text(max_size=12),
        "suffix": st.one_of(st.none(), st.text(max_size=4)),
        "best_of": st.integers(-1, 5),
        "min_tokens": st.integers(-1, 8),
        "repetition_penalty": st.floats(-1, 3),
        "presence_penalty": st.floats(-3, 3),
        "frequency_penalty": st.floats(-3, 3),
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json"])}),
        "tools": st.lists(
            st.dictionaries(st.text(max_size=4), json_values, max_size=2), max_size=2
        ),
        "tool_choice": st.sampled_from(["none", "auto", None]),
    }
)


def _value(name: str):
    """A plausible value half the time; else an extreme or any JSON value."""
    plausible = PLAUSIBLE.get(name, json_values)
    extreme = st.sampled_from(INT_EXTREMES + FLOAT_EXTREMES)
    return _mostly(plausible, st.one_of(extreme, json_values), 4)


def _request(model_cls, required: str):
    """The required field, max_tokens and up to 3 other fields of the request model (or an unknown one),
    so that most requests get past validation to the engine with one or two odd values."""
    names = sorted(set(model_cls.model_fields) - {required, "max_tokens"}) + ["not_a_field"]

    @st.composite
    def build(draw):
        plausible = PLAUSIBLE[required]
        body = {required: draw(_mostly(plausible, json_values, 10))}
        # max_tokens is there and small most of the time: chat's default is the whole context
        body["max_tokens"] = draw(_mostly(st.integers(1, 4), _value("max_tokens"), 5))
        for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
            body[name] = draw(_value(name))
        return body

    return build()


# -- the checks -----------------------------------------------------------------------------------


def _post(client, path: str, body: dict) -> None:
    """POST the body as raw JSON text (NaN/Infinity included); assert no server-side failure."""
    text = json.dumps(body)  # NaN -> NaN, inf -> Infinity: JSON extensions Python's parser takes
    r = client.post(path, content=text, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], text[:500])
    count_event(f"HTTP {r.status_code}")
    if r.status_code == 200 and body.get("stream") is True:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for event in events[:-1]:
            error = json.loads(event).get("error")
            assert error is None or error["type"] != "server_error", (error, text[:500])
    elif r.status_code != 200:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
    health = client.get("/health")
    assert health.status_code == 200, ("engine died", text[:500], health.text)


SETTINGS = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI never flakes on a new draw
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(body=_request(CompletionRequest, "prompt"))
@example(body={"prompt": "Hi", "max_tokens": 4, "seed": 2**64})
@example(body={"prompt": "Hi", "max_tokens": 4, "seed": 2**64 - 1, "n": 2})
@example(body={"prompt": "Hi", "max_tokens": 2, "temperature": float("nan")})
@example(body={"prompt": "Hi", "max_tokens": 2, "top_k": 2**63, "top_p": 5e-324})
@example(body={"prompt": [1, 2], "max_tokens": 2, "stop_token_ids": [2**63 - 1]})
@example(body={"prompt": "Hi", "max_tokens": 2**64, "n": 2**64})
@example(body={"prompt": "Hi", "max_tokens": 3, "stream": True, "logprobs": 20, "n": 4})
def test_fuzz_completions(client, body):
    _post(client, "/v1/completions", body)


@SETTINGS
@given(body=_request(ChatCompletionRequest, "messages"))
@example(body={"messages": [{"role": "user", "content": "Hi"}], "seed": -(2**63) - 1})
@example(body={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 2**64})
@example(body={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
               "frequency_penalty": float("-inf"), "presence_penalty": 1e308})  # fmt: skip
@example(body={"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2**63,
               "top_logprobs": 2**64, "logprobs": True})  # fmt: skip
def test_fuzz_chat(client, body):
    _post(client, "/v1/chat/completions", body)


def test_body_limit_is_413_in_openai_shape(client):
    """`--max-request-body-bytes` (64 KiB here): a larger body is refused unparsed."""
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}')
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_prompt_char_bound_rejects_untokenized(client):
    """A prompt longer than chars-per-token bound x max_model_len is a 400 naming it."""
    from phloem.entrypoints.openai.limits import max_prompt_chars

    state = client.app.state.phloem
    bound = max_prompt_chars(state.tokenizer, MAX_MODEL_LEN)
    assert state.max_prompt_chars == bound
    text = "a" * (bound + 1)
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert str(bound) in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
