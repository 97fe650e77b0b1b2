"""The roofline arithmetic (shared/docs/ROOFLINE.md) against numbers computed by hand."""

import pytest

from phloem.bench.roofline import ModelShape, batch_work, workload_roofline
from phloem.bench.workloads import Workload

# Llama-3.1-8B: d=4096, L=32, h_q=32, h_kv=8, h_d=128, f=14336, V=128256.
LLAMA = ModelShape(4096, 32, 32, 8, 128, 14336, 128256)


def test_llama_8b_constants():
    per_layer = 4096 * 32 * 128 * 2 + 4096 * 8 * 128 * 2 + 3 * 4096 * 14336
    assert per_layer == 218_103_808
    assert LLAMA.p_lin == 32 * per_layer == 6_979_321_856
    assert LLAMA.lm_head == 525_336_576
    assert LLAMA.kv_bytes_per_token == 131_072  # 2 * 32 * 8 * 128 * 2 bytes
    assert LLAMA.weight_bytes == 2 * (6_979_321_856 + 2 * 525_336_576)


def test_lone_request_by_hand():
    tiny = ModelShape(hidden=2, layers=1, q_heads=1, kv_heads=1, head_dim=2, mlp=1, vocab=3)
    # P = 2*1*2*2 + 2*1*2*2 + 3*2*1 = 22; H = 6; attn = L*h_q*h_d = 2; kv = 2*1*1*2*2 = 8 B/token
    n, o = 4, 2
    flops, nbytes = batch_work(tiny, [(0, [(n, o)])])
    prompt = 2 * 22 * 4 + 4 * 2 * 4 * (0 + 4 / 2)  # 176 + 64
    outputs = (2 * 22 + 2 * 6) * 2 + 4 * 2 * 2 * (4 + 2 / 2)  # 112 + 80
    assert flops == pytest.approx(prompt + outputs)
    weights = 2 * (22 + 2 * 6) * 2  # weight bytes * max(o)
    assert nbytes == pytest.approx(8 * 2 * (4 + 1) + weights)


def test_shared_prefix_counted_once():
    tiny = ModelShape(2, 1, 1, 1, 2, 1, 3)
    p, n, o = 3, 5, 2
    flops, nbytes = batch_work(tiny, [(p, [(n, o), (n, o)])])
    prefix = 2 * 22 * p + 2 * 2 * p * p
    own = 2 * 22 * (n - p) + 4 * 2 * (n - p) * (p + (n - p) / 2)
    out = (2 * 22 + 2 * 6) * o + 4 * 2 * o * (n + o / 2)
    assert flops == pytest.approx(prefix + 2 * (own + out))
    kv = 8
    assert nbytes == pytest.approx(2 * kv * o * ((n - p) + o / 2) + kv * p * o + 68 * o)


def test_bound_is_the_larger_time_and_sequential_sums():
    w = Workload("x", {}, [[1] * 128], [256], [(0, [0])])
    roof = workload_roofline(LLAMA, w, flops_per_s=1e15, bytes_per_s=3e12)
    assert roof.limiter == "memory"
    assert roof.bound_time_s == pytest.approx(roof.bytes / 3e12)
    seq = Workload("x", {}, [[1] * 128] * 2, [256] * 2, [(0, [0]), (0, [1])], sequential=True)
    batched = Workload("x", {}, [[1] * 128] * 2, [256] * 2, [(0, [0]), (0, [1])])
    two = workload_roofline(LLAMA, seq, 1e15, 3e12)
    assert two.bytes == pytest.approx(2 * roof.bytes)
    assert workload_roofline(LLAMA, batched, 1e15, 3e12).bytes < two.bytes  # weights read once


def test_bench_ratio_after_run_uses_the_second_ceilings():
    """`bench`'s JSON: the roofline ratio uses the ceilings measured before the run; the
    after-run ratio (context) uses the second measurement, so a GPU whose matmul ceiling fell
    by a quarter while it ran reads a ratio 4/3 as high against it."""
    from phloem.entrypoints.bench import roofline_fields

    w = Workload("w", "t", [[1] * 100, [1] * 100], [10, 10], [(96, [0, 1])])
    before = {"flops_per_s": 800e12, "bytes_per_s": 1e18}  # compute-bound
    after = {"flops_per_s": 600e12, "bytes_per_s": 1e18}
    r = roofline_fields(LLAMA, w, before, after, elapsed_s=1.0, total_tokens=220)
    flops, nbytes = batch_work(LLAMA, [(96, [(100, 10), (100, 10)])])
    bound = max(flops / 800e12, nbytes / 1e18)
    assert r["roofline_ratio"] == pytest.approx(bound)
    assert r["bound_total_tokens_per_s"] == pytest.approx(220 / bound)
    assert r["ceilings_after_run"] is after
    bound_after = max(flops / 600e12, nbytes / 1e18)
    assert r["roofline_ratio_after_run_ceilings"] == pytest.approx(bound_after)
    assert bound_after == pytest.approx(bound * 4 / 3)
