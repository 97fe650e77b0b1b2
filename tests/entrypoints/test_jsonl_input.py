"""Batch-job input lines: every bad line fails alone with its id or custom_id kept (bytes that
are not UTF-8, nesting, huge numbers, wrong types, lone surrogates), a BOM is accepted, and
lines are numbered by their physical position (blank lines count)."""

from __future__ import annotations

import json

import pytest

import phloem.worker.sampling_rows as sampling_rows_module
from phloem import LLM
from phloem.entrypoints.generate import parse_line, run_generate
from phloem.entrypoints.jsonl_input import read_lines
from tests.engine.tiny_models import VOCAB, tiny_model_dir

DEFAULTS = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
DEEP = "[" * 1000 + "]" * 1000
DEEP_RECORD = '{"id": "deep", "prompt": "hi", "x": ' + DEEP + "}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory, embedded_tokenizer_dir):
    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_jsonl", 7)
    return LLM(str(path), block_size=4, max_num_batched_tokens=64)


def test_read_lines_numbers_physical_lines_and_keeps_bad_bytes(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b'\xef\xbb\xbf{"id": "a"}\n\n   \n{"id": "b\xff"}\r\n{"x": "\xe2\x80\xa8"}\rlast'
    )
    lines = read_lines(str(src))
    assert [n for n, _ in lines] == [1, 4, 5, 6]
    assert lines[0][1] == '{"id": "a"}'  # the BOM is gone
    assert lines[1][1] == '{"id": "b\udcff"}'  # the byte is kept for the line's error
    assert lines[2][1] == '{"x": "\u2028"}'  # not a line break inside JSON


@pytest.mark.parametrize(
    "raw, line_id, error",
    [
        (DEEP_RECORD, "deep", "nested too deeply"),
        ('{"id": "bytes", "prompt": "caf\udce9"}', "bytes", "invalid UTF-8: byte 0xe9 at column"),
        ('{"id": "bad\udcff", "prompt": "x"}', "bad\ufffd", "invalid UTF-8: byte 0xff"),
        ('{"prompt": "caf\udce9', "7", "invalid UTF-8: byte 0xe9"),
        ('{"id": "sur", "prompt": "a\\ud800"}', "sur", "lone surrogate"),
        ('{"id": ' + "1" * 5000 + ', "prompt": "x"}', "7", "invalid JSON: Exceeds the limit"),
        ('{"id": "t", "prompt": "x", "skip_special_tokens": "no"}', "t", "skip_special_tokens"),
        ('{"id": "s", "prompt": "x", "seed": 18446744073709551616}', "s", "seed must be in"),
        ('{"id": "v", "prompt": "x", "stop_token_ids": [' + str(VOCAB) + "]}", "v", "vocabulary"),
        ('{"id": "r", "messages": [{"role": "robot", "content": "x"}]}', "r", "role must be"),
    ],
    ids=["deep", "bytes", "bytes-in-id", "bytes-bad-json", "surrogate", "huge-int", "bool-type",
         "seed", "vocab", "role"],
)  # fmt: skip
def test_a_bad_line_fails_alone_with_its_id(llm, raw, line_id, error):
    parsed = parse_line(llm, raw, 7, DEFAULTS)
    assert parsed.id == line_id
    assert parsed.error is not None and error in parsed.error
    json.dumps(parsed.error, ensure_ascii=False).encode("utf-8")  # writable as UTF-8


def test_content_parts_are_accepted_as_on_the_server(llm):
    raw = json.dumps({"id": "p", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})  # fmt: skip
    plain = json.dumps({"id": "p", "messages": [{"role": "user", "content": "Hi"}]})
    parsed = parse_line(llm, raw, 1, DEFAULTS)
    assert parsed.error is None
    assert parsed.prompt_token_ids == parse_line(llm, plain, 1, DEFAULTS).prompt_token_ids


def test_generate_job_with_bom_blank_lines_bad_bytes_and_a_failing_request(
    llm, tmp_path, monkeypatch
):
    real = sampling_rows_module.seeded_generator

    def seeded_generator(seed, device):  # a request whose sampling setup raises, in the run
        if seed == 1234:
            raise RuntimeError("injected generator fault")
        return real(seed, device)

    monkeypatch.setattr(sampling_rows_module, "seeded_generator", seeded_generator)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(
        b'\xef\xbb\xbf{"id": "first", "prompt": "Hello"}\n'
        b"\n"
        b'{"prompt": "no id, line 3"}\n'
        b'{"id": "bytes", "prompt": "caf\xe9"}\n'
        b"\n" + DEEP_RECORD.encode() + b"\n"
        b'{"id": "seeded", "prompt": "Hi", "seed": 1234, "temperature": 1.0}\n'
        b"{not json\n"
        b'{"id": "last", "prompt": "Bye"}\n'
    )
    run_generate(llm, str(src), str(out), DEFAULTS, use_tqdm=False)
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == ["first", "3", "bytes", "deep", "seeded", "8", "last"]
    by_id = {r["id"]: r for r in records}
    for good in ("first", "3", "last"):
        assert "error" not in by_id[good] and by_id[good]["num_output_tokens"] == 3
    assert "byte 0xe9" in by_id["bytes"]["error"]
    assert "line 6" in by_id["deep"]["error"] and "nested too deeply" in by_id["deep"]["error"]
    assert "injected generator fault" in by_id["seeded"]["error"]
    assert by_id["8"]["error"].startswith("line 8: invalid JSON")
    assert not llm.llm_engine.has_unfinished_requests()


def test_run_batch_line_with_bad_bytes_fails_alone_with_its_custom_id(llm):
    pytest.importorskip("fastapi")
    from phloem.entrypoints.openai.serving import Frontend
    from phloem.entrypoints.run_batch import parse_batch_line

    engine = llm.llm_engine
    front = Frontend(llm.get_tokenizer(), engine.max_model_len, engine.validate_prompt, "tiny")

    def parse(body: str, custom_id: str = "c1"):
        raw = '{"custom_id": "' + custom_id + '", "url": "/v1/completions", "body": ' + body + "}"
        return parse_batch_line(front, raw, 3, {}, engine.validate_params)

    bad_bytes = parse('{"prompt": "caf\udce9", "max_tokens": 2}')
    assert bad_bytes.custom_id == "c1" and "byte 0xe9" in bad_bytes.error.message
    deep = parse('{"prompt": "x", "user": ' + DEEP + "}")
    assert deep.custom_id == "c1" and "nested too deeply" in deep.error.message
    deep_line = parse_batch_line(front, '{"custom_id": "d", "x": ' + DEEP + "}", 4, {})
    assert deep_line.custom_id == "d" and "nested too deeply" in deep_line.error.message
    vocab = parse('{"prompt": "x", "stop_token_ids": [' + str(VOCAB) + "]}")
    assert vocab.error.param == "stop_token_ids" and "vocabulary" in vocab.error.message
    seed = parse('{"prompt": "x", "seed": -9223372036854775809}')
    assert seed.error.param == "seed"
    odd_id = parse('{"prompt": "x"}', custom_id="id\udcff")
    assert odd_id.custom_id == "id\ufffd" and "byte 0xff" in odd_id.error.message
    assert parse('{"prompt": "x", "max_tokens": 2}').error is None
