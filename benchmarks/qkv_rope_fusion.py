"""RoPE + the KV-cache write fused into the QKV projection's skinny GEMM vs the kernels apart,
per decode layer (issues 19 and 24; GPU).

A Llama decode layer runs, between its input norm and attention: the qkv GEMM (with the residual
add + RMSNorm fused into it where `phloem.ops.skinny_norm` fuses the rows, else the norm apart
first), then `phloem.ops.rope_kv` (RoPE on q and k, k and v into the paged cache: ~2.7 us a layer
on the H200 profile). `phloem.ops.skinny_rope` runs the rotation and the cache write as the
GEMM's epilogue (PHLOEM_FUSED_QKV_ROPE=1). For Llama-3.1-8B's qkv (4096 -> 6144: 32 q heads,
8 KV heads of 128) and its TP = 2 shard (4096 -> 3072: 16 and 4), bf16, at each rows count this
times, each in a CUDA graph over enough copies of W to stream from HBM
(benchmarks/skinny_gemm.py's `per_gemm_us`):

  removed     `rope_and_write_kv` alone
  apart       the layer's pre-attention with the switch off: the norm (fused into the skinny
              GEMM where the engine fuses it, else torch.compile's, then the engine's GEMM),
              then `rope_and_write_kv`
  fused       the same with the switch on: one launch (norm, GEMM, RoPE, KV write) where the
              norm fuses, else the norm then the fused GEMM; `skinny_rope.config_for`'s config
  fused-best  the fastest config of benchmarks/skinny_gemm.py's grid that the epilogue takes
              (one split of K; --no-grid: skipped)

and prints us per layer and fused / apart (< 1: the fusion wins; the gap a graph leaves
between two kernels is not in it: the end-to-end A/B is `phloem bench throughput` with
PHLOEM_FUSED_QKV_ROPE=0/1), and the `skinny_rope.CONFIGS` entries to paste (None where apart
was faster). Every fused q and cache row is checked against apart's within bf16
rounding (an assertion). The Triton variants are compiled first, in parallel processes.

    python benchmarks/qkv_rope_fusion.py --device cuda [--rows 1 4 16] [--no-grid]
        [--json OUT.json]    (GPU, ~2 min)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.skinny_gemm import (  # noqa: E402
    candidate_configs,
    per_gemm_us,
    print_config_entries,
)
from phloem.bench.triton_compile import compile_in_child, compile_recorded  # noqa: E402
from phloem.ops import skinny_gemm as sk  # noqa: E402
from phloem.ops import skinny_norm, skinny_rope  # noqa: E402
from phloem.ops.rope_kv import rope_and_write_kv  # noqa: E402

SHAPES = (("qkv", 32, 8), ("qkv/2", 16, 4))  # (name, q heads, KV heads) of this rank
HEAD_DIM, HIDDEN, EPS, BLOCK = 128, 4096, 1e-5, 16


def norm_fuses(rows: int, n: int) -> bool:
    """Whether the engine fuses the input norm into qkv's GEMM at `rows` rows (by default)."""
    return skinny_norm.fuses(rows, n, HIDDEN) and sk.runs_shape(rows, n, HIDDEN, True)


def configs(rows: int, n: int, grid: bool) -> list[sk.SkinnyConfig]:
    """The engine's fused config first, then (grid) the grid's others that the epilogue takes."""
    norm = norm_fuses(rows, n)
    default = skinny_rope.config_for(rows, n, HIDDEN, norm)
    rest = [c for c in candidate_configs(rows, n, HIDDEN) if c != default] if grid else []
    return [default] + [c for c in rest if skinny_rope.config_fits(c, rows, norm)]


def step(rows: int, heads: int, kv_heads: int, device: str, norm=None):
    """(removed(), apart(w), fused(w, config)) of one layer's pre-attention on fresh inputs:
    hidden and residual [rows, 4096], random positions < 8192, distinct random slots of a
    512-block bf16 cache; norm: (the RMSNorm module, its compiled `compute`), None: eager."""
    from phloem.layers.rotary import RotaryEmbedding
    from phloem.ops.kv_store import allocate_kv_cache

    x, r = (torch.randn(rows, HIDDEN, device=device).to(torch.bfloat16) for _ in range(2))
    module, compute = norm or (make_norm(device), None)
    norm_fn = (lambda: compute(module, x, r)) if compute else (lambda: module(x, r))
    rope_params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}  # fmt: skip
    rot = RotaryEmbedding(HEAD_DIM, HEAD_DIM, 8192, rope_params).to(device)
    cache = allocate_kv_cache(512, BLOCK, kv_heads, HEAD_DIM, torch.bfloat16, device, "NHD")
    positions = torch.randint(0, 8192, (rows,), device=device)
    slots = torch.randperm(512 * BLOCK, device=device)[:rows]
    rope = skinny_rope.RopeKv(positions, rot.cos, rot.sin, cache, slots, 1.0, 1.0, heads,
                              kv_heads, HEAD_DIM)  # fmt: skip
    n = (heads + 2 * kv_heads) * HEAD_DIM
    fused_norm = norm_fuses(rows, n)

    def rope_kv(qkv):
        q, k, v = (t.view(rows, -1, HEAD_DIM) for t in qkv.split(
            [heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], -1))  # fmt: skip
        return rope_and_write_kv(positions, q, k, v, rot.cos, rot.sin, cache, slots)

    def apart(w):
        if fused_norm:
            return rope_kv(skinny_norm.rms_norm_linear(x, r, module.weight, EPS, w)[0])
        h = norm_fn()[0]
        return rope_kv(sk.skinny_linear(h, w) if sk.runs_shape(rows, n, HIDDEN, True)
                       else torch.nn.functional.linear(h, w))  # fmt: skip

    def fused(w, config):
        if fused_norm:
            args = sk.NormArgs(r, module.weight, EPS, torch.empty_like(x))
            return skinny_rope.qkv_rope_kv(x, w, None, rope, args, config)
        return skinny_rope.qkv_rope_kv(norm_fn()[0], w, None, rope, None, config)

    fixed = torch.randn(rows, n, device=device).to(torch.bfloat16)
    return (lambda: rope_kv(fixed)), apart, fused, cache, slots


def make_norm(device: str):
    """An RMSNorm of width 4096, weight 1 + N(0, 0.1^2), on `device`."""
    from phloem.layers.norm import RMSNorm

    norm = RMSNorm(HIDDEN, EPS, torch.bfloat16).to(device)
    norm.weight.data = (1 + 0.1 * torch.randn(HIDDEN, device=device)).to(torch.bfloat16)
    return norm


def launches(request: dict) -> None:
    """Every Triton launch the timed run makes, on CPU tensors laid out as its own (for the
    compile-only driver): `rope_and_write_kv`, the engine's GEMMs, the fused kernel's configs.
    The compiled norm is inductor's, not recorded here."""
    for _, heads, kv_heads in SHAPES:
        n = (heads + 2 * kv_heads) * HEAD_DIM
        w = torch.empty(n, HIDDEN, dtype=torch.bfloat16)
        for rows in request["rows"]:
            removed, apart, fused, _, _ = step(rows, heads, kv_heads, "cpu")
            removed()
            apart(w)
            for config in configs(rows, n, request["grid"]):
                fused(w, config)


def compile_variants(args) -> None:
    """Compile every variant the run launches, `args.jobs` processes at a time, into Triton's
    cache (`phloem.bench.triton_compile`: a child process of this script)."""
    request = {"arch": list(torch.cuda.get_device_capability()), "rows": args.rows,
               "grid": args.grid, "jobs": args.jobs}  # fmt: skip
    compile_in_child(__file__, request)


def compile_only(request: dict) -> dict:
    """The child of `compile_variants`: record `launches`, then compile them."""
    return compile_recorded(lambda: launches(request), request)


def check(got, want, cache, want_cache, slots) -> None:
    """The fused q and the cache rows at `slots` equal apart's within bf16 rounding (the GEMM's
    configs may differ: its sums then round differently)."""
    tol = dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    blocks, offs = slots // BLOCK, slots % BLOCK
    torch.testing.assert_close(cache[blocks, :, offs].float(), want_cache[blocks, :, offs].float(),
                               **tol)  # fmt: skip


def time_case(rows: int, heads: int, kv_heads: int, weights: list, args) -> dict:
    """Times [us] of removed, apart, fused and the best fused config for one rows count."""
    n = weights[0].shape[0]
    removed, apart, fused, cache, slots = step(rows, heads, kv_heads, "cuda", args.norm)
    want = apart(weights[0])
    want_cache = cache.clone()
    case = {
        "rows": rows,
        "norm": "fused" if norm_fuses(rows, n) else "apart",
        "engine": "fused" if sk.runs_shape(rows, n, HIDDEN, True) else "apart",
        "removed": per_gemm_us(lambda w: removed(), weights, args.iters),
        "apart": per_gemm_us(apart, weights, args.iters),
    }
    timed = []
    for config in configs(rows, n, args.grid):
        try:
            check(fused(weights[0], config), want, cache, want_cache, slots)
        except OutOfResources:  # a grid config whose staged tiles overflow shared memory
            continue
        timed.append((per_gemm_us(lambda w, c=config: fused(w, c), weights, args.iters), config))
    default = configs(rows, n, False)[0]
    case["fused"] = timed[0][0] if timed[0][1] == default else float("nan")  # nan: overflowed
    case["fused-best"], best = min(timed, key=lambda t: t[0])
    case["best_config"] = vars(best)
    return case


def report(name: str, n: int, cases: list[dict]) -> None:
    """One table per shape: us per layer, fused / apart, the best fused config."""
    print(f"\nRoPE + KV write into {name}: {HIDDEN} -> {n} ({n * HIDDEN * 2 / 1e6:.0f} MB of "
          "weights), us per layer")  # fmt: skip
    print(f"{'M':>3} {'norm':>5} {'engine':>6} {'removed':>7} {'apart':>7} {'fused':>7} "
          f"{'ratio':>6} {'best':>7} {'ratio':>6}  best fused config")  # fmt: skip
    for c in cases:
        b = c["best_config"]
        print(
            f"{c['rows']:>3} {c['norm']:>5} {c['engine']:>6} {c['removed']:7.1f} "
            f"{c['apart']:7.1f} {c['fused']:7.1f} {c['fused'] / c['apart']:6.3f} "
            f"{c['fused-best']:7.1f} {c['fused-best'] / c['apart']:6.3f}  n{b['block_n']} "
            f"k{b['block_k']} w{b['num_warps']} st{b['num_stages']} tc={b['tensor_cores']}"
        )


def report_configs(results: list[dict]) -> None:
    """The `skinny_rope.CONFIGS` entries the run measured (paste into it; only the rows
    buckets the run timed): the best fused config where it beat apart, else None."""
    print("\nskinny_rope.CONFIGS = {  # None: the kernels apart were faster")
    print_config_entries(
        (
            f"({sk.rows_bucket(c['rows'])}, {s['n']}, {s['k']}, {c['norm'] == 'fused'})",
            c["best_config"] if c["fused-best"] < c["apart"] else None,
            f"apart {c['apart']:.1f} us, fused {c['fused-best']:.1f} us",
        )
        for s in results
        for c in s["cases"]
    )
    print("}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda"], help="GPU only")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--no-grid", dest="grid", action="store_false",
                   help="time the engine's fused config only")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="graph replays timed per candidate")
    p.add_argument("--stream-mb", type=int, default=400, help="weight bytes per graph [MB]")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json")
    return p.parse_args(argv)


@functools.cache
def compiled_norm():
    """(an RMSNorm of width 4096 on the GPU, `RMSNorm.compute` through torch.compile): the
    engine's norm (worker/fusion.py's way)."""
    from phloem.layers.norm import RMSNorm

    return make_norm("cuda"), torch.compile(RMSNorm.compute, dynamic=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compile_only:
        print(json.dumps(compile_only(json.loads(sys.stdin.read()))))
        return
    start = time.perf_counter()
    compile_variants(args)
    args.norm = compiled_norm()
    results = []
    for name, heads, kv_heads in SHAPES:
        n = (heads + 2 * kv_heads) * HEAD_DIM
        copies = max(2, -(-args.stream_mb * 10**6 // (n * HIDDEN * 2)))
        weights = [torch.randn(n, HIDDEN, device="cuda").div_(HIDDEN**0.5).to(torch.bfloat16)
                   for _ in range(copies)]  # fmt: skip
        cases = [time_case(rows, heads, kv_heads, weights, args) for rows in args.rows]
        del weights
        report(name, n, cases)
        results.append({"name": name, "n": n, "k": HIDDEN, "cases": cases})
    report_configs(results)
    print(f"\n{torch.cuda.get_device_name()}: {time.perf_counter() - start:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()
