"""Reliability suite items 15-16, and the same crash-safety for `phloem generate`.

`kill -9` lands at a random point of the job; a torn last line is also forced by hand (a kill in
the middle of a write is hard to hit on purpose). After a rerun, every input line has exactly
one output line, none duplicated, none lost, and records finished before the kill are kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phloem.entrypoints.resumable import ResultLog

CLI = [sys.executable, "-m", "phloem.entrypoints.cli"]
PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "def add(a, b):",
    "Once upon a time",
    "The best way to learn is",
    "Water is made of",
]


# -- the log itself (no model) ---------------------------------------------------------------------


def test_result_log_drops_torn_tail_and_duplicates(tmp_path):
    path = tmp_path / "log.jsonl"
    log = ResultLog(str(path), key_of=lambda r: r.get("k") if r.get("k", -1) >= 0 else None)
    for k in range(3):
        log.append({"k": k, "text": "é" * k})
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"k": 1, "text": "dup"}\n')  # a duplicate key: the first record wins
        f.write(b"not json\n")
        f.write(b'{"k": -5}\n')  # not this job's record
        f.write('{"k": 3, "text": "\u00e9'.encode()[:-1])  # torn mid-character, no newline
    log = ResultLog(str(path), key_of=lambda r: r.get("k") if r.get("k", -1) >= 0 else None)
    done = log.load()
    assert sorted(done) == [0, 1, 2] and done[1]["text"] == "é"
    log.append({"k": 3, "text": "again"})
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x)["k"] for x in lines[:-1]] == [0, 1, 2, 3]


def test_write_atomically_leaves_no_temporary_file_when_the_disk_fills(tmp_path):
    """A write that fails for room (here a file size limit, in a child process) leaves the old
    file as it was and no `.tmp` file behind."""
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); "
        "from phloem.entrypoints.resumable import write_atomically; "
        f"write_atomically({str(path)!r}, ['x' * 100] * 100)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1 and "File too large" in result.stderr
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["out.jsonl"]


# -- run-batch --------------------------------------------------------------------------------------


def batch_lines() -> list[str]:
    lines = []
    for i in range(24):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            url, body = "/v1/completions", {"prompt": f"{prompt} ({i})"}
        else:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
        body.update(max_tokens=2 + 2 * i, temperature=0, ignore_eos=True)
        lines.append(
            json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
        )
    bad = [
        "{truncated",
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        json.dumps(
            {"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": "x", "temperature": -1}}
        ),
        json.dumps({"custom_id": "req-0", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "duplicate id"}}),
        json.dumps({"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "word " * 400, "max_tokens": 8}}),
        json.dumps({"custom_id": "unknown", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "x"}], "colour": 1}}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}}),
    ]  # fmt: skip
    for k, line in enumerate(bad):
        lines.insert(3 * k + 1, line)
    return lines


def run_batch_cmd(src: Path, out: Path) -> list[str]:
    return CLI + ["run-batch", "-i", str(src), "-o", str(out), "--max-model-len", "256",
                  "--no-progress"]  # fmt: skip


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_batch_output(lines: list[str], out: Path) -> list[dict]:
    records = read_records(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == len(lines), "one output line per input line"
    assert set(ids) == {f"batch_req_{n + 1}" for n in range(len(lines))}
    by_id = {r["id"]: r for r in records}
    num_bad = 0
    for n, raw in enumerate(lines):
        record = by_id[f"batch_req_{n + 1}"]
        assert record["error"] is None
        response = record["response"]
        try:
            custom_id = json.loads(raw).get("custom_id")
        except ValueError:
            custom_id = None
        good = custom_id is not None and custom_id.startswith("req-") and "duplicate" not in raw
        if good:
            assert response["status_code"] == 200, record
            assert record["custom_id"] == custom_id
            body = response["body"]
            i = int(custom_id.split("-")[1])
            assert body["usage"]["completion_tokens"] == 2 + 2 * i
            assert body["object"] in ("text_completion", "chat.completion")
        else:
            num_bad += 1
            assert response["status_code"] == 400, record
            assert set(response["body"]["error"]) == {"message", "type", "param", "code"}
    assert num_bad == 7
    return records


@pytest.mark.slow
def test_run_batch_bad_lines_and_kill9_resume(tmp_path):
    lines = batch_lines()
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(lines) + "\n")
    log = open(tmp_path / "first.log", "wb")
    proc = subprocess.Popen(run_batch_cmd(src, out), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    num_ok = 0
    while num_ok < 3:  # kill once a few requests have finished, well before the end
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no result appeared"
        if out.exists():
            num_ok = out.read_bytes().count(b'"status_code": 200')
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before_kill = {r["id"]: r for r in read_records(out)}
    assert len(before_kill) < len(lines), "the job finished before the kill"
    with open(out, "ab") as f:  # a write torn by the kill
        f.write(b'{"id": "batch_req_99", "custom_id": "req-99", "response": {"status_co')
    rerun = subprocess.run(run_batch_cmd(src, out), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{len(before_kill)} already done" in rerun.stderr
    records = check_batch_output(lines, out)
    for r in records:
        if r["id"] in before_kill:
            assert r == before_kill[r["id"]], "a finished record changed on resume"


# -- generate -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_kill9_resume(tmp_path):
    lines = [
        json.dumps({"id": f"g{i}", "prompt": PROMPTS[i % len(PROMPTS)] + f" #{i}",
                    "max_tokens": 2 + 2 * i, "temperature": 0, "ignore_eos": True})
        for i in range(20)
    ]  # fmt: skip
    lines.insert(5, "{broken")
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    partial = Path(str(out) + ".partial")
    src.write_text("\n".join(lines) + "\n")
    cmd = CLI + ["generate", "-i", str(src), "-o", str(out), "--max-model-len", "256",
                 "--no-progress"]  # fmt: skip
    log = open(tmp_path / "first.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not partial.exists() or partial.read_bytes().count(b"\n") < 3:  # 3 records
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    done_before = {r["record"]["id"]: r["record"] for r in read_records(partial)}
    assert len(done_before) >= 3
    with open(partial, "ab") as f:
        f.write(b'{"line": 20, "record": {"id": "g18", "te')
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not partial.exists()
    records = read_records(out)
    assert [r["id"] for r in records] == [
        json.loads(x)["id"] if x != "{broken" else "6" for x in lines
    ]
    assert "error" in records[5]
    for r in records:
        if r["id"] in done_before:
            assert r == done_before[r["id"]]
        elif r["id"] != "6":
            i = int(r["id"][1:])
            assert r["num_output_tokens"] == 2 + 2 * i
