"""The roofline of an FP8 run (shared/docs/ROOFLINE.md's precision rule): linear weights counted
at one byte plus an fp32 scale per output channel, embeddings and LM head at two; the ceiling
matmul in the precision of the run's GEMMs; `phloem bench` picks FP8 for --quantization fp8 and
for FP8 checkpoints."""

from __future__ import annotations

import types

import pytest
import torch

from phloem.bench.roofline import ModelShape, _ceilings, matmul_fn
from phloem.entrypoints.bench import gemm_precision

LLAMA_8B = dict(hidden=4096, layers=32, q_heads=32, kv_heads=8, head_dim=128, mlp=14336,
                vocab=128256)  # fmt: skip


def test_fp8_weight_bytes():
    bf16 = ModelShape(**LLAMA_8B)
    fp8 = ModelShape(**LLAMA_8B, linear_bytes_per_element=1)
    head = 4096 * 128256
    assert bf16.weight_bytes == 2 * (bf16.p_lin + 2 * head)
    outputs_per_layer = (32 + 2 * 8) * 128 + 4096 + 2 * 14336 + 4096  # q k v, o, gate up, down
    assert fp8.linear_scale_bytes == 4 * 32 * outputs_per_layer
    assert fp8.weight_bytes == fp8.p_lin + fp8.linear_scale_bytes + 2 * 2 * head
    assert 8.0e9 < fp8.weight_bytes < 9.5e9 < 16e9 < bf16.weight_bytes  # 8B: ~8.6 GB vs ~16 GB


def test_fp8_ceiling_matmul_runs_scaled_mm():
    """The fp8 ceiling times `torch._scaled_mm` (on the CPU here: the call's contract), the same
    2 n^3 FLOPs per call."""
    seen = []

    def timer(fn):
        seen.append(fn())
        return 0.5

    c = _ceilings(timer, lambda fn: 0.25, "cpu", matmul_n=64, copy_bytes=1024, precision="fp8")
    assert c["precision"] == "fp8" and c["flops_per_s"] == pytest.approx(2 * 64**3 / 0.5)
    assert seen[0].shape == (64, 64) and seen[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision"):
        matmul_fn(64, "cpu", "int8")


def test_bench_measures_in_the_precision_of_the_run():
    dense = types.SimpleNamespace(architectures=["LlamaForCausalLM"])
    fp8_ckpt = types.SimpleNamespace(quantization_config={"quant_method": "fp8"})
    assert gemm_precision(None, dense, "dummy") == "bf16"
    assert gemm_precision("fp8", dense, "dummy") == "fp8"
    assert gemm_precision(None, fp8_ckpt, "auto") == "fp8"


def test_bench_throughput_with_quantization_fp8_on_cpu(tmp_path):
    import json

    from phloem.entrypoints.bench import main
    from phloem.model_configs import materialize

    model = materialize("llama-3.1-8b", tmp_path / "m", num_hidden_layers=1, hidden_size=64,
                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                        vocab_size=2000)  # fmt: skip
    out = tmp_path / "r.json"
    args = ["throughput", "--model", str(model), "--load-format", "dummy", "--device", "cpu",
            "--workload", "decode-heavy", "--num-requests", "2", "--input-len", "16",
            "--output-len", "4", "--num-gpu-blocks", "32", "--quantization", "fp8"]  # fmt: skip
    assert main([*args, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["engine"]["quantization"] == "fp8" and r["output_tokens"] == 8
    with pytest.raises(ValueError, match="--compare .* FP8"):
        main([*args, "--compare", "transformers"])
