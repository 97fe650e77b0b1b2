"""`phloem generate` end to end on the embedded model: one output line per input line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"


def test_generate_cli_with_bad_lines(tmp_path):
    lines = [
        json.dumps({**json.loads(line), "max_tokens": 8})
        for line in EXAMPLES.read_text().splitlines()
    ]
    bad = [
        "{not json",
        json.dumps({"id": "no-prompt", "max_tokens": 4}),
        json.dumps({"id": "bad-temp", "prompt": "hi", "temperature": -1}),
        json.dumps({"id": "too-long", "prompt": "word " * 300}),
        json.dumps({"id": "unknown", "prompt": "hi", "colour": "blue"}),
    ]
    lines = lines[:3] + bad[:2] + lines[3:6] + bad[2:]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "phloem.entrypoints.cli", "generate",
        "--input", str(src), "--output", str(out), "--summary-json", str(summary),
        "--max-tokens", "8", "--max-model-len", "256", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(lines)
    by_id = {r["id"]: r for r in records}
    assert "JSON" in records[3]["error"]
    assert "prompt" in by_id["no-prompt"]["error"]
    assert "temperature" in by_id["bad-temp"]["error"]
    assert "max_model_len" in by_id["too-long"]["error"]
    assert "colour" in by_id["unknown"]["error"]
    good = [r for r in records if "error" not in r]
    assert len(good) == 6
    for r in good:
        assert r["text"] and r["finish_reason"] in ("stop", "length")
        assert 0 < r["num_output_tokens"] <= 8 and r["num_prompt_tokens"] > 0
    assert [r["id"] for r in good[:3]] == ["library-0", "library-1", "library-2"]
    s = json.loads(summary.read_text())
    assert s["num_requests"] == len(lines) and s["num_failed_requests"] == 5
    assert s["num_output_tokens"] == sum(r["num_output_tokens"] for r in good)
    for key in ("wall_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert s[key] > 0
    assert set(s["ttft_s"]) == {"p50", "p90", "p99"} and s["ttft_s"]["p50"] > 0
    assert "TTFT" in result.stderr
    # the three library lines share a long system prompt: the planner groups them
    assert (
        s["num_reused_prompt_tokens"] > 0
        and 0 < s["reuse_ratio"] <= s["planned_reuse_ratio"] + 1e-9
    )
    assert s["num_computed_prompt_tokens"] == s["num_prompt_tokens"] - s["num_reused_prompt_tokens"]


def test_generate_plan_only(tmp_path):
    out = tmp_path / "never.jsonl"
    cmd = [
        sys.executable, "-m", "phloem.entrypoints.cli", "generate",
        "--input", str(EXAMPLES), "--output", str(out), "--plan-only",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "prefix plan: 12 requests" in result.stdout
    assert "group 0: prefix" in result.stdout
    assert not out.exists()
