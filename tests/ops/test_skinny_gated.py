"""SiLU-and-mul fused into the skinny down GEMM (interpreted on the CPU): against float64 torch,
bit for bit against the unfused pair (the standalone kernel, then the skinny GEMM), its launch
checks, PHLOEM_FUSED_SILU_DOWN, and the MLP's output with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phloem.layers.quantization import base as quant_base


@pytest.fixture(scope="module")
def sg(triton_kernels):
    """The fused module; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    triton_kernels("phloem.ops.skinny_gemm", "_skinny_dot_kernel")
    from phloem.ops import skinny_gated

    return skinny_gated


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    """Fresh gate_up [rows, 2k] (gate and up ~ N(0, 2^2)), W [n, k], bias [n] or None."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (2 * torch.randn(rows, 2 * k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return [t.to(device()) if t is not None else None for t in (gate_up, w, b)]


def reference(gate_up, w, b) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up) W^T + b in float64 on the CPU, and per output the size of one rounding
    of each product's activation to gate_up's dtype: sqrt(sum_k (h_k w_k)^2) * its epsilon."""
    gate, up = gate_up.cpu().double().chunk(2, dim=-1)
    h = F.silu(gate) * up
    w64 = w.cpu().double()
    out = h @ w64.T + (0 if b is None else b.cpu().double())
    step = ((h * h) @ (w64 * w64).T).sqrt() * torch.finfo(gate_up.dtype).eps
    return out, step


CASES = [  # (n, k, config): every tile product and launch shape of the kernel
    (64, 256, None),  # the default config (CUDA cores to 4 rows, then tensor cores)
    (40, 200, dict(block_n=16, block_k=64)),  # K % block_k != 0 and N % block_n != 0
    (48, 200, dict(block_n=16, block_k=32, split_k=4)),  # split K, a ragged last split
    (40, 96, dict(block_n=16, block_k=32, tensor_cores=True)),  # tl.dot at any rows count
    (32, 128, dict(block_n=16, block_k=32, split_k=2, tensor_cores=True)),  # tl.dot, split
]


@pytest.mark.parametrize("rows", [1, 4, 5, 16])
@pytest.mark.parametrize("n,k,config", CASES)
def test_fused_matches_float64(sg, rows, n, k, config):
    """Within 4 roundings of the activation (the kernel rounds silu(gate) * up to the model
    dtype, as the unfused kernel writes it; Triton's interpreter truncates bf16) plus one of the
    output; bf16, fp16 at 5 rows."""
    dtype = torch.float16 if rows == 5 else torch.bfloat16
    gate_up, w, b = inputs(rows, n, k, dtype, bias=rows % 2 == 1, seed=rows * 100 + k)
    cfg = sg.sk.SkinnyConfig(**config) if config else None
    got = sg.silu_and_mul_linear(gate_up, w, b, cfg)
    assert got.shape == (rows, n) and got.dtype == dtype
    want, step = reference(gate_up, w, b)
    err = (got.cpu().double() - want).abs()
    assert (err <= 4 * step + 2 * torch.finfo(dtype).eps * want.abs() + 1e-4).all(), err.max()


@pytest.mark.parametrize("rows", [2, 5])
@pytest.mark.parametrize("n,k,config", CASES)
def test_fused_equals_the_unfused_pair(sg, rows, n, k, config):
    """The fused kernel multiplies the values the standalone SiLU-and-mul kernel writes, with
    the same config: the same bf16 output bit for bit (split K on the GPU adds its partial
    sums in any order: bf16 tolerance there)."""
    from phloem.ops.activation import silu_and_mul

    gate_up, w, b = inputs(rows, n, k, torch.bfloat16, bias=rows == 5, seed=rows + k)
    cfg = sg.sk.SkinnyConfig(**config) if config else None
    got = sg.silu_and_mul_linear(gate_up, w, b, cfg)
    want = sg.sk.skinny_linear(silu_and_mul(gate_up), w, b, cfg)
    if (cfg and cfg.split_k > 1) and got.is_cuda:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
    else:
        assert torch.equal(got, want)


def test_fused_keeps_leading_dims_and_checks_its_inputs(sg):
    gate_up, w, b = inputs(6, 24, 40, torch.bfloat16, bias=True, seed=3)
    got = sg.silu_and_mul_linear(gate_up.view(2, 3, 80), w, b)
    assert got.shape == (2, 3, 24) and torch.equal(got.view(6, 24), sg.silu_and_mul_linear(
        gate_up, w, b))  # fmt: skip
    with pytest.raises(ValueError, match=r"gate_up must be \[..., 2K\]"):
        sg.silu_and_mul_linear(gate_up[:, :40], w)
    with pytest.raises(ValueError, match="share a dtype"):
        sg.silu_and_mul_linear(gate_up.float(), w.float())
    with pytest.raises(ValueError, match="at most 16 rows"):
        sg.silu_and_mul_linear(inputs(17, 24, 40, torch.bfloat16, False, 0)[0], w)
    assert sg.takes(gate_up[:2], w) and not sg.takes(gate_up[:2, :40], w)
    assert not sg.takes(inputs(17, 24, 40, torch.bfloat16, False, 0)[0], w)
    assert not sg.takes(gate_up[:2].float(), w.float()) and not sg.takes(gate_up[:0], w)


def test_rows_fuse_where_the_recomputed_activations_stay_cheap(sg, monkeypatch):
    """By the rule (no `CONFIGS` entry): 3 rows on the CUDA cores with block_n 8 recompute
    4 / 8 activations per weight element and fuse, 5 rows on the tensor cores with block_n 16
    recompute 16 / 16 and do not; a measured entry decides either way."""
    gate_up, w, _ = inputs(5, 32, 64, torch.bfloat16, bias=False, seed=0)
    assert sg.silu_per_weight(sg.config_for(3, 32, 64), 3) == 0.5 and sg.takes(gate_up[:3], w)
    assert sg.silu_per_weight(sg.config_for(5, 32, 64), 5) == 1 and not sg.takes(gate_up, w)
    monkeypatch.setitem(sg.CONFIGS, (8, 32, 64), sg.sk.SkinnyConfig(block_n=16, block_k=32))
    assert sg.takes(gate_up, w)
    monkeypatch.setitem(sg.CONFIGS, (4, 32, 64), None)
    assert not sg.takes(gate_up[:3], w)
    # a plain config whose staged tiles would not fit with the second x tile: apart
    big = sg.sk.SkinnyConfig(block_n=32, block_k=1024, num_warps=8, tensor_cores=True)
    monkeypatch.setitem(sg.sk.CONFIGS, (2, 32, 64), big)
    assert sg.silu_per_weight(big, 2) == 0.5 and not sg.fuses(2, 32, 64)
    assert sg.sk.fused_fits(sg.sk.SkinnyConfig(32, 512, 1, 8, 4, True), 4)  # Llama's down, 4 rows


def test_configs_table_keeps_a_rows_bucket_unfused(sg, monkeypatch):
    gate_up, w, _ = inputs(3, 32, 64, torch.bfloat16, bias=False, seed=0)
    assert sg.takes(gate_up, w) and not sg.takes(gate_up, w, measured_only=True)
    monkeypatch.setitem(sg.sk.CONFIGS, (4, 32, 64), sg.sk.SkinnyConfig(block_n=16, block_k=32))
    assert sg.takes(gate_up, w, measured_only=True)  # the unfused GEMM's measured shape
    assert sg.config_for(3, 32, 64) == sg.sk.SkinnyConfig(block_n=16, block_k=32)
    fused = sg.sk.SkinnyConfig(block_n=32, block_k=64)
    monkeypatch.setitem(sg.CONFIGS, (4, 32, 64), fused)
    assert sg.config_for(3, 32, 64) is fused
    monkeypatch.setitem(sg.CONFIGS, (4, 32, 64), None)  # measured: apart is faster
    assert not sg.takes(gate_up, w) and sg.takes(gate_up[:2], w)


@pytest.fixture
def flags(fusion_flags):
    """`set(skinny, fused)`: PHLOEM_SKINNY_GEMM and PHLOEM_FUSED_SILU_DOWN (None: unset), read
    afresh (tests/ops/conftest.py)."""
    return fusion_flags(quant_base.FUSED_SILU_DOWN_ENV, quant_base.skinny_gated_module)


def test_flag_is_on_by_default_and_validated(sg, flags):
    flags(None, None)
    assert quant_base.skinny_gated_module() is sg
    flags(None, "0")
    assert quant_base.skinny_gated_module() is None
    flags("0", None)
    assert quant_base.skinny_gated_module() is None
    flags(None, "on")
    with pytest.raises(ValueError, match="PHLOEM_FUSED_SILU_DOWN must be 0 or 1"):
        quant_base.skinny_gated_module()


def test_mlp_output_with_and_without_the_fusion(sg, flags, monkeypatch):
    """A bf16 LlamaMLP (hidden 48, intermediate 64): at 1 row (the rule) and 16 rows (a
    `CONFIGS` entry) the fused down projection gives the unfused MLP's output within bf16
    rounding (of the activation: the kernel rounds silu(gate) * up once, torch on the CPU twice)
    and skips the activation layer; at 5 rows (the rule says no), 17 rows (prefill-sized), with
    PHLOEM_FUSED_SILU_DOWN=0 or PHLOEM_SKINNY_GEMM=0 the activation runs apart."""
    from phloem.models.llama import LlamaMLP

    mlp = LlamaMLP(48, 64, bias=False, dtype=torch.bfloat16).to(device())
    g = torch.Generator().manual_seed(5)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    fused, activations = [], []
    real = sg.silu_and_mul_linear
    monkeypatch.setattr(sg, "silu_and_mul_linear", lambda *a: fused.append(1) or real(*a))
    mlp.act_fn.register_forward_hook(lambda *_: activations.append(1))
    monkeypatch.setitem(sg.CONFIGS, (16, 48, 64), sg.sk.SkinnyConfig(block_n=16, block_k=32))
    for rows in (1, 5, 16, 17):
        x = torch.randn(rows, 48, generator=g).to(torch.bfloat16).to(device())
        flags("1", "0")
        plain = mlp(x)
        assert len(activations) == 1 and not fused
        flags("1", None)
        got = mlp(x)
        assert (len(activations), len(fused)) == ((1, 1) if rows in (1, 16) else (2, 0)), rows
        _, step = reference(mlp.gate_up_proj(x), mlp.down_proj.weight, None)
        bound = 8 * step + 2 * 2**-7 * plain.abs().cpu().double() + 1e-4  # unfused on the CPU:
        assert ((got - plain).abs().cpu().double() <= bound).all()  # torch's two roundings
        flags("0", None)
        assert torch.equal(mlp(x), F.linear(mlp.act_fn(mlp.gate_up_proj(x)), mlp.down_proj.weight))
        activations.clear()
        fused.clear()


RECORD_BENCHMARK = r"""
import importlib.util
from phloem.worker.triton_variants import cuda_target, record_variants

spec = importlib.util.spec_from_file_location("bench", {path!r})
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
args = bench.parse_args([])
request = dict(fusions=args.fusions, rows=args.rows, grid=args.grid)
variants = record_variants(lambda: bench.launches(request), cuda_target((9, 0)))
names = [v.describe() for v in variants]
print("variants", len(names), sum("GATED=True" in n for n in names),
      sum("NORM=True" in n for n in names))
"""


def test_benchmark_launches_are_valid(compile_for_hopper):
    """benchmarks/skinny_fusions.py's default run launches (recorded for sm_90, nothing
    compiled) are valid for their rows (a bad config would fail the GPU run), fused (SiLU-and-mul
    and RMSNorm) and apart."""
    from pathlib import Path

    path = str(Path(__file__).parents[2] / "benchmarks" / "skinny_fusions.py")
    out = compile_for_hopper(RECORD_BENCHMARK.replace("{path!r}", repr(path))).split()
    total, gated, norm = (int(out[out.index("variants") + i]) for i in (1, 2, 3))
    assert gated > 40 and norm > 40 and total > gated + norm, out
