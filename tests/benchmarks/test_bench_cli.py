"""`phloem bench throughput` end to end on the CPU with a tiny random-weight Llama: the JSON
holds the fields the GPU runs report (the roofline fields need a GPU's measured ceilings)."""

import json

import pytest

from phloem.entrypoints.bench import main
from phloem.model_configs import available_model_configs, materialize, model_config_dir


def test_shipped_configs():
    assert available_model_configs() == ["llama-3.1-70b", "llama-3.1-8b", "qwen2.5-7b", "qwen3-8b"]
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
    assert main([*args, "--json", str(out), "--trace-steps"]) == 0
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
    # --trace-steps: the step observer saw every step of the run, by kind
    steps = r["steps"]
    assert set(steps) <= {"decode", "mixed"} and "decode" in steps
    # 3 requests of 5 tokens: the last 4 tokens of each come from decode steps (1 token each)
    assert steps["decode"]["mean_tokens"] == steps["decode"]["mean_seqs"]
    quantiles = [steps["decode"][f"seqs_p{q}"] for q in (0, 10, 50, 90, 100)]
    assert quantiles == sorted(quantiles) and 1 <= quantiles[0] and quantiles[-1] <= 3
    assert quantiles[0] <= steps["decode"]["mean_seqs"] <= quantiles[-1]
    for t in steps.values():
        assert t["device_ms"] is None  # CUDA events only on CUDA
        phases = sum(t[f"{p}_ms"] for p in ("schedule", "launch", "wait", "update"))
        assert t["step_ms"] == pytest.approx(phases) and t["total_s"] > 0


def test_profile_window_on_cpu(tmp_path):
    """--profile-window START:COUNT: torch.profiler over those steps (counted by the step
    observer from the measured run's start): the tables and a Chrome trace."""
    model = materialize("llama-3.1-8b", tmp_path / "m", num_hidden_layers=1, hidden_size=64,
                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                        vocab_size=2000)  # fmt: skip
    profile = tmp_path / "window.txt"
    args = ["throughput", "--model", str(model), "--load-format", "dummy", "--device", "cpu"]
    args += ["--workload", "decode-heavy", "--num-requests", "2", "--input-len", "8"]
    args += ["--output-len", "6", "--num-gpu-blocks", "32", "--profile-window", "1:2"]
    assert main([*args, "--profile", str(profile)]) == 0
    assert "== steps 1..2, by self CPU time" in profile.read_text()
    assert profile.with_suffix(".trace.json").stat().st_size > 0


def test_throughput_data_parallel_on_cpu(tmp_path):
    """--data-parallel-size 2 on the CPU (two replica processes): the cluster and per-GPU
    fields and the per-replica report; prefix routing gives DP = 1's outputs and computed prompt
    tokens, contiguous slicing (a shuffled prefix workload) computes more."""
    model = materialize("llama-3.1-8b", tmp_path / "m", num_hidden_layers=1, hidden_size=64,
                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                        vocab_size=2000)  # fmt: skip
    args = ["throughput", "--model", str(model), "--load-format", "dummy", "--device", "cpu"]
    args += ["--workload", "batchllm", "--num-groups", "3", "--degree", "4", "--prefix-len", "32"]
    args += ["--suffix-len", "8", "--output-len", "4", "--num-gpu-blocks", "128"]
    args += ["--block-size", "4", "--dtype", "float32"]
    runs = {}
    for name, extra in (("one", ["--data-parallel-size", "1"]),
                        ("prefix", ["--data-parallel-size", "2"]),
                        ("contiguous", ["--data-parallel-size", "2", "--data-parallel-routing",
                                        "contiguous"])):  # fmt: skip
        out = tmp_path / f"{name}.json"
        assert main([*args, *extra, "--json", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    one, prefix, contiguous = runs["one"], runs["prefix"], runs["contiguous"]
    assert "data_parallel" not in one and one["engine"]["data_parallel_size"] == 1
    assert one["engine"]["tensor_parallel_size"] == 1
    assert prefix["output_digest"] == one["output_digest"] == contiguous["output_digest"]
    assert prefix["num_computed_prompt_tokens"] == one["num_computed_prompt_tokens"]
    assert prefix["prompt_reuse_ratio"] == one["prompt_reuse_ratio"] > 0.5
    assert contiguous["prompt_reuse_ratio"] < prefix["prompt_reuse_ratio"]
    for r, routing in ((prefix, "prefix"), (contiguous, "contiguous")):
        assert r["engine"]["data_parallel_size"] == 2
        assert r["engine"]["data_parallel_routing"] == routing
        assert r["requests_per_s_per_gpu"] == pytest.approx(r["requests_per_s"] / 2)
        assert r["total_tokens_per_s_per_gpu"] == pytest.approx(r["total_tokens_per_s"] / 2)
        dp = r["data_parallel"]
        assert dp["num_replicas"] == 2 and dp["routing"] == routing
        assert sum(s["num_requests"] for s in dp["replicas"]) == 12
        assert all(s["num_requests"] > 0 and s["achieved_s"] > 0 for s in dp["replicas"])
        assert dp["makespan_s"] == max(s["achieved_s"] for s in dp["replicas"])
        assert dp["planned_imbalance"] >= 1.0 and dp["achieved_imbalance"] >= 1.0
        assert dp["num_computed_prompt_tokens"] == r["num_computed_prompt_tokens"]
        assert dp["planned_computed_prompt_tokens"] == r["num_computed_prompt_tokens"]
    # the prefix routing deals whole groups: 3 groups of 4 -> 8 and 4 requests
    assert sorted(s["num_requests"] for s in prefix["data_parallel"]["replicas"]) == [4, 8]


def test_throughput_data_parallel_refuses_single_engine_flags(tmp_path):
    """Step tracing, profiles and the peer need one in-process engine (the peer also the whole
    model, so not at TP > 1): refused before any load (the model path does not exist)."""
    args = ["throughput", "--model", str(tmp_path / "absent"), "--device", "cpu"]
    for flag in (["--trace-steps"], ["--compare", "transformers"], ["--profile", "p.txt"]):
        with pytest.raises(ValueError, match=f"{flag[0]} needs one in-process engine"):
            main([*args, "--data-parallel-size", "2", *flag])
    with pytest.raises(ValueError, match="--compare needs the whole model"):
        main([*args, "--tensor-parallel-size", "2", "--compare", "transformers"])


def test_gc_pauses_counts_collections():
    import gc

    from phloem.bench.trace import GCPauses

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
    from phloem.bench.report import latency_summary as _percentiles
    from phloem.engine.metrics import percentiles
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


def test_roofline_counts_every_gpu_of_a_run():
    from phloem.entrypoints.bench import roofline_num_devices

    assert roofline_num_devices({"data_parallel_size": 1, "tensor_parallel_size": 2}) == 2
    assert roofline_num_devices({"data_parallel_size": 2, "tensor_parallel_size": 4}) == 8
    assert roofline_num_devices({"data_parallel_size": 3}) == 3  # replicas' settings omit TP
