"""FP8 arithmetic and the FP8 linear layer on the CPU: quantize -> dequantize error bounds per
tensor, the layer against an fp64 reference of the same quantized math on fresh inputs (online,
per-tensor, block and static-activation schemes), and the CUDA path's `torch._scaled_mm` call
(which runs on the CPU too) against the reference."""

from __future__ import annotations

import pytest
import torch

from phloem.layers.linear import ColumnParallelLinear, MergedColumnLinear, QKVLinear
from phloem.layers.quantization import fp8_math
from phloem.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme

torch.set_num_threads(1)
E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: round to nearest is within 2^-4 relative
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # the subnormal step is 2^-9 (in units of the scale)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(48, 80, generator=g)
    outliers = normal.clone()
    outliers[:, 3] *= 100.0  # one huge column: small values of each row fall to subnormals
    rows = torch.randn(6, 80, generator=g) * torch.logspace(-6, 3, 6)[:, None]
    zero_row = normal.clone()
    zero_row[5] = 0.0
    return {"normal": normal, "outliers": outliers, "row_scales": rows, "zero_row": zero_row}


@pytest.mark.parametrize("name", ["normal", "outliers", "row_scales", "zero_row"])
def test_round_trip_error_is_within_half_an_e4m3_step(name):
    w = tensors()[name]
    q, scale = fp8_math.quantize_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (w.shape[0],)
    back = fp8_math.dequantize_weight(q, scale, None)
    bound = torch.maximum(w.abs() * E4M3_HALF_ULP, scale[:, None] * E4M3_SUBNORMAL_HALF_STEP)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    # each row's largest |w| maps to +-448 and comes back to within fp32 rounding
    top = w.abs().argmax(dim=1)
    rows = torch.arange(w.shape[0])
    nonzero = w.abs().amax(dim=1) > 0
    assert (q.float()[rows, top].abs()[nonzero] == fp8_math.FP8_MAX).all()
    torch.testing.assert_close(back[rows, top], w[rows, top], rtol=1e-6, atol=0)
    if name == "zero_row":
        assert (back[5] == 0).all()
    # per token (activations): the same bound with one scale per row
    xq, xs = fp8_math.quantize_per_token(w)
    xback = xq.float() * xs
    assert ((xback - w).abs() <= torch.maximum(w.abs() * E4M3_HALF_ULP,
                                               xs * E4M3_SUBNORMAL_HALF_STEP) * (1 + 1e-6)).all()  # fmt: skip


def e4m3_round_fp64(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to e4m3 (nearest, ties to even) independently of torch's cast:
    3 mantissa bits for |x| >= 2^-6, steps of 2^-9 below, saturating at 448."""
    x = x.clamp(-448.0, 448.0)
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-6)))
    step = torch.exp2(exponent - 3)
    return torch.round(x / step) * step  # torch.round: half to even


def reference_fp64(x, weight_q, w_scale, bias=None, input_scale=None, block_k=None):
    """y = quant(x) @ W^T (+ b) entirely in float64, quantizing x per token (or by the static
    scale) with `e4m3_round_fp64`; `w_scale` fp32 [N] or, with block_k, [N, K / block_k]."""
    x64 = x.double()
    if input_scale is None:
        s = (x64.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=fp8_math.MIN_SCALE)
    else:
        s = input_scale.double().reshape(1, 1)
    xq = e4m3_round_fp64(x64 / s) * s
    ws = w_scale.double()
    if block_k is not None:
        ws = ws.repeat_interleave(block_k, dim=1)[:, : weight_q.shape[1]]
    else:
        ws = ws[:, None]
    out = xq @ (weight_q.double() * ws).t()
    return out if bias is None else out + bias.double()


def check_against_fp64(layer, method, k: int, seed: int, bias=None) -> None:
    """The layer's output on fresh inputs vs `reference_fp64` of its own quantized operands:
    fp32 accumulation error only (plus the rare input whose fp32 and fp64 division round to
    neighbouring e4m3 values: at most a 2^-3 relative change of one product)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, k, generator=g) * torch.logspace(-2, 2, 7)[:, None]
    got = layer(x).double()
    scale = method.weight_scale(layer)
    input_scale = layer.input_scale if method.scheme.static_input else None
    ref = reference_fp64(x, layer.weight, scale, bias, input_scale, method.block_k)
    row_norm = ref.abs().amax(dim=1, keepdim=True)
    assert ((got - ref).abs() <= 2e-3 * row_norm + 1e-6).all()
    assert ((got - ref).abs() <= 1e-5 * row_norm).float().mean() > 0.99


@pytest.mark.parametrize("bias", [False, True])
def test_online_fp8_linear_matches_fp64_reference(bias):
    torch.manual_seed(1)
    dense = torch.nn.Linear(64, 96, bias=bias)
    layer = ColumnParallelLinear(64, 96, bias=bias)
    layer.weight.weight_loader(layer.weight, dense.weight.detach())
    if bias:
        layer.bias.weight_loader(layer.bias, dense.bias.detach())
    method = Fp8LinearMethod(Fp8Scheme())
    layer.set_quant_method(method)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (96,)
    check_against_fp64(layer, method, 64, seed=2, bias=dense.bias if bias else None)
    check_against_fp64(layer, method, 64, seed=3, bias=dense.bias if bias else None)
    # and close to the dense layer it came from (e4m3: a few % per product, averaging out)
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert (layer(x) - dense(x)).norm() <= 0.05 * dense(x).norm()


def block_quantize(w: torch.Tensor, block: tuple[int, int]):
    """(fp8 [N, K], fp32 [ceil(N/bn), ceil(K/bk)]) with one scale per block (max |w| / 448)."""
    bn, bk = block
    rows, cols = -(-w.shape[0] // bn), -(-w.shape[1] // bk)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = tile.abs().max() / 448.0
    per_element = fp8_math.expand_block_scales(scale, block, w.shape)
    return fp8_math.quantize(w, per_element), scale


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_checkpoint_scales_load_into_a_fused_layer(strategy):
    """q, k, v parts with their own FP8 tensors and scales, fused into one QKV layer."""
    torch.manual_seed(4)
    hidden, head_dim = 160, 16
    parts = {"q": torch.randn(4 * head_dim, hidden), "k": torch.randn(2 * head_dim, hidden),
             "v": torch.randn(2 * head_dim, hidden) * 3}  # fmt: skip
    block = (32, 64)
    scheme = Fp8Scheme(serialized=True, weight_strategy=strategy,
                       block_size=block if strategy == "block" else None)  # fmt: skip
    layer = QKVLinear(hidden, head_dim, 4, 2)
    method = Fp8LinearMethod(scheme)
    layer.set_quant_method(method)
    dequantized = []
    for shard, w in parts.items():
        if strategy == "block":
            q, s = block_quantize(w, block)
            dequantized.append(q.float() * fp8_math.expand_block_scales(s, block, w.shape))
        elif strategy == "tensor":
            s = w.abs().max() / 448.0
            q = fp8_math.quantize(w, s)
            dequantized.append(q.float() * s)
        else:
            q, s = fp8_math.quantize_per_channel(w)
            dequantized.append(q.float() * s[:, None])
            s = s[:, None]  # compressed-tensors stores [N, 1]
        layer.weight.weight_loader(layer.weight, q, shard)
        scale_param = getattr(layer, scheme.weight_scale_name)
        scale_param.weight_loader(scale_param, s, shard)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn  # kept as stored: never requantized on CPU
    full = fp8_math.dequantize_weight(layer.weight, method.weight_scale(layer), method.block_k)
    torch.testing.assert_close(full, torch.cat(dequantized), rtol=0, atol=0)
    check_against_fp64(layer, method, hidden, seed=5)
    with pytest.raises(ValueError, match="expected"):
        scale_param = getattr(layer, scheme.weight_scale_name)
        scale_param.weight_loader(scale_param, torch.ones(3, 3, 3), "k")


def test_static_input_scale_takes_the_largest_part():
    torch.manual_seed(6)
    layer = MergedColumnLinear(32, [48, 48])
    method = Fp8LinearMethod(Fp8Scheme(serialized=True, static_input=True))
    layer.set_quant_method(method)
    for i in range(2):
        q, s = fp8_math.quantize_per_channel(torch.randn(48, 32))
        layer.weight.weight_loader(layer.weight, q, i)
        layer.weight_scale.weight_loader(layer.weight_scale, s, i)
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor([0.01 * (i + 1)]), i)
    with pytest.raises(ValueError, match="input_scale"):
        layer.input_scale.weight_loader(layer.input_scale, torch.ones(2), 0)
    method.process_weights_after_loading(layer)
    assert layer.input_scale.shape == () and float(layer.input_scale) == pytest.approx(0.02)
    check_against_fp64(layer, method, 32, seed=7)


def test_scaled_mm_call_matches_the_reference():
    """The CUDA path's `torch._scaled_mm` (row-wise scales, B = W^T column-major) computes the
    reference's product (its output is bfloat16: within bf16 rounding)."""
    torch.manual_seed(8)
    w_q, w_s = fp8_math.quantize_per_channel(torch.randn(48, 64))
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    ref = fp8_math.fp8_linear_reference(x, w_q, w_s, bias=bias)
    got = fp8_math.fp8_linear_scaled_mm(x, w_q, w_s, bias=bias)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    static = torch.tensor(0.02)
    torch.testing.assert_close(fp8_math.fp8_linear_scaled_mm(x, w_q, w_s, static).float(),
                               fp8_math.fp8_linear_reference(x, w_q, w_s, static).float(),
                               rtol=2e-2, atol=2e-2)  # fmt: skip
    assert not fp8_math.scaled_mm_supported(w_q)  # a CPU weight takes the reference path


def test_triton_per_token_quant_matches_the_eager_form(triton_kernels):
    """The CUDA quantizer (phloem/ops/fp8_quant.py) against `quantize_per_token`: the same
    scales, and the same bytes but for the Triton interpreter's own fp32 -> e4m3 cast (CPU
    only: not round-to-nearest-even on ties, carries into the next binade and subnormals), so
    here at least 95% equal and every value within half of itself: a wrong scale, row or column
    fails; tests/gpu/test_fp8_gpu.py checks every byte on the GPU."""
    ops = triton_kernels("phloem.ops.fp8_quant", "_per_token_quant_kernel")
    torch.manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, k in ((5, 100), (3, 4096), (2, 5000)):
            x = (torch.randn(rows, k) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
            x[0] = 0.0
            q, scale = ops.per_token_quant(x, fp8_math.MIN_SCALE)
            ref_q, ref_scale = fp8_math.quantize_per_token(x)
            assert torch.equal(scale, ref_scale)
            got, want = q.float(), ref_q.float()
            assert (got == want).float().mean() > 0.95
            assert ((got - want).abs() <= 0.5 * want.abs() + 2.0**-8).all()
            assert (got[0] == 0).all()
