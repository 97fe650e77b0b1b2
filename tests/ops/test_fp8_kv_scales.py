"""The FP8 KV cache with per-tensor scales (issue 18): the write (k / k_scale rounded to e4m3,
clamped at +-448) against a float64 emulation of e4m3, the reads of the reference backend and of
our Triton shared-prefix kernel (interpreted on the CPU) against float64 attention over the
dequantized cache, and the scale checks. Scales are far from 1 (1/16, 3/7, 5), so a path that
drops a scale is off by that factor."""

import random

import pytest
import torch

from phloem.layers.attention import Attention, kv_scale_targets
from phloem.ops.attention.prefix_groups import build_shared_prefix_metadata
from phloem.ops.attention.reference import ReferenceAttention, paged_attention_reference
from phloem.ops.attention.shared_prefix import (
    SharedPrefixAttention,
    shared_prefix_attention_triton,
)
from phloem.ops.attention.sharing_rule import SharingRule
from phloem.ops.kv_store import FP8_KV_DTYPE, check_kv_scale, write_kv
from tests.ops.test_shared_prefix import make_shared_step, random_members

torch.set_num_threads(1)


def e4m3_float64(x: torch.Tensor) -> torch.Tensor:
    """float64 values on the float8 e4m3fn grid, computed without torch's float8 cast: round to
    nearest even with 3 mantissa bits, subnormal spacing 2^-9, saturated at +-448."""
    a = x.abs().clamp(max=448.0)
    exponent = torch.floor(torch.log2(a.clamp(min=2.0**-6)))  # 2^-6: smallest normal
    ulp = torch.pow(2.0, exponent - 3)
    return torch.sign(x) * (torch.round(a / ulp) * ulp).clamp(max=448.0)


def test_emulation_matches_the_float8_cast():
    x = torch.randn(20000, dtype=torch.float64) * torch.logspace(-4, 3, 20000, dtype=torch.float64)
    cast = x.clamp(-448, 448).to(FP8_KV_DTYPE).double()
    assert torch.equal(e4m3_float64(x), cast)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("k_scale,v_scale", [(1 / 16, 3 / 7), (5.0, 1.0)])
def test_write_kv_round_trip_with_scales(layout, k_scale, v_scale):
    """Every written slot holds e4m3(x / scale); read back times the scale it is within one e4m3
    step of x (values past 448 * scale saturate); unwritten slots stay 0."""
    from phloem.ops.kv_store import allocate_kv_cache

    g = torch.Generator().manual_seed(1)
    k = torch.randn(12, 2, 8, generator=g) * 20
    v = torch.randn(12, 2, 8, generator=g) * 3
    k[0, 0, 0] = 448 * k_scale * 1.5  # saturates
    slots = torch.tensor([5, 0, 17, -1, 3, 30, 8, 9, 22, -1, 31, 12])
    cache = allocate_kv_cache(8, 4, 2, 8, FP8_KV_DTYPE, "cpu", layout)
    write_kv(cache, k, v, slots, k_scale, v_scale)
    ok = slots >= 0
    blocks, offsets = slots[ok] // 4, slots[ok] % 4
    got_k = cache[blocks, 0, offsets].double()
    got_v = cache[blocks, 1, offsets].double()
    assert torch.equal(got_k, e4m3_float64(k[ok].double() / k_scale))
    assert torch.equal(got_v, e4m3_float64(v[ok].double() / v_scale))
    assert got_k[0, 0, 0] == 448  # clamped, not NaN
    written = torch.zeros(8 * 4, dtype=torch.bool)
    written[slots[ok]] = True
    flat = cache.reshape(8, 2, 4, -1).transpose(1, 2).reshape(32, -1) if layout == "NHD" else None
    if flat is not None:
        assert not flat[~written].double().abs().sum()
    rel = (got_v * v_scale - v[ok].double()).abs() / v[ok].double().abs().clamp(min=1e-3)
    assert rel[v[ok].abs() > 2.0**-6 * v_scale].max() <= 2.0**-4 + 1e-12  # half an e4m3 step


def fp8_step(k_scale: float, v_scale: float, seed: int = 3):
    """A random shared-prefix step with its cache in FP8 (K / k_scale, V / v_scale) plus the
    float64 oracle's inputs: (query, cache8, meta, prefix_lens)."""
    rng = random.Random(seed)
    groups = [(32, random_members(rng, 4, max_own=20)), (16, [(1, 2), (2, 5)])]
    q, kv, meta, prefix_lens = make_shared_step(groups, [(1, 9), (5, 5)], 4, 2, 16,
                                                torch.float32, seed=seed)  # fmt: skip
    kv = kv * 6  # K and V up to ~25: at scale 1/16 far past 448 if a writer dropped the scale
    k8 = (kv[:, 0] / k_scale).clamp(-448, 448).to(FP8_KV_DTYPE)
    v8 = (kv[:, 1] / v_scale).clamp(-448, 448).to(FP8_KV_DTYPE)
    return q, torch.stack([k8, v8], dim=1), meta, prefix_lens


def dequantized(cache8: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    kv = cache8.double()  # NaN in unowned slots stays NaN
    return torch.stack([kv[:, 0] * k_scale, kv[:, 1] * v_scale], dim=1)


def test_reference_backend_reads_scaled_fp8():
    k_scale, v_scale = 3 / 7, 1 / 16
    q, cache8, meta, _ = fp8_step(k_scale, v_scale)
    want = paged_attention_reference(q.double(), dequantized(cache8, k_scale, v_scale), meta, 0.3)
    got = ReferenceAttention().forward(q, cache8, meta, 0.3, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the oracle's own scale arguments read the same thing
    alt = paged_attention_reference(q.double(), cache8, meta, 0.3, k_scale=k_scale,
                                    v_scale=v_scale)  # fmt: skip
    torch.testing.assert_close(alt, want, rtol=0, atol=1e-12)
    # a bf16/fp32 cache ignores the scales
    plain = ReferenceAttention().forward(q, cache8.float(), meta, 0.3, k_scale=k_scale)
    torch.testing.assert_close(
        plain.double(), paged_attention_reference(q.double(), cache8.double(), meta, 0.3),
        rtol=1e-3, atol=1e-3,
    )  # fmt: skip


@pytest.fixture(scope="module")
def triton_kernel(triton_kernels):
    """The Triton module; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    return triton_kernels("phloem.ops.attention.shared_prefix_triton", "tile_kernel")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("fp8_math,q_dtype,tol", [("f16", torch.float16, 2e-2),
                                                 ("q", torch.float32, 1e-5)])  # fmt: skip
def test_triton_reads_scaled_fp8(triton_kernel, fp8_math, q_dtype, tol):
    """Our shared-prefix kernel on an FP8 cache with scales (prefix tiles, split and merged,
    suffix tiles, lone sequences) against float64 attention over the dequantized cache."""
    k_scale, v_scale = 1 / 16, 3 / 7
    q, cache8, meta, prefix_lens = fp8_step(k_scale, v_scale)
    q = q.to(q_dtype)
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    assert sp.num_groups == 2
    dev = device()
    got = shared_prefix_attention_triton(q.to(dev), cache8.to(dev), meta, sp, 0.3, block_n=16,
                                         prefix_splits=2, fp8_math=fp8_math, k_scale=k_scale,
                                         v_scale=v_scale)  # fmt: skip
    want = paged_attention_reference(q.double(), dequantized(cache8, k_scale, v_scale), meta, 0.3)
    # float16 math: the output's and the probabilities' float16 rounding (outputs up to ~25)
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)


def test_shared_prefix_backend_passes_scales_to_every_path(triton_kernel):
    """The backend's forward hands k_scale / v_scale to the shared path (Triton here) and to the
    plain fallback on steps where sharing does not pay."""
    k_scale, v_scale = 1 / 16, 3 / 7
    q, cache8, meta, prefix_lens = fp8_step(k_scale, v_scale, seed=5)
    meta.prefix_lens_cpu = prefix_lens
    want = paged_attention_reference(q.double(), dequantized(cache8, k_scale, v_scale), meta, 0.3)
    dev = device()
    for min_saved in (1, 10**9):  # shared path, then plain
        rule = SharingRule(min_saved_kv_tokens=min_saved, partial_cost_tokens=0)
        backend = SharedPrefixAttention(ReferenceAttention(), impl="triton", rule=rule,
                                        device=dev, block_n=16)  # fmt: skip
        backend.begin_step(meta)
        got = backend.forward(q.to(dev), cache8.to(dev), meta, 0.3, None, k_scale, v_scale)
        assert backend.last_path == ("shared_prefix" if min_saved == 1 else "reference")
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)


def test_checkpoint_scale_names():
    assert kv_scale_targets("model.layers.3.self_attn.k_scale") == (
        "model.layers.3.self_attn.attn", ("k",))  # fmt: skip
    assert kv_scale_targets("model.layers.0.self_attn.v_proj.output_scale")[1] == ("v",)
    assert kv_scale_targets("model.layers.0.self_attn.kv_scale")[1] == ("k", "v")
    assert kv_scale_targets("model.layers.0.self_attn.q_scale")[1] == ()
    assert kv_scale_targets("model.layers.0.self_attn.k_proj.weight_scale") is None
    assert kv_scale_targets("model.layers.0.mlp.down_proj.weight") is None


def test_bad_scales_raise_naming_the_tensor():
    attn = Attention(4, 2, 16, 0.25, 0)
    attn.load_kv_scale(("k", "v"), torch.tensor([0.5]), "x.kv_scale")
    assert (attn.k_scale, attn.v_scale) == (0.5, 0.5)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_scale: shape \(2,\)"):
        attn.load_kv_scale(("k",), torch.ones(2), "model.layers.1.self_attn.k_scale")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="v_scale must be a finite number > 0"):
            attn.load_kv_scale(("v",), torch.tensor(bad), "model.layers.1.self_attn.v_scale")
    assert check_kv_scale("k_scale", 2) == 2.0


def test_fused_rope_kernel_writes_scaled_fp8(triton_kernels):
    """The fused RoPE + KV-write kernel stores k / k_scale and v / v_scale, clamped at 448, as
    `write_kv` does. Positions 0 (RoPE is the identity there) and values on the e4m3 grid times
    power-of-two scales keep every quotient exact: the interpreter's float32 -> e4m3 rounding
    is wrong where rounding crosses a power of two, so this test leaves nothing to round."""
    from phloem.layers.rotary import RotaryEmbedding

    kernel = triton_kernels("phloem.ops.rope_kv", "_rope_kv_kernel").rope_and_write_kv
    k_scale, v_scale = 1 / 16, 4.0
    g = torch.Generator().manual_seed(2)
    grid = torch.randn(6, 2, 16, generator=g).clamp(-400, 400).to(FP8_KV_DTYPE).float() * 8
    k, v = grid * k_scale, (grid.flip(0) * v_scale).clone()
    k[0, 0, 0] = 1000 * k_scale  # past 448 * k_scale: clamps to 448
    q = torch.randn(6, 4, 16, generator=g)
    rotary = RotaryEmbedding(16, 16, 64, {"rope_theta": 10000.0})
    positions = torch.zeros(6, dtype=torch.int64)
    slots = torch.tensor([3, 0, 9, -1, 14, 6])
    got = torch.zeros(4, 2, 4, 2, 16, dtype=FP8_KV_DTYPE)
    want = torch.zeros_like(got)
    dev = device()
    out = kernel(positions.to(dev), q.to(dev), k.to(dev), v.to(dev), rotary.cos.to(dev),
                 rotary.sin.to(dev), got_d := got.to(dev), slots.to(dev), k_scale,
                 v_scale)  # fmt: skip
    write_kv(want, k, v, slots, k_scale, v_scale)
    torch.testing.assert_close(out.cpu(), q)  # position 0: q unrotated
    assert torch.equal(got_d.cpu().float(), want.float())
    assert got_d.cpu().float().abs().max() == 448


def test_scale_loads_from_a_lazy_checkpoint_slice(tmp_path):
    """Under tensor parallelism the loader hands lazy slices (`CheckpointSlice`); a scale is
    read whole on every rank."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from phloem.layers.linear import CheckpointSlice

    path = tmp_path / "scales.safetensors"
    save_file({"k": torch.tensor(0.25), "bad": torch.ones(3)}, path)
    attn = Attention(4, 2, 16, 0.25, 0)
    with safe_open(path, framework="pt", device="cpu") as f:
        attn.load_kv_scale(("k",), CheckpointSlice(f.get_slice("k")), "x.k_scale")
        with pytest.raises(ValueError, match=r"x.v_scale: shape \(3,\)"):
            attn.load_kv_scale(("v",), CheckpointSlice(f.get_slice("bad")), "x.v_scale")
    assert (attn.k_scale, attn.v_scale) == (0.25, 1.0)
