"""`phloem bench throughput` end to end on the CPU with a tiny random-weight Llama: the JSON
holds the fields the GPU runs report (the roofline fields need a GPU's measured ceilings)."""

import json

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
