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


def test_bench_sustained_ratio_uses_the_sustained_ceilings():
    """`bench`'s JSON: `roofline_ratio` uses the burst ceilings measured before the run;
    `roofline_ratio_sustained` the sustained ones measured after it, so a GPU whose matmul
    ceiling fell by a quarter under sustained load reads a ratio 4/3 as high against it."""
    from phloem.bench.report import roofline_fields

    w = Workload("w", "t", [[1] * 100, [1] * 100], [10, 10], [(96, [0, 1])])
    burst = {"flops_per_s": 800e12, "bytes_per_s": 1e18}  # compute-bound
    sustained = {"flops_per_s": 600e12, "bytes_per_s": 1e18}
    r = roofline_fields(LLAMA, w, burst, sustained, elapsed_s=1.0, total_tokens=220)
    flops, nbytes = batch_work(LLAMA, [(96, [(100, 10), (100, 10)])])
    bound = max(flops / 800e12, nbytes / 1e18)
    assert r["roofline_ratio"] == pytest.approx(bound)
    assert r["bound_total_tokens_per_s"] == pytest.approx(220 / bound)
    assert r["ceilings_sustained"] is sustained
    bound_sustained = max(flops / 600e12, nbytes / 1e18)
    assert r["roofline_ratio_sustained"] == pytest.approx(bound_sustained)
    assert bound_sustained == pytest.approx(bound * 4 / 3)


def test_sustained_time_is_the_median_of_the_second_half():
    """A board that starts at full clock and throttles: the sustained time per call is the
    median over the second half of the calls, and calls continue until min_s is covered."""
    from phloem.bench.roofline import sustained_time_s

    durations = iter([0.1] * 10 + [0.2] * 6 + [0.3, 0.25, 0.2, 0.25])
    calls = []

    def time_calls(fn, k):
        calls.append(k)
        return [next(durations) for _ in range(k)]

    t = sustained_time_s(lambda: None, min_s=3.0, chunk=4, time_calls=time_calls)
    # 20 calls cover 1.0 + 1.2 + 1.0 = 3.2 s >= 3.0 s; the second half is the last 10 calls.
    assert len(calls) == 5
    assert t == pytest.approx(0.2)  # last 10 sorted: 0.2 x7, 0.25, 0.25, 0.3 -> upper median 0.2
    with pytest.raises(ValueError, match="min_s"):
        sustained_time_s(lambda: None, min_s=0, time_calls=time_calls)


def test_ceilings_from_the_timers():
    """FLOP/s of the n^3 matmul and bytes/s (read + written) of the copy, each from its timer,
    on tensors of the requested sizes."""
    from phloem.bench.roofline import _ceilings

    seen = []

    def timer(seconds):
        def time_s(fn):
            seen.append(fn())
            return seconds

        return time_s

    c = _ceilings(timer(0.5), timer(0.25), "cpu", matmul_n=64, copy_bytes=1024)
    assert c["flops_per_s"] == pytest.approx(2 * 64**3 / 0.5)
    assert c["bytes_per_s"] == pytest.approx(2 * 1024 / 0.25)
    assert seen[0].shape == (64, 64) and seen[1].numel() * seen[1].element_size() == 1024
