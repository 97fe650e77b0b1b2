"""`XqaEmulatedAttention` (the e4m3 rounding of FlashInfer's XQA kernel over an FP8 cache, on
the CPU) against float64 attention over the same dequantized cache, by the metric of
`benchmarks/fp8_kv_decode.py`: relative Frobenius error of the output. On an H200 that
benchmark measured XQA at 2.9-3.0e-2 (bound 8e-2) and the 16-bit paths at ~2e-3, on a bf16
query and K, V ~ N(0, 1) rounded to e4m3 (benchmarks/results/2026-11-27f-h200/final); the
emulation must land in XQA's range, not the 16-bit one, for the CPU quality run
(`benchmarks/fp8_quality.py --xqa`) to say anything about XQA.
"""

from __future__ import annotations

import random

import pytest
import torch

from phloem.ops.attention import AttentionMetadata
from phloem.ops.attention.reference import (
    ReferenceAttention,
    XqaEmulatedAttention,
    paged_attention_reference,
    round_e4m3,
    xqa_attention,
)

torch.set_num_threads(1)

HEADS, KV_HEADS, HEAD_DIM, BS = 32, 8, 128, 16  # Llama-3.1-8B's attention, the benchmark's
K_SCALE, V_SCALE = 0.5, 2.0  # the benchmark's --fp8-scales


def _step(seqs: list[tuple[int, int]], seed: int):
    """(bf16 query [T, H, D], e4m3 cache, meta) for sequences (q_len, seq_len), pages shuffled."""
    rng = random.Random(seed)
    pages = [-(-n // BS) for _, n in seqs]
    ids = list(range(sum(pages)))
    rng.shuffle(ids)
    tables = [ids[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(seqs))]
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(sum(pages), 2, BS, KV_HEADS, HEAD_DIM, generator=gen)
    cache = cache.to(torch.bfloat16).to(torch.float8_e4m3fn)
    num_tokens = sum(q for q, _ in seqs)
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata.from_host([q for q, _ in seqs], [n for _, n in seqs], tables, BS,
                                       device="cpu", padded_tables=True)  # fmt: skip
    return query, cache, meta


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_xqa_emulation_error_is_xqas_not_16_bit(kind):
    """Decode rows (the benchmark's 1,024 tokens, and shorter ones: masked padding, partial last
    tiles) and a prefill chunk (causal mask): the emulation's error is XQA's (measured 2.8e-2
    and 2.9e-2 here; XQA 2.9e-2 on the GPU), the plain reference's that of bf16 output
    rounding (1.7e-3; FlashInfer's 16-bit paths 2.1-2.3e-3); both read the cache's scales."""
    seqs = [(1, 1024)] * 4 + [(1, 700), (1, 65)] if kind == "decode" else [(48, 300)]
    query, cache, meta = _step(seqs, seed=7)
    scale = HEAD_DIM**-0.5
    want = paged_attention_reference(query, cache, meta, scale, torch.float64, K_SCALE, V_SCALE)
    emulated = XqaEmulatedAttention().forward(query, cache, meta, scale, None, K_SCALE, V_SCALE)
    plain = ReferenceAttention().forward(query, cache, meta, scale, None, K_SCALE, V_SCALE)
    assert emulated.dtype == torch.bfloat16
    err, err_plain = _rel_err(emulated, want), _rel_err(plain, want)
    assert 2.2e-2 <= err <= 3.6e-2, err
    assert err_plain <= 4e-3, err_plain


def test_xqa_tiling_without_rounding_is_exact_softmax():
    """The tiled online softmax (running maximum per 64-token tile, rescaled) without the e4m3
    rounding is ordinary attention to fp32 precision, including fully masked trailing tiles."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 32, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 4, 200, 32, generator=gen, dtype=torch.float64) * 3  # wide scores
    v = torch.randn(2, 4, 200, 32, generator=gen, dtype=torch.float64)
    mask = torch.arange(200)[None, :] <= torch.tensor([0, 63, 64, 130, 199])[:, None]
    got = xqa_attention(q, k, v, mask, 0.3, e4m3=False)
    want = torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf")), -1) @ v
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_round_e4m3_saturates_and_keeps_representable_values():
    x = torch.tensor([0.0, 1.0, 448.0, 500.0, -1e4, 1.0625, 0.001953125, 1e-4])
    got = round_e4m3(x)
    # 1.0625 is halfway between 1.0 and 1.125: ties to even (1.0); 2^-9 is the smallest
    # subnormal; 1e-4 underflows to 0
    assert got.tolist() == [0.0, 1.0, 448.0, 448.0, -448.0, 1.0, 0.001953125, 0.0]


def test_xqa_emulation_refuses_a_16_bit_cache():
    query, cache, meta = _step([(1, 20)], seed=1)
    with pytest.raises(ValueError, match="models an FP8 cache"):
        XqaEmulatedAttention().forward(query, cache.to(torch.bfloat16), meta, 0.1)
