"""FP8 W8A8 (`quantization="fp8"`, FP8_DYNAMIC) against an independent float64 emulation of the
scheme (issue 18): per-output-channel weight scales max |w| / 448, per-token activation scales
max |x| / 448, e4m3 round-to-nearest-even with saturation computed from the format's definition
(3 mantissa bits, subnormal spacing 2^-9), never through torch's float8 cast. The layer's fp8
operands may differ from the emulation only where a quotient sits on a rounding midpoint (fp32
vs float64 arithmetic may round such a tie either way); its output is the float64 product of its
own operands to fp32 rounding. The same check on every linear layer of the embedded SmolLM2-135M
over 300 tokens is in benchmarks/results/2026-11-26-cpu-fp8-quality/README.md."""

from __future__ import annotations

import torch

from phloem.layers.linear import MergedColumnLinear
from phloem.layers.quantization import fp8_math
from phloem.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme


def e4m3_float64(x: torch.Tensor) -> torch.Tensor:
    """float64 values on the float8 e4m3fn grid: round to nearest even, saturate at +-448."""
    a = x.abs().clamp(max=448.0)
    ulp = torch.pow(2.0, torch.floor(torch.log2(a.clamp(min=2.0**-6))) - 3)
    return torch.sign(x) * (torch.round(a / ulp) * ulp).clamp(max=448.0)


def ties_only(quotient: torch.Tensor, got: torch.Tensor) -> None:
    """Every element where `got` (e4m3 values) differs from the emulation of `quotient` is one
    e4m3 step off, with the quotient on the midpoint between the two (to 1e-5 of a step)."""
    want = e4m3_float64(quotient)
    diff = got != want
    if diff.any():
        step = (got[diff] - want[diff]).abs()
        ulp = torch.pow(2.0, torch.floor(torch.log2(torch.minimum(got[diff].abs(),
                                                                  want[diff].abs()))) - 3)  # fmt: skip
        assert torch.equal(step, ulp.clamp(min=2.0**-9)), "more than one e4m3 step apart"
        mid = (got[diff] + want[diff]) / 2
        assert ((quotient[diff] - mid).abs() <= 1e-5 * step).all(), "not a rounding tie"
    assert diff.float().mean() < 1e-3


def test_fp8_layer_matches_float64_emulation():
    g = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        layer = MergedColumnLinear(256, [192, 192], dtype=torch.float32)
    dense = torch.randn(384, 256, generator=g) * torch.rand(384, 1, generator=g)
    dense[7, 3] = 40.0  # an outlier weight: its row's other values fall to subnormals
    dense[:, 11] = torch.round(dense[:, 11] * 8) / 8  # values on a coarse grid: exact ties
    layer.weight.data.copy_(dense)
    method = Fp8LinearMethod(Fp8Scheme())
    layer.set_quant_method(method)
    method.process_weights_after_loading(layer)

    w64 = dense.double()
    w_scale = w64.abs().amax(1, keepdim=True) / 448
    assert torch.allclose(layer.weight_scale.double(), w_scale[:, 0], rtol=1e-7, atol=0)
    ties_only(w64 / w_scale, layer.weight.double())

    x = torch.randn(33, 256, generator=g) * 10 ** torch.empty(33, 1).uniform_(-3, 3, generator=g)
    x[:, 100] *= 300  # an activation outlier channel, as small LMs have
    x_q, x_scale = fp8_math.quantize_per_token(x)
    x64 = x.double()
    x_scale64 = x64.abs().amax(1, keepdim=True) / 448
    assert torch.allclose(x_scale.double(), x_scale64, rtol=1e-7, atol=0)
    ties_only(x64 / x_scale64, x_q.double())

    emulated = (e4m3_float64(x64 / x_scale64) * x_scale64) @ (
        e4m3_float64(w64 / w_scale) * w_scale
    ).t()
    own = (x_q.double() * x_scale.double()) @ (
        layer.weight.double() * layer.weight_scale.double()[:, None]
    ).t()
    got = layer(x).double()
    row_max = own.abs().amax(1, keepdim=True)
    assert ((got - own).abs() <= 1e-6 * row_max).all()  # fp32 GEMM of the same operands
    # ties aside, the emulation's product: within a few e4m3 steps of one element of a row
    assert ((got - emulated).abs() <= 2**-3 * row_max).all()
    assert ((got - emulated).abs() <= 1e-6 * row_max).float().mean() > 0.9
