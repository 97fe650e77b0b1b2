"""The serving benchmark (issue 24, item 6): benchmarks/serving.sh end to end on the CPU with a
tiny random-weight model at tiny rates (vLLM absent: skipped with a message), and
`phloem bench serve-summary`'s ratios and goodput on hand-made runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from phloem.entrypoints.bench_serve_summary import summarize_dir
from tests.entrypoints.server_utils import ROOT, free_port


def test_serving_script_runs_every_workload(tmp_path) -> None:
    from phloem.model_configs import materialize

    model = materialize("llama-3.1-8b", tmp_path / "tiny", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=20480, bos_token_id=1, eos_token_id=2, rope_scaling=None)  # fmt: skip
    out = tmp_path / "out"
    env = dict(os.environ, ENGINES="phloem vllm", RATES="4", DURATION="1", BURST_N="3",
               SHARED_N="3", WARMUP="1", MODEL=str(model), PORT=str(free_port()),
               READY_S="240", VLLM_SITE=str(tmp_path / "no-vllm"), PYTHON=sys.executable,
               SERVER_ARGS="--load-format dummy --max-model-len 2048 --num-gpu-blocks 600")  # fmt: skip
    r = subprocess.run(["bash", "benchmarks/serving.sh", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "=== vllm: not importable" in r.stdout
    expected = {
        "poisson-4": (4, 512, 0),
        "burst-3": (3, 512, 0),
        "shared-prefix-3": (3, 1280, 1024),
    }
    for workload, (num, input_len, prefix_len) in expected.items():
        run = json.loads((out / f"phloem-{workload}.json").read_text())
        assert (run["engine"], run["workload"], run["model"]) == ("phloem", workload, "tiny")
        assert run["completed"] == num and run["failed"] == 0
        assert (run["input_len"], run["prefix_len"], run["output_len"]) == (
            input_len,
            prefix_len,
            128,
        )
        assert (
            run["total_output_tokens"] == num * 128 and run["total_input_tokens"] == num * input_len
        )
        assert run["ttft_ms"]["p99"] > 0 and run["tpot_ms"]["median"] > 0
        assert "requests" not in run  # --no-save-requests
    summary = json.loads((out / "summary.json").read_text())
    assert {(r["engine"], r["workload"]) for r in summary["runs"]} == {
        ("phloem", w) for w in expected
    }
    assert summary["goodput"]["phloem"]["rates"] == [4.0] and summary["ratios"] == []
    assert (out / "summary.md").read_text().startswith("| engine | workload |")


def _run(engine: str, workload: str, rate: float, rps: float, ttft_p99: float, tpot_p99: float):
    def stats(p50: float, p99: float) -> dict:
        return {"mean": p50, "median": p50, "p90": p99, "p99": p99}

    return {"engine": engine, "workload": workload, "request_rate": rate, "completed": 10,
            "failed": 0, "request_throughput": rps, "output_throughput": rps * 128,
            "ttft_ms": stats(ttft_p99 / 2, ttft_p99), "tpot_ms": stats(tpot_p99 / 2, tpot_p99),
            "itl_ms": stats(1.0, 2.0)}  # fmt: skip


def test_summary_ratios_and_goodput(tmp_path) -> None:
    inf = float("inf")
    runs = [
        _run("phloem", "poisson-10", 10, 9.8, 100, 10),
        _run("phloem", "poisson-20", 20, 19.5, 250, 20),
        _run("phloem", "poisson-30", 30, 28.0, 400, 30),  # misses the objective
        _run("phloem", "burst-1000", inf, 40.0, 9000, 40),
        _run("vllm", "poisson-10", 10, 9.9, 200, 20),
        _run("vllm", "poisson-20", 20, 19.0, 350, 20),  # misses it: TTFT
        _run("vllm", "burst-1000", inf, 32.0, 6000, 30),
    ]
    for r in runs:
        (tmp_path / f"{r['engine']}-{r['workload']}.json").write_text(json.dumps(r))
    (tmp_path / "device.json").write_text("{}")  # unlabelled files are not runs
    summary = summarize_dir(tmp_path, "phloem", "vllm", 300.0, 25.0)
    assert summary["goodput"]["phloem"] == {
        "goodput": 19.5,
        "offered_rate": 20,
        "rates": [10, 20, 30],
    }
    assert summary["goodput"]["vllm"]["goodput"] == 9.9
    assert abs(summary["goodput_ratio"] - 19.5 / 9.9) < 1e-12
    ratios = {r["workload"]: r for r in summary["ratios"]}
    assert set(ratios) == {"poisson-10", "poisson-20", "burst-1000"}  # poisson-30: phloem only
    assert ratios["burst-1000"]["request_throughput"] == 40.0 / 32.0
    assert ratios["poisson-10"]["ttft_p99_ms"] == 0.5 and ratios["poisson-10"]["tpot_p50_ms"] == 0.5
