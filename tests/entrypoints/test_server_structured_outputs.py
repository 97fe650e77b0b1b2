"""Structured outputs over the OpenAI-compatible server, with the official `openai` client:
`response_format` (json_schema, json_object) on chat completions, streamed and not; vLLM's
`structured_outputs` and `guided_*` fields on completions; every bad constraint a 400 naming
the field, and the server goes on serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
}
MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Describe one city as JSON."}]


def json_schema_format(schema=SCHEMA) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": schema, "strict": True},
    }


def test_chat_response_format_json_schema(openai_client):
    out = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
        response_format=json_schema_format(),
    )  # fmt: skip
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"


def test_chat_response_format_json_schema_streamed(openai_client):
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0.7, seed=3, stream=True,
        response_format=json_schema_format(),
    )  # fmt: skip
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reasons[-1] == "stop"


def test_chat_json_object(openai_client):
    out = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_completions_structured_outputs_and_guided_fields(openai_client):
    regex = r"\d{3}-\d{4}"
    out = openai_client.completions.create(
        model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    assert re.fullmatch(regex, out.choices[0].text)
    assert out.choices[0].finish_reason == "stop"
    out = openai_client.completions.create(
        model=MODEL, prompt="Is water wet? Answer:", max_tokens=5, n=2, temperature=1.0, seed=1,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert all(c.text in ("yes", "no") for c in out.choices)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": json_schema_format({"type": "no-such-type"})},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "root ::= \"a\" | ("}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)  # fmt: skip
def test_bad_constraint_is_a_400_naming_the_field(openai_client, extra, param):
    body = dict(extra)
    response_format = body.pop("response_format", openai.NOT_GIVEN)
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=response_format,
            extra_body=body,
        )  # fmt: skip
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    # the server keeps serving
    out = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert out.choices[0].message.content is not None
