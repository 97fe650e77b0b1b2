"""`phloem bench throughput` end to end on the CPU with a tiny random-weight Llama: the JSON
holds the fields the GPU runs report (the roofline fields need a GPU's measured ceilings)."""

import json

import pytest

from phloem.entrypoints.bench import main
from phloem.model_configs import available_model_configs, materialize, model_config_dir


def test_shipped_configs():
    assert available_model_configs() == ["llama-3.1-8b", "qwen2.5-7b", "qwen3-8b"]
    assert model_config_dir("Llama-3.1-8B") is not None and model_config_dir("nope") is None


def test_bench_json_on_cpu(tmp_path):
    model = materialize(
        "llama-3.1-8b",
        tmp_path / "m",
        num_hidden_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=2000,
    )
    out = tmp_path / "r.json"
    args = ["throughput", "--model", str(model), "--load-format", "dummy", "--device", "cpu"]
    args += ["--workload", "decode-heavy", "--num-requests", "3", "--input-len", "20"]
    args += ["--output-len", "5", "--num-gpu-blocks", "64"]
    assert main([*args, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in (
        "device",
        "model",
        "workload",
        "shape",
        "requests_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "ttft_s",
        "tpot_s",
        "engine",
        "versions",
        "command",
    ):
        assert key in r, key
    assert r["num_requests"] == 3 and r["engine"]["attention_backend"] == "reference"
    assert r["output_tokens"] == 15 and r["total_tokens_per_s"] > 0
    assert set(r["gc"]) == {"pause_s", "pause_s_by_generation", "collections", "longest_pause_s"}
    assert r["power"] is None  # NVML is read on CUDA runs only


def test_gc_pauses_counts_collections():
    import gc

    from phloem.entrypoints.bench import GCPauses

    with GCPauses() as pauses:
        gc.collect()
        gc.collect(0)
    assert pauses.collections[2] >= 1 and pauses.collections[0] >= 1
    assert pauses.seconds[2] > 0 and pauses.longest_s >= pauses.seconds[2] / pauses.collections[2]
    assert pauses._callback not in gc.callbacks  # removed on exit
    before = list(pauses.collections)
    gc.collect()
    assert pauses.collections == before


def test_one_percentile_definition_for_jobs_bench_and_bench_serve():
    """`phloem generate`'s summary, `phloem bench` and `phloem bench serve` report the same
    percentiles of the same values (linear interpolation between closest ranks)."""
    from phloem.engine.metrics import percentiles
    from phloem.entrypoints.bench import _percentiles
    from phloem.entrypoints.bench_serve import _stats

    values = [0.004, 0.001, 0.003, 0.002]
    job = percentiles(values)
    assert job["p50"] == pytest.approx(0.0025) and job["p90"] == pytest.approx(0.0037)
    bench = _percentiles(values)
    assert {k: bench[k] for k in job} == pytest.approx(job)
    assert bench["mean"] == pytest.approx(0.0025)
    serve = _stats(values)  # milliseconds
    assert serve["median"] == pytest.approx(2.5) and serve["p90"] == pytest.approx(3.7)
    assert serve["p99"] == pytest.approx(job["p99"] * 1000) and serve["mean"] == pytest.approx(2.5)
    assert _percentiles([]) is None and _stats([])["median"] is None
