"""`phloem bench serve` against the running test server: counts, printout, --json."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.entrypoints.server_utils import API_KEY


def test_bench_serve_reports(main_server, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "phloem.entrypoints.bench_serve", "--base-url", main_server.url,
           "--api-key", API_KEY, "--num-prompts", "8", "--input-len", "32", "--prefix-len", "16",
           "--output-len", "8", "--request-rate", "20", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Serving Benchmark Result" in r.stdout and "P99 TTFT (ms):" in r.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 64
    assert result["total_input_tokens"] == 8 * 32
    assert result["ttft_ms"]["median"] > 0 and result["tpot_ms"]["p99"] > 0
    chat = subprocess.run(
        cmd[:-2] + ["--endpoint", "/v1/chat/completions", "--num-prompts", "3",
                    "--request-rate", "inf", "--max-concurrency", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert chat.returncode == 0, chat.stdout + chat.stderr
    assert re.search(r"Successful requests:\s+3\s", chat.stdout), chat.stdout
    bad = subprocess.run(
        cmd[:-2] + ["--api-key", "wrong", "--num-prompts", "2", "--model", "SmolLM2-135M-Instruct",
                    "--input-len", "4", "--prefix-len", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 1 and "HTTP 401" in bad.stderr


def _bench(*args: str) -> subprocess.CompletedProcess:
    """`phloem bench serve ...` through the CLI (which logs at INFO, as users run it)."""
    cmd = [sys.executable, "-m", "phloem.entrypoints.cli", "bench", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_bench_serve_unreachable_or_wrong_key_is_one_line(main_server):
    from tests.entrypoints.server_utils import free_port

    r = _bench("--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: cannot reach http://127.0.0.1:")
    r = _bench("--base-url", main_server.url, "--api-key", "wrong", "--num-prompts", "2")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "HTTP 401" in r.stderr and "Incorrect API key" in r.stderr


def test_bench_serve_does_not_log_every_request(main_server):
    r = _bench("--base-url", main_server.url, "--api-key", API_KEY, "--num-prompts", "3",
               "--input-len", "8", "--output-len", "2")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HTTP Request" not in r.stderr, r.stderr
    assert re.search(r"Successful requests:\s+3\s", r.stdout), r.stdout
