"""benchmarks/serving.sh with PHLOEM_CONFIGS on the CPU (tiny random-weight model, one tiny
Poisson run): each configuration's server runs with its flags under its own label, writes its
runs and its step trace, serve-summary shows each as an engine with its step table, a server
that exits at start-up (an unknown flag) is reported at once rather than waited on for READY_S,
and a second call starts no server for configurations whose runs are all there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from phloem.bench.step_trace_file import read_step_trace
from tests.entrypoints.server_utils import ROOT, free_port


def test_serving_script_runs_each_configuration(tmp_path) -> None:
    from phloem.model_configs import materialize

    model = materialize("llama-3.1-8b", tmp_path / "tiny", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=20480, bos_token_id=1, eos_token_id=2, rope_scaling=None)  # fmt: skip
    out = tmp_path / "out"
    configs = "base:|small: --max-num-seqs 2 --max-prefill-tokens-per-step 64|broken|gone: --nope"
    env = dict(os.environ, ENGINES="phloem", RATES="4", DURATION="1", BURST="0", SHARED="0",
               WARMUP="1", MODEL=str(model), PORT=str(free_port()), READY_S="240",
               PYTHON=sys.executable, PHLOEM_CONFIGS=configs,
               SERVER_ARGS="--load-format dummy --max-model-len 2048 --num-gpu-blocks 600")  # fmt: skip
    command = ["bash", "benchmarks/serving.sh", str(out)]
    r = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    said = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, said
    assert "entry 'broken' is not NAME:FLAGS" in r.stdout
    # READY_S is generous for a loaded machine; a dead server is not waited on for it
    assert "=== the server exited while starting\n=== phloem@gone: not ready" in r.stdout, said
    assert not (out / "phloem@gone-poisson-4.json").exists()
    for name, max_seqs, cap in (("base", 256, None), ("small", 2, 64)):
        path = out / f"phloem@{name}-poisson-4.json"
        assert path.is_file(), said + (out / f"phloem@{name}-server.log").read_text()[-3000:]
        run = json.loads(path.read_text())
        assert run["engine"] == f"phloem@{name}" and run["completed"] == 4 and run["failed"] == 0
        header, steps = read_step_trace(out / f"phloem@{name}-steps.jsonl")
        assert (header["max_num_seqs"], header["max_prefill_tokens_per_step"]) == (max_seqs, cap)
        start, end = run["window_monotonic_s"]
        assert any(start <= s["t1"] <= end for s in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert {r["engine"] for r in summary["runs"]} == {"phloem@base", "phloem@small"}
    assert set(summary["steps"]) == {"phloem@base", "phloem@small"}
    assert "| phloem@small | poisson-4 | decode |" in (out / "summary.md").read_text()
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "=== phloem@small: every run done already" in again.stdout
    assert not (out / "phloem@base-steps-2.jsonl").exists()
