"""FP8 activations quantized by the layer that produces them (issue 18): an RMSNorm (with and
without its residual add) or SiLU-and-mul after `emit_fp8` returns exactly the e4m3 bytes and
scales of quantizing its unfused output (fresh random inputs, rows of zeros, large
magnitudes), which match a float64 emulation of the scheme up to rounding ties; the FP8 linear
layer takes them in place of x with the same output; and an FP8 engine gives the same greedy
tokens and logprobs before and after `fuse_fp8_input_quant` pairs its layers (CPU: the fused
path is the unfused math, so equality is exact; the Triton kernels are in
tests/ops/test_fp8_fused_quant_kernels.py and tests/gpu/test_fp8_fused_quant_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

from phloem.layers.activation import SiluAndMul
from phloem.layers.linear import MergedColumnLinear, RowParallelLinear
from phloem.layers.norm import RMSNorm
from phloem.layers.quantization import fp8_math
from phloem.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
from phloem.layers.quantization.fp8_math import Fp8Activation
from phloem.worker.fusion import fuse_fp8_input_quant
from tests.quantization.test_fp8_emulation import e4m3_float64

torch.set_num_threads(1)


def activations(seed: int, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows spanning 1e-3 .. 1e12 in magnitude, one outlier column, row 1 all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 10 ** torch.empty(rows, 1).uniform_(-3, 12, generator=g)
    x[:, 5] *= 300.0
    x[1] = 0.0
    return x.to(dtype)


def same_quantization(got: Fp8Activation, y: torch.Tensor) -> None:
    """`got` holds exactly `quantize_per_token(y)`'s bytes and scales (y: the unfused output),
    and those are the float64 scheme's up to ties (scales max |y| / 448 to fp32 rounding)."""
    want_q, want_scale = fp8_math.quantize_per_token(y.reshape(-1, y.shape[-1]))
    assert got.dtype == y.dtype and got.shape == y.shape and got.data.dtype == torch.float8_e4m3fn
    assert torch.equal(got.data.reshape(want_q.shape).view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.scale.reshape(-1, 1), want_scale)
    y64 = y.reshape(-1, y.shape[-1]).double()
    scale64 = (y64.abs().amax(1, keepdim=True) / 448).clamp(min=fp8_math.MIN_SCALE)
    assert torch.allclose(want_scale.double(), scale64, rtol=1e-7, atol=0)
    quotient, q64 = y64 / want_scale.double(), want_q.double()
    diff = q64 != e4m3_float64(quotient)  # only where fp32 division rounded onto a tie
    step = torch.pow(2.0, torch.floor(torch.log2(q64.abs().clamp(min=2.0**-6))) - 3)
    assert ((quotient[diff] - (q64[diff] + e4m3_float64(quotient)[diff]) / 2).abs()
            <= 1e-5 * step[diff]).all()  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_emits_the_unfused_quantization(dtype, with_residual):
    for seed in range(3):
        norm = RMSNorm(96, 1e-5, dtype)
        g = torch.Generator().manual_seed(100 + seed)
        norm.weight.data.copy_(torch.randn(96, generator=g) * 30)  # large outputs too
        x = activations(seed, 9, 96, dtype)
        residual = activations(seed + 50, 9, 96, dtype) if with_residual else None
        if residual is not None:
            residual[1] = 0.0  # a zero row after the add: the minimum scale
        want = norm(x) if residual is None else norm(x, residual)
        norm.emit_fp8()
        got = norm(x) if residual is None else norm(x, residual)
        if residual is not None:
            (got, got_residual), (want, want_residual) = got, want
            assert torch.equal(got_residual, want_residual)
        assert isinstance(got, Fp8Activation)
        same_quantization(got, want)
        assert float(got.scale[1]) == pytest.approx(fp8_math.MIN_SCALE)
        assert (got.data[1].float() == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_emits_the_unfused_quantization(dtype):
    for seed in range(3):
        act = SiluAndMul()
        x = activations(seed, 7, 160, dtype) / 1e6  # gate and up: products up to ~1e18
        want = act(x)
        act.emit_fp8()
        got = act(x)
        assert isinstance(got, Fp8Activation) and got.shape == (7, 80)
        same_quantization(got, want)
        assert float(got.scale[1]) == pytest.approx(fp8_math.MIN_SCALE)


def fp8_layer(layer, seed: int):
    g = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
    method = Fp8LinearMethod(Fp8Scheme())
    layer.set_quant_method(method)
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_takes_pre_quantized_input(dtype):
    layer = fp8_layer(MergedColumnLinear(64, [48, 48], dtype=dtype), seed=1)
    assert layer.quant_method.accepts_fp8_input(layer)
    x = activations(2, 5, 64, dtype)
    got = layer(Fp8Activation.per_token(x))
    assert got.dtype == dtype and torch.equal(got, layer(x))
    static = MergedColumnLinear(64, [48, 48], dtype=dtype)
    method = Fp8LinearMethod(Fp8Scheme(static_input=True))
    static.set_quant_method(method)
    assert not method.accepts_fp8_input(static)
    with pytest.raises(ValueError, match="pre-quantized"):
        method.apply(static, Fp8Activation.per_token(x), None)
    # a dense layer takes none: the pairing below only hands them to FP8 layers
    assert not RowParallelLinear(64, 32).quant_method.accepts_fp8_input(RowParallelLinear(64, 32))


def count_fp8_inputs(model) -> dict[str, int]:
    """Forward pre-hooks counting, per consumer kind, the calls that got an Fp8Activation."""
    counts = {"qkv_proj": 0, "gate_up_proj": 0, "down_proj": 0, "o_proj": 0}

    def hook(module, args, name):
        counts[name] += isinstance(args[0], Fp8Activation)

    for full_name, module in model.named_modules():
        leaf = full_name.rpartition(".")[2]
        if leaf in counts:
            module.register_forward_pre_hook(lambda m, a, leaf=leaf: hook(m, a, leaf))
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fusion_keeps_fp8_greedy_tokens(tmp_path, embedded_tokenizer_dir, monkeypatch, arch):
    from phloem import LLM, SamplingParams
    from tests.engine.tiny_models import VOCAB, write_tiny_model

    torch.set_num_threads(2)
    write_tiny_model(arch, tmp_path, embedded_tokenizer_dir, seed=12)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(3 + 5 * i)]}
               for i in range(5)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    llm = LLM(str(tmp_path), dtype="bfloat16", block_size=4, max_num_batched_tokens=32,
              quantization="fp8")  # fmt: skip
    model = llm.llm_engine.executor.worker.model

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    unfused = run()
    monkeypatch.setenv("PHLOEM_FP8_FUSED_QUANT", "0")
    assert fuse_fp8_input_quant(model) == 0
    monkeypatch.delenv("PHLOEM_FP8_FUSED_QUANT")
    assert fuse_fp8_input_quant(model) == 3 * 2  # two norms and SiLU-and-mul per layer
    assert not model.model.norm.fp8_output  # the final norm feeds the LM head (not FP8)
    counts = count_fp8_inputs(model)
    assert run() == unfused
    assert counts["qkv_proj"] == counts["gate_up_proj"] == counts["down_proj"] > 0
    assert counts["o_proj"] == 0  # attention's output is quantized by o_proj itself
    llm.close()


def test_dense_model_is_not_paired(tmp_path, embedded_tokenizer_dir):
    from phloem import LLM
    from tests.engine.tiny_models import write_tiny_model

    write_tiny_model("llama", tmp_path, embedded_tokenizer_dir, seed=13)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=32)
    assert fuse_fp8_input_quant(llm.llm_engine.executor.worker.model) == 0
    llm.close()
