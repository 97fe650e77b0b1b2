"""Structured outputs in the batch jobs, on the embedded model: `phloem generate` lines carry
`structured_outputs` (a SamplingParams field), `phloem run-batch` bodies carry `response_format`
and vLLM's fields; a bad constraint fails its line alone, naming the field, and the rest of the
batch runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from phloem import SamplingParams
from phloem.entrypoints.generate import run_generate
from phloem.entrypoints.run_batch import run_batch

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genre": {"enum": ["drama", "comedy", "horror"]},
    },
    "required": ["title", "year", "genre"],
}
REGEX = r"(Mon|Tue|Wed|Thu|Fri)day"


def write_lines(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_generate_lines_with_constraints(embedded_llm, tmp_path):
    good = [
        {"id": "schema-greedy", "prompt": "A film as JSON:", "structured_outputs": {"json": SCHEMA}},
        {"id": "schema-sampled", "prompt": "Another film as JSON:", "temperature": 0.8,
         "seed": 4, "structured_outputs": {"json": SCHEMA}},
        {"id": "regex", "prompt": "A weekday:", "structured_outputs": {"regex": REGEX}},
        {"id": "free", "prompt": "Hello"},
    ]  # fmt: skip
    bad = [
        {"id": "bad-schema", "prompt": "x", "structured_outputs": {"json": {"type": "nope"}}},
        {"id": "bad-regex", "prompt": "x", "structured_outputs": {"regex": "[a-"}},
        {"id": "empty-choice", "prompt": "x", "structured_outputs": {"choice": []}},
        {"id": "two-kinds", "prompt": "x", "structured_outputs": {"regex": "a", "json": {}}},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(src, good[:2] + bad[:2] + good[2:] + bad[2:])
    run_generate(embedded_llm, str(src), str(out), {"max_tokens": 60}, use_tqdm=False)
    by_id = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert len(by_id) == 8
    for key in ("schema-greedy", "schema-sampled"):
        jsonschema.validate(json.loads(by_id[key]["text"]), SCHEMA)
        assert by_id[key]["finish_reason"] == "stop"
    assert re.fullmatch(REGEX, by_id["regex"]["text"])
    assert by_id["free"]["text"]
    assert "structured_outputs.json" in by_id["bad-schema"]["error"]
    assert "structured_outputs.regex" in by_id["bad-regex"]["error"]
    assert "structured_outputs.choice" in by_id["empty-choice"]["error"]
    assert "exactly one of" in by_id["two-kinds"]["error"]


def batch_line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_run_batch_response_format(embedded_llm, tmp_path):
    messages = [{"role": "user", "content": "Name a film as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA}}
    lines = [
        batch_line("schema", {"messages": messages, "max_tokens": 60, "response_format": fmt}),
        batch_line("choice", {"prompt": "Yes or no?", "max_tokens": 4,
                              "guided_choice": ["yes", "no"]}, "/v1/completions"),
        batch_line("bad", {"messages": messages, "response_format": {
            "type": "json_schema", "json_schema": {"name": "f", "schema": {"type": "nope"}}}}),
    ]  # fmt: skip
    src, out = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    write_lines(src, lines)
    run_batch(embedded_llm, str(src), str(out), "SmolLM2-135M-Instruct", use_tqdm=False)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    body = records["schema"]["response"]["body"]
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
    assert records["choice"]["response"]["body"]["choices"][0]["text"] in ("yes", "no")
    bad = records["bad"]["response"]
    assert bad["status_code"] == 400
    assert bad["body"]["error"]["param"] == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        ({"json": {"type": "unknown-type"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": ["a list"]}, "structured_outputs.json"),
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 3]}, "structured_outputs.choice"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"jsn": {}}, "unknown structured_outputs field"),
    ],
)
def test_bad_constraint_names_the_field(embedded_llm, constraint, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        params = SamplingParams(structured_outputs=constraint)
        embedded_llm.llm_engine.validate_params(params)
