"""The FP8 KV cache with per-tensor scales on the GPU (issue 18): FlashInfer's FP8 paged kernels
(batch prefill for every step with PHLOEM_FP8_DECODE_KERNEL=prefill, eager and replayed in a CUDA
graph; batch decode for decode-only steps with =cuda_core) and our shared-prefix Triton kernel
against float32 attention over the dequantized cache, the fused RoPE + KV-write kernel against `write_kv`, and an engine on Llama-3.1-8B shapes
(2 layers, random weights, bf16) with `kv_cache_dtype="fp8"`, alone and with
`quantization="fp8"`: CUDA graphs give the eager run's tokens, and greedy tokens mostly agree
with the bf16 cache's (printed; loose bar: random weights have near-tied logits).

Scales are far from 1 (k_scale 1/16, v_scale 3/7), so a kernel that drops one is off by that
factor. Tolerance: relative error ||out - ref|| / ||ref|| <= 1e-2 (bf16 queries and outputs).

FlashInfer's XQA kernel (which rounds the query and the softmax weights to e4m3; the default for
decode-only steps on sm_90/100/120, PHLOEM_FP8_DECODE_KERNEL unset, and =xqa): on
`benchmarks/fp8_kv_decode.py`'s inputs (K, V ~ N(0, 1) stored in e4m3,
read with scales 0.5 / 2.0) against float64 at that benchmark's bound for e4m3 math, 8e-2
(measured 2.9e-2 on an H200), and against its CPU emulation (`XqaEmulatedAttention`, which
`benchmarks/fp8_quality.py --xqa` measures quality with), eager and replayed in a CUDA graph;
the default choosing it for the embedded model's, Llama-3.1-8B's and 70B's geometries (each
within the same bound); and an engine on the default against =prefill."""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.engine_runs import first_token_agreement, greedy, llama8b_two_layers
from tests.gpu.test_flashinfer_attention import RUN_SEED, _rel_err, _step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

K_SCALE, V_SCALE = 1 / 16, 3 / 7
HEADS, KV_HEADS, HEAD_DIM, BS = 32, 8, 128, 16
XQA_SCALES = (0.5, 2.0)  # benchmarks/fp8_kv_decode.py's --fp8-scales
XQA_TOL = 8e-2  # benchmarks/fp8_kv_decode.py's REL_TOL["e4m3"]
needs_xqa = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10, 12),
    reason="FlashInfer's XQA runs on sm_90, sm_100 and sm_120",
)


def _fp8(kv: torch.Tensor) -> torch.Tensor:
    """A bf16 cache (K, V ~ N(0, 1); NaN in unowned slots) as FP8 with the test's scales, K and
    V made larger first (K up to ~25: past 448 at scale 1/16 if a writer dropped the scale)."""
    k = (kv[:, 0].float() * 6 / K_SCALE).clamp(-448, 448)
    v = (kv[:, 1].float() * 2 / V_SCALE).clamp(-448, 448)
    return torch.stack([k, v], dim=1).to(torch.float8_e4m3fn)


def _reference(query, cache8, meta, dtype=torch.float32, scales=(K_SCALE, V_SCALE)):
    from phloem.ops.attention.reference import paged_attention_reference

    head_dim = query.shape[-1]
    return paged_attention_reference(query, cache8, meta, head_dim**-0.5, dtype, *scales)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("decode_kernel", ["prefill", "cuda_core"])
def test_flashinfer_reads_scaled_fp8(kind, decode_kernel, monkeypatch):
    """Mixed steps run the prefill kernel; decode-only steps too with
    PHLOEM_FP8_DECODE_KERNEL=prefill, and the CUDA-core batch decode kernel with =cuda_core."""
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention

    monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", decode_kernel)
    rng = random.Random(RUN_SEED)
    seqs = [(1, rng.randint(1, 3000)) for _ in range(4)]
    if kind == "mixed":
        seqs += [(40, 40), (17, 300), (1, 5)]
    query, kv, meta = _step(seqs, BS, HEADS, KV_HEADS, HEAD_DIM, RUN_SEED)
    cache8 = _fp8(kv)
    backend = FlashInferAttention(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda",
                                  kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    backend.begin_step(meta)
    decode = isinstance(backend._active, backend._flashinfer.BatchDecodeWithPagedKVCacheWrapper)
    assert decode == (kind == "decode" and decode_kernel == "cuda_core")
    out = backend.forward(query, cache8, meta, HEAD_DIM**-0.5, None, K_SCALE, V_SCALE)
    err = _rel_err(out, _reference(query, cache8, meta))
    assert err <= 1e-2, f"{kind}: rel err {err:.2e}"


@pytest.mark.parametrize("decode_kernel", ["prefill", "cuda_core"])
def test_flashinfer_fp8_decode_graph_replays_new_tables(decode_kernel, monkeypatch):
    """An FP8 cache's decode kernel (each choice of PHLOEM_FP8_DECODE_KERNEL) captured once
    (scales are constants of the capture), replayed after re-planning other lengths and page
    tables."""
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention

    monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", decode_kernel)
    batch = 8
    rng = random.Random(RUN_SEED)
    backend = FlashInferAttention(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda",
                                  kv_dtype=torch.float8_e4m3fn,
                                  max_num_blocks_per_seq=128)  # fmt: skip
    seqs = [(1, rng.randint(1, 2000)) for _ in range(batch)]
    query, kv, meta = _step(seqs, BS, HEADS, KV_HEADS, HEAD_DIM, RUN_SEED, num_blocks=1100)
    cache8 = _fp8(kv)
    static_q = query.clone()
    static_out = torch.empty_like(query)
    backend.prepare_replay(meta)
    backend.forward(static_q, cache8, meta, HEAD_DIM**-0.5, static_out, K_SCALE, V_SCALE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(static_q, cache8, meta, HEAD_DIM**-0.5, static_out, K_SCALE, V_SCALE)
    for trial in range(3):
        seqs = [(1, rng.randint(1, 2000)) for _ in range(batch)]
        q2, kv2, meta2 = _step(seqs, BS, HEADS, KV_HEADS, HEAD_DIM, RUN_SEED + trial + 1, 1100)
        cache8.copy_(_fp8(kv2))
        static_q.copy_(q2)
        backend.prepare_replay(meta2)
        static_out.fill_(float("nan"))
        graph.replay()
        err = _rel_err(static_out, _reference(q2, cache8, meta2))
        assert err <= 1e-2, f"trial {trial}: rel err {err:.2e} for {seqs}"


def _xqa_inputs(seqs, seed, num_blocks=None, geometry=(HEADS, KV_HEADS, HEAD_DIM)):
    """`_step`'s inputs as `benchmarks/fp8_kv_decode.py` makes them: K, V ~ N(0, 1) stored in
    e4m3, read with `XQA_SCALES`; unowned slots hold 100 (finite, as an engine's stale blocks
    are, and large, so a read past a sequence's length shows)."""
    query, kv, meta = _step(seqs, BS, *geometry, seed, num_blocks)
    return query, kv.nan_to_num(nan=100.0).to(torch.float8_e4m3fn), meta


def _xqa_errors(out, query, cache8, meta) -> tuple[float, float]:
    """(relative error against float64, ||out - emulated|| / ||float64||) of an XQA output;
    the CPU emulation (`XqaEmulatedAttention`) runs on the GPU's tensors."""
    from phloem.ops.attention.reference import XqaEmulatedAttention

    want = _reference(query, cache8, meta, torch.float64, XQA_SCALES)
    emulated = XqaEmulatedAttention().forward(query, cache8, meta, query.shape[-1] ** -0.5, None,
                                              *XQA_SCALES)  # fmt: skip
    diff = (out.double() - emulated.double()).norm() / want.norm()
    return _rel_err(out, want), diff.item()


@needs_xqa
@pytest.mark.parametrize("case", ["b64_kv1024", "random"])
def test_xqa_decode_against_float64_and_its_emulation(case, monkeypatch):
    """Decode-only steps reach XQA (the planned step is an `XqaStep`); its error against
    float64 is e4m3 math's (>= 1e-2: the query and P are rounded; <= 8e-2). At the benchmark's
    64 x 1,024 tokens XQA runs one CTA per sequence and KV head (its host code splits a
    sequence over round(SMs * 3 // (B * H_kv) * 0.25) CTAs: 1 from B = 9 on 132 SMs), as the
    emulation computes, so the two differ by much less than either's error (<= 1e-2 of the
    output's norm); 4 random lengths run its multi-block mode (each split's running maximum
    starts over, which the emulation does not model): printed only."""
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention
    from phloem.ops.attention.flashinfer_xqa import XqaStep

    monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", "xqa")
    rng = random.Random(RUN_SEED)
    seqs = (
        [(1, 1024)] * 64 if case == "b64_kv1024" else [(1, rng.randint(1, 3000)) for _ in range(4)]
    )
    query, cache8, meta = _xqa_inputs(seqs, RUN_SEED)
    backend = FlashInferAttention(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda",
                                  kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    backend.begin_step(meta)
    assert isinstance(backend._active, XqaStep)
    out = backend.forward(query, cache8, meta, HEAD_DIM**-0.5, None, *XQA_SCALES)
    err, vs_emulation = _xqa_errors(out, query, cache8, meta)
    print(f"xqa {case}: rel err vs float64 {err:.2e}, vs the CPU emulation {vs_emulation:.2e}")
    assert 1e-2 <= err <= XQA_TOL, err
    if case == "b64_kv1024":
        assert vs_emulation <= 1e-2, vs_emulation


@needs_xqa
@pytest.mark.parametrize(
    "geometry", [(32, 8, 128), (9, 3, 64), (64, 8, 128)], ids=["llama8b", "smollm2", "llama70b"]
)
def test_default_decodes_on_xqa(geometry, monkeypatch):
    """PHLOEM_FP8_DECODE_KERNEL unset on this GPU: decode-only steps plan XQA, eager and for a
    graph, for Llama-3.1-8B's heads (group 4), the embedded SmolLM2-135M's (group 3, head dim
    64) and Llama-3.1-70B's (group 8), each a module of its own, within XQA_TOL of float64
    and over 1e-2 (e4m3 math: not the prefill kernel's 16-bit math); mixed steps keep the
    prefill kernel. The default's rule for every other GPU is tested on the CPU
    (tests/ops/test_fp8_kv_decode_switch.py)."""
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention
    from phloem.ops.attention.flashinfer_xqa import XqaStep

    monkeypatch.delenv("PHLOEM_FP8_DECODE_KERNEL", raising=False)
    heads, kv_heads, head_dim = geometry
    rng = random.Random(RUN_SEED)
    seqs = [(1, rng.randint(1, 3000)) for _ in range(20)]
    query, cache8, meta = _xqa_inputs(seqs, RUN_SEED, geometry=geometry)
    backend = FlashInferAttention(heads, kv_heads, head_dim, torch.bfloat16, "cuda",
                                  kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    assert backend.fp8_decode_kernel == "xqa" and backend.decode_path(BS) == "xqa"
    backend.prepare_replay(meta)
    assert isinstance(backend._active, XqaStep)
    backend.begin_step(meta)
    assert isinstance(backend._active, XqaStep)
    out = backend.forward(query, cache8, meta, head_dim**-0.5, None, *XQA_SCALES)
    err, vs_emulation = _xqa_errors(out, query, cache8, meta)
    print(f"default (xqa) {geometry}: rel err vs float64 {err:.2e}, vs the CPU emulation "
          f"{vs_emulation:.2e}")  # fmt: skip
    assert 1e-2 <= err <= XQA_TOL, err
    mixed = _step([(40, 40), (1, 300)], BS, heads, kv_heads, head_dim, RUN_SEED)[2]
    backend.begin_step(mixed)
    assert not isinstance(backend._active, XqaStep)


@needs_xqa
def test_xqa_decode_graph_replays_new_tables(monkeypatch):
    """XQA captured once at batch 8, replayed after re-planning other lengths and tables (the
    graph's fixed table is wider than any step's): within XQA_TOL of float64 each time."""
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention

    monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", "xqa")
    batch, rng = 8, random.Random(RUN_SEED)
    backend = FlashInferAttention(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda",
                                  kv_dtype=torch.float8_e4m3fn,
                                  max_num_blocks_per_seq=128)  # fmt: skip
    seqs = [(1, rng.randint(1, 2000)) for _ in range(batch)]
    query, cache8, meta = _xqa_inputs(seqs, RUN_SEED, num_blocks=1100)
    static_q, static_out = query.clone(), torch.empty_like(query)
    backend.prepare_replay(meta)
    backend.forward(static_q, cache8, meta, HEAD_DIM**-0.5, static_out, *XQA_SCALES)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(static_q, cache8, meta, HEAD_DIM**-0.5, static_out, *XQA_SCALES)
    for trial in range(3):
        seqs = [(1, rng.randint(1, 2000)) for _ in range(batch)]
        q2, cache2, meta2 = _xqa_inputs(seqs, RUN_SEED + trial + 1, num_blocks=1100)
        cache8.copy_(cache2)
        static_q.copy_(q2)
        backend.prepare_replay(meta2)
        static_out.fill_(float("nan"))
        graph.replay()
        err = _rel_err(static_out, _reference(q2, cache8, meta2, torch.float64, XQA_SCALES))
        assert err <= XQA_TOL, f"trial {trial}: rel err {err:.2e} for {seqs}"


def test_triton_shared_prefix_reads_scaled_fp8():
    """Our kernel, bf16 queries, Llama-8B heads: 4 groups of 16 decode members over a
    2,048-token prefix, in float16 math and in the query's dtype."""
    from phloem.ops.attention import AttentionMetadata
    from phloem.ops.attention.prefix_groups import build_shared_prefix_metadata
    from phloem.ops.attention.shared_prefix import shared_prefix_attention_triton

    rng = random.Random(RUN_SEED)
    prefix_blocks = 2048 // BS
    seq_lens, tables, prefix_lens = [], [], []
    next_block = 0
    for _ in range(4):
        prefix = list(range(next_block, next_block + prefix_blocks))
        next_block += prefix_blocks
        for _ in range(16):
            own = rng.randint(1, 200)
            blocks = -(-own // BS)
            tables.append(prefix + list(range(next_block, next_block + blocks)))
            next_block += blocks
            seq_lens.append(2048 + own)
            prefix_lens.append(2048)
    g = torch.Generator(device="cuda").manual_seed(RUN_SEED)
    shape = (next_block, 2, BS, KV_HEADS, HEAD_DIM)
    kv = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    query = torch.randn(64, HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
    meta = AttentionMetadata.from_host([1] * 64, seq_lens, tables, BS, "cuda",
                                       padded_tables=True, prefix_lens=prefix_lens)  # fmt: skip
    cache8 = _fp8(kv)
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    assert sp.num_groups == 4
    ref = _reference(query, cache8, meta)
    for fp8_math in ("f16", "q"):
        out = shared_prefix_attention_triton(query, cache8, meta, sp, HEAD_DIM**-0.5,
                                             fp8_math=fp8_math, k_scale=K_SCALE,
                                             v_scale=V_SCALE)  # fmt: skip
        err = _rel_err(out, ref)
        assert err <= 1e-2, f"fp8_math {fp8_math}: rel err {err:.2e}"


def test_rope_kv_kernel_writes_scaled_fp8():
    """The fused kernel stores k / k_scale and v / v_scale as `write_kv` does (within one e4m3
    step: the torch path rounds the rotation to bf16 first)."""
    from phloem.layers.rotary import RotaryEmbedding
    from phloem.ops.kv_store import write_kv
    from phloem.ops.rope_kv import rope_and_write_kv

    g = torch.Generator(device="cuda").manual_seed(RUN_SEED)
    rotary = RotaryEmbedding(HEAD_DIM, HEAD_DIM, 4096, {"rope_theta": 500000.0}).cuda()
    t = 64
    q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
    k = (torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", generator=g) * 6).to(torch.bfloat16)
    v = (torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", generator=g) * 2).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (t,), device="cuda", generator=g)
    slots = torch.randperm(16 * BS, device="cuda", generator=g)[:t]
    shape = (16, 2, BS, KV_HEADS, HEAD_DIM)
    got = torch.zeros(shape, dtype=torch.float8_e4m3fn, device="cuda")
    rope_and_write_kv(positions, q, k, v, rotary.cos, rotary.sin, got, slots, K_SCALE, V_SCALE)
    want = torch.zeros_like(got)
    _, k_rot = rotary(positions, q, k)
    write_kv(want, k_rot, v, slots, K_SCALE, V_SCALE)
    assert got.float().abs().max() > 100  # scaled: |k| / (1/16) reaches the hundreds
    torch.testing.assert_close(got.float(), want.float(), rtol=0.13, atol=1e-2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return llama8b_two_layers(tmp_path_factory.mktemp("llama8b"))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="quantization='fp8' needs FP8 tensor cores (sm >= 8.9)",
)
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fp8_kv_engine_graphs_and_agreement(setup, quantization):
    path, prompts = setup
    kw = dict(kv_cache_dtype="fp8", quantization=quantization)
    eager, _ = greedy(path, prompts, enforce_eager=True, **kw)
    graphed, graphs = greedy(path, prompts, **kw)
    assert graphs, "CUDA graphs were not captured"
    assert graphed == eager
    dense, _ = greedy(path, prompts)
    first, prefix = first_token_agreement(graphed, dense)
    print(f"fp8 kv (quantization={quantization}) vs bf16: first-token agreement {first:.2f}, "
          f"tokens before divergence {prefix}")  # fmt: skip
    assert first >= 0.5, (first, prefix)


@needs_xqa
def test_fp8_kv_xqa_engine_graphs_and_agreement(setup, monkeypatch):
    """An engine on the default decode kernel of an FP8 cache here, XQA (PHLOEM_FP8_DECODE_KERNEL
    unset: decode-only steps on XQA, `test_default_decodes_on_xqa`; prefill on the same fa2
    kernel as =prefill): CUDA graphs give the eager run's tokens (the same kernel at the same
    batch and split); against =prefill (XQA off) the first tokens (from the prefill, same
    kernel) are equal and the first decoded ones (XQA's first) agree for at least 2 of the 8
    prompts. A loose bar: random weights have near-tied logits (the FP8 cache against bf16
    agreed on 0.75 of first tokens, diverging after 0-16 tokens, on the H200), while a kernel
    that misread the cache or dropped a scale would flip nearly every argmax."""
    path, prompts = setup
    monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", "prefill")
    prefill, _ = greedy(path, prompts, kv_cache_dtype="fp8")
    monkeypatch.delenv("PHLOEM_FP8_DECODE_KERNEL")
    eager, _ = greedy(path, prompts, kv_cache_dtype="fp8", enforce_eager=True)
    graphed, graphs = greedy(path, prompts, kv_cache_dtype="fp8")
    assert graphs, "CUDA graphs were not captured"
    assert graphed == eager
    first, prefix = first_token_agreement(graphed, prefill)
    second = sum(a[1] == b[1] for a, b in zip(graphed, prefill)) / len(prefill)
    print(f"fp8 kv, default (xqa) vs =prefill: first-token agreement {first:.2f}, first "
          f"decoded token {second:.2f}, tokens before divergence {prefix}")  # fmt: skip
    assert first == 1.0, (first, prefix)
    assert second >= 0.25, (second, prefix)
