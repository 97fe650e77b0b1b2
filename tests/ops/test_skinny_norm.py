"""The residual add + RMSNorm fused into the skinny GEMM that reads the norm (interpreted on the
CPU): against float64 torch, the new residual bit for bit against the unfused add, the launch
checks, PHLOEM_FUSED_RMSNORM, and a decoder layer's projections with and without it."""

from __future__ import annotations

import pytest
import torch

from phloem.layers.quantization import base as quant_base


@pytest.fixture(scope="module")
def sn(triton_kernels):
    """The fused module; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    triton_kernels("phloem.ops.skinny_gemm", "_skinny_dot_kernel")
    from phloem.ops import skinny_norm

    return skinny_norm


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(rows: int, n: int, k: int, dtype: torch.dtype, residual: bool, bias: bool, seed: int):
    """Fresh x, residual (or None) [rows, k] ~ N(0, 1), a norm weight [k] ~ 1 + N(0, 0.1^2),
    W [n, k], bias [n] or None, on the test device."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    r = torch.randn(rows, k, generator=g).to(dtype) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return [t.to(device()) if t is not None else None for t in (x, r, nw, w, b)]


def reference(x, r, nw, eps, w, b) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(RMSNorm(h) W^T + b in float64, h = x + r rounded as torch rounds it, and per output the
    size of one rounding of each product's input: sqrt(sum_k (xn_k w_k)^2) * x's epsilon)."""
    h = (x if r is None else x + r).cpu()
    h64 = h.double()
    xn = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * nw.cpu().double()
    w64 = w.cpu().double()
    out = xn @ w64.T + (0 if b is None else b.cpu().double())
    step = ((xn * xn) @ (w64 * w64).T).sqrt() * torch.finfo(x.dtype).eps
    return out, h, step


CASES = [  # (n, k, config): every tile product and launch shape of the kernel, one split of K
    (64, 256, None),  # the default config (CUDA cores to 4 rows, then tensor cores)
    (40, 200, dict(block_n=16, block_k=64)),  # K % block_k != 0 and N % block_n != 0
    (40, 96, dict(block_n=16, block_k=32, tensor_cores=True)),  # tl.dot at any rows count
]


@pytest.mark.parametrize("rows", [1, 4, 5, 16])
@pytest.mark.parametrize("n,k,config", CASES)
def test_fused_matches_float64(sn, rows, n, k, config):
    """Within 4 roundings of the GEMM's input (the kernel multiplies h * w_norm, rounded once on
    the tensor cores; Triton's interpreter truncates bf16) plus one of the output; bf16, fp16
    at 5 rows, where the new residual is also torch's add bit for bit (the interpreter rounds
    fp16 as the GPU does); at 4 rows without a residual (a first layer)."""
    dtype, residual = torch.float16 if rows == 5 else torch.bfloat16, rows != 4
    x, r, nw, w, b = inputs(rows, n, k, dtype, residual, bias=rows % 2 == 1, seed=rows + k)
    cfg = sn.sk.SkinnyConfig(**config) if config else None
    got, h = sn.rms_norm_linear(x, r, nw, 1e-5, w, b, cfg)
    assert got.shape == (rows, n) and got.dtype == h.dtype == dtype
    want, want_h, step = reference(x, r, nw, 1e-5, w, b)
    err = (got.cpu().double() - want).abs()
    assert (err <= 4 * step + 2 * torch.finfo(dtype).eps * want.abs() + 1e-4).all(), err.max()
    if r is None:
        assert h is x
    elif dtype == torch.float16 or h.is_cuda:
        assert torch.equal(h.cpu(), want_h)


def test_fused_checks_its_inputs(sn):
    x, r, nw, w, _ = inputs(6, 24, 32, torch.bfloat16, residual=True, bias=False, seed=3)
    out, h = sn.rms_norm_linear(x.view(2, 3, 32), r.view(2, 3, 32), nw, 1e-6, w)
    assert out.shape == (2, 3, 24) and h.shape == (2, 3, 32)
    with pytest.raises(ValueError, match="norm_weight must be"):
        sn.rms_norm_linear(x, r, nw[:16], 1e-6, w)
    with pytest.raises(ValueError, match="residual must be"):
        sn.rms_norm_linear(x, r[:2], nw, 1e-6, w)
    with pytest.raises(ValueError, match="one split of K"):
        sn.rms_norm_linear(x, r, nw, 1e-6, w, None, sn.sk.SkinnyConfig(16, 16, split_k=2))
    assert sn.takes(x, r, nw, w) and sn.takes(x, None, nw, w)
    assert not sn.takes(x, r[:2], nw, w) and not sn.takes(x, r, nw.float(), w)
    assert not sn.takes(torch.cat([x, x, x]), None, nw, w)  # 18 rows


def test_rows_fuse_where_k_stays_in_one_split(sn, monkeypatch):
    x, r, nw, w, _ = inputs(3, 32, 64, torch.bfloat16, residual=True, bias=False, seed=0)
    assert sn.takes(x, r, nw, w) and not sn.takes(x, r, nw, w, measured_only=True)
    split = sn.sk.SkinnyConfig(block_n=16, block_k=16, split_k=2)
    monkeypatch.setitem(sn.sk.CONFIGS, (4, 32, 64), split)
    assert sn.sk.takes(x, w) and not sn.takes(x, r, nw, w)  # the plain GEMM splits K: apart
    fused = sn.sk.SkinnyConfig(block_n=16, block_k=32)
    monkeypatch.setitem(sn.CONFIGS, (4, 32, 64), fused)
    assert sn.takes(x, r, nw, w) and sn.config_for(3, 32, 64) is fused
    monkeypatch.setitem(sn.CONFIGS, (4, 32, 64), None)  # measured: apart is faster
    assert not sn.takes(x, r, nw, w)


@pytest.fixture
def flags(fusion_flags):
    """`set(skinny, fused)`: PHLOEM_SKINNY_GEMM and PHLOEM_FUSED_RMSNORM (None: unset), read
    afresh (tests/ops/conftest.py)."""
    return fusion_flags(quant_base.FUSED_RMSNORM_ENV, quant_base.skinny_norm_module)


def test_flag_is_on_by_default_and_validated(sn, flags):
    flags(None, None)
    assert quant_base.skinny_norm_module() is sn
    flags(None, "0")
    assert quant_base.skinny_norm_module() is None
    flags(None, "yes")
    with pytest.raises(ValueError, match="PHLOEM_FUSED_RMSNORM must be 0 or 1"):
        quant_base.skinny_norm_module()


def test_projection_after_a_norm_with_and_without_the_fusion(sn, flags, monkeypatch):
    """An fp16 QKV projection after its RMSNorm (hidden 32): at 1 and 5 rows the fused call gives
    the unfused (norm, then GEMM) output within the input's rounding and the same new residual,
    and skips the norm layer; the first layer's call (no residual) returns x as the residual;
    at 17 rows, with PHLOEM_FUSED_RMSNORM=0, or a norm that all-reduces its input first, the
    norm runs apart."""
    from phloem.layers.linear import QKVLinear
    from phloem.layers.norm import RMSNorm

    qkv = QKVLinear(32, 8, 4, 2, bias=True, dtype=torch.float16).to(device())
    norm = RMSNorm(32, 1e-6, torch.float16).to(device())
    g = torch.Generator().manual_seed(1)
    for p in (*qkv.parameters(), *norm.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g) / 4 + (1 if p is norm.weight else 0))
    fused, norms = [], []
    real = sn.rms_norm_linear
    monkeypatch.setattr(sn, "rms_norm_linear", lambda *a: fused.append(1) or real(*a))
    norm.register_forward_hook(lambda *_: norms.append(1))
    for rows in (1, 5, 17):
        x, r = (torch.randn(rows, 32, generator=g).half().to(device()) for _ in range(2))
        flags("1", "0")
        plain, plain_res = qkv.forward_rms_norm(x, r, norm)
        assert len(norms) == 1 and not fused
        flags("1", None)
        got, res = qkv.forward_rms_norm(x, r, norm)
        assert (len(norms), len(fused)) == ((1, 1) if rows <= 16 else (2, 0)), rows
        torch.testing.assert_close(got, plain, rtol=2e-3, atol=2e-3)
        assert torch.equal(res, plain_res)
        first, first_res = qkv.forward_rms_norm(x, None, norm)
        assert first_res is x and torch.allclose(first, qkv(norm(x)), rtol=2e-3, atol=2e-3)
        norms.clear()
        fused.clear()
    norm.reduces_input = True  # TP's deferred all-reduce (none at one rank): the norm's path
    qkv.forward_rms_norm(x[:1], r[:1], norm)
    assert len(norms) == 1 and not fused
