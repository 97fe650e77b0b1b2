"""The skinny GEMM's fused variants vs their two kernels apart (issues 19 and 24; GPU).

A decode layer of Llama-3.1-8B runs small kernels between its GEMMs (1-3 us each, plus their
gaps). Two of them are folded into the skinny GEMM that reads their output:

  silu  SiLU-and-mul into the down projection (`phloem.ops.skinny_gated`): the kernel computes
        silu(gate) * up while loading x (every program along N recomputes it)
  norm  the residual add + RMSNorm into the qkv and gate_up projections
        (`phloem.ops.skinny_norm`): the kernel adds the residual, multiplies by the norm weight
        and scales each row's sum by its 1 / rms

For each fusion, shape (Llama-3.1-8B's and their TP=2 halves, bf16) and rows count this times,
each captured in a CUDA graph (as a decode step replays it) over enough copies of W to stream
from HBM (as benchmarks/skinny_gemm.py):

  removed     the kernel the fusion removes, alone (`silu_and_mul`; the norm compiled by
              torch.compile as the engine compiles it)
  apart       that kernel, then the engine's GEMM (the skinny kernel where its table has the
              shape, else F.linear)
  fused       the fused launch with its module's `config_for` (the engine's launch where the
              module `fuses` the rows and the table sends the shape to the kernel: "engine")
  fused-best  the fastest fused config of benchmarks/skinny_gemm.py's grid (norm: one split
              of K only; --no-grid: skipped)

and prints us per call, fused / apart (< 1: the fusion is faster; the gap a graph leaves between
two kernels is not in it: the end-to-end A/B is `phloem bench throughput` with
PHLOEM_FUSED_SILU_DOWN / PHLOEM_FUSED_RMSNORM), and each module's `CONFIGS` table (None where
apart was faster). Every fused result is checked against apart within bf16 tolerance (an
assertion). The Triton variants are compiled first, in parallel processes.

    python benchmarks/skinny_fusions.py [--fusions silu norm] [--rows 1 2 4 8 16] [--no-grid]
        [--json OUT.json]    (GPU, ~2-3 min)
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
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.skinny_gemm import (  # noqa: E402
    candidate_configs,
    per_gemm_us,
    print_config_entries,
)
from phloem.bench.triton_compile import compile_in_child, compile_recorded  # noqa: E402
from phloem.ops import skinny_gated, skinny_norm  # noqa: E402
from phloem.ops import skinny_gemm as sk  # noqa: E402
from phloem.ops.activation import silu_and_mul  # noqa: E402

SHAPES = {  # fusion -> (name, N, K) of the projections it fuses into
    "silu": (("down", 4096, 14336), ("down/2", 4096, 7168)),
    "norm": (("qkv", 6144, 4096), ("gate_up", 28672, 4096), ("qkv/2", 3072, 4096),
             ("gate_up/2", 14336, 4096)),
}  # fmt: skip
MODULES = {"silu": skinny_gated, "norm": skinny_norm}
EPS = 1e-5


def fused_configs(fusion: str, rows: int, n: int, k: int, grid: bool) -> list[sk.SkinnyConfig]:
    """The engine's fused config first, then (grid) the rest of skinny_gemm.py's grid (norm:
    those that keep K in one split)."""
    default = MODULES[fusion].config_for(rows, n, k)
    rest = [c for c in candidate_configs(rows, n, k) if c != default] if grid else []
    return [default] + [c for c in rest if fusion == "silu" or c.split_k == 1]


def engine_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The dense GEMM as the engine runs it by default: the skinny kernel for the shapes its table
    measured faster, else F.linear."""
    if sk.runs_shape(x.shape[0], *w.shape, measured_only=True):
        return sk.skinny_linear(x, w)
    return F.linear(x, w)


def calls(fusion: str, rows: int, k: int, device: str, norm=None):
    """(removed(), apart(w), fused(w, config)) on fresh inputs of `rows` rows; norm: (the
    RMSNorm module, its compiled `compute`) for "norm" (None: an eager one of this device)."""
    if fusion == "silu":
        gate_up = torch.randn(rows, 2 * k, device=device).mul_(2).to(torch.bfloat16)
        return (lambda: silu_and_mul(gate_up),
                lambda w: engine_gemm(silu_and_mul(gate_up), w),
                lambda w, c: skinny_gated.silu_and_mul_linear(gate_up, w, None, c))  # fmt: skip
    x, r = (torch.randn(rows, k, device=device).to(torch.bfloat16) for _ in range(2))
    module, compute = norm or (make_norm(k, device), None)
    norm_fn = (lambda x, r: compute(module, x, r)) if compute else module
    nw = module.weight
    return (lambda: norm_fn(x, r),
            lambda w: engine_gemm(norm_fn(x, r)[0], w),
            lambda w, c: skinny_norm.rms_norm_linear(x, r, nw, EPS, w, None, c)[0])  # fmt: skip


def make_norm(k: int, device: str):
    """An RMSNorm of width k, weight 1 + N(0, 0.1^2), on `device`."""
    from phloem.layers.norm import RMSNorm

    norm = RMSNorm(k, EPS, torch.bfloat16).to(device)
    norm.weight.data = (1 + 0.1 * torch.randn(k, device=device)).to(torch.bfloat16)
    return norm


def launches(request: dict) -> None:
    """Every Triton launch the timed run makes, on CPU tensors laid out as its own (for the
    compile-only driver): the removed kernel (SiLU-and-mul), the engine's GEMM, the fused
    kernel (and its grid). The compiled norm is inductor's, not recorded here."""
    for fusion in request["fusions"]:
        for _, n, k in SHAPES[fusion]:
            w = torch.empty(n, k, dtype=torch.bfloat16)
            for rows in request["rows"]:
                removed, apart, fused = calls(fusion, rows, k, "cpu")
                if fusion == "silu":
                    removed()
                if sk.runs_shape(rows, n, k, measured_only=True):
                    apart(w)
                for config in fused_configs(fusion, rows, n, k, request["grid"]):
                    fused(w, config)


def compile_variants(args) -> None:
    """Compile every variant the run launches, `args.jobs` processes at a time, into Triton's
    cache (`phloem.bench.triton_compile`: a child process of this script)."""
    request = {"arch": list(torch.cuda.get_device_capability()), "rows": args.rows,
               "fusions": args.fusions, "grid": args.grid, "jobs": args.jobs}  # fmt: skip
    compile_in_child(__file__, request)


def compile_only(request: dict) -> dict:
    """The child of `compile_variants`: record `launches`, then compile them."""
    return compile_recorded(lambda: launches(request), request)


def time_case(fusion: str, rows: int, n: int, k: int, weights: list[torch.Tensor], args) -> dict:
    """Times [us] of removed, apart, fused and the best fused config for one rows count."""
    removed, apart, fused = calls(fusion, rows, k, "cuda", args.norm)
    want = apart(weights[0])
    case = {
        "rows": rows,
        "removed": per_gemm_us(lambda w: removed(), weights, args.iters),
        "apart": per_gemm_us(apart, weights, args.iters),
        "engine": "fused" if MODULES[fusion].fuses(rows, n, k)
        and sk.runs_shape(rows, n, k, measured_only=True) else "apart",
    }  # fmt: skip
    timed = []
    for config in fused_configs(fusion, rows, n, k, args.grid):
        try:
            got = fused(weights[0], config)
        except OutOfResources:  # a grid config whose staged tiles overflow shared memory
            continue
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2e-2)
        timed.append((per_gemm_us(lambda w, c=config: fused(w, c), weights, args.iters), config))
    default = MODULES[fusion].config_for(rows, n, k)
    case["fused"] = timed[0][0] if timed[0][1] == default else float("nan")  # nan: it overflowed
    case["fused-best"], best = min(timed, key=lambda t: t[0])
    case["best_config"] = vars(best)
    return case


def report(fusion: str, name: str, n: int, k: int, cases: list[dict]) -> None:
    """One table per shape: us per call, fused / apart, the best fused config."""
    print(f"\n{fusion} into {name}: {k} -> {n} ({n * k * 2 / 1e6:.0f} MB of weights), us per call")
    print(f"{'M':>3} {'engine':>6} {'removed':>7} {'apart':>7} {'fused':>7} {'ratio':>6} "
          f"{'best':>7} {'ratio':>6}  best fused config")  # fmt: skip
    for c in cases:
        b = c["best_config"]
        print(
            f"{c['rows']:>3} {c['engine']:>6} {c['removed']:7.1f} {c['apart']:7.1f} "
            f"{c['fused']:7.1f} {c['fused'] / c['apart']:6.3f} {c['fused-best']:7.1f} "
            f"{c['fused-best'] / c['apart']:6.3f}  n{b['block_n']} k{b['block_k']} "
            f"s{b['split_k']} w{b['num_warps']} st{b['num_stages']} tc={b['tensor_cores']}"
        )


def report_configs(fusion: str, results: list[dict]) -> None:
    """The `CONFIGS` table of the fusion's module the run measured (paste into it; only the rows
    buckets the run timed, keyed by bucket)."""
    print(f"\n{MODULES[fusion].__name__}.CONFIGS = {{  # None: the two kernels apart were faster")
    print_config_entries(
        (
            f"({sk.rows_bucket(c['rows'])}, {s['n']}, {s['k']})",
            c["best_config"] if c["fused-best"] < c["apart"] else None,
            f"apart {c['apart']:.1f} us, fused {c['fused-best']:.1f} us",
        )
        for s in results
        for c in s["cases"]
    )
    print("}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fusions", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--no-grid", dest="grid", action="store_false",
                   help="time the engine's fused config only")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="graph replays timed per candidate")
    p.add_argument("--stream-mb", type=int, default=400, help="weight bytes per graph [MB]")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json")
    return p.parse_args(argv)


@functools.cache
def compiled_norm(k: int):
    """(an RMSNorm of width k on the GPU, `RMSNorm.compute` through torch.compile): the engine's
    norm (worker/fusion.py's way)."""
    from phloem.layers.norm import RMSNorm

    return make_norm(k, "cuda"), torch.compile(RMSNorm.compute, dynamic=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compile_only:
        print(json.dumps(compile_only(json.loads(sys.stdin.read()))))
        return
    start = time.perf_counter()
    compile_variants(args)
    results: dict[str, list] = {}
    for fusion in args.fusions:
        results[fusion] = []
        for name, n, k in SHAPES[fusion]:
            args.norm = compiled_norm(k) if fusion == "norm" else None
            copies = max(2, -(-args.stream_mb * 10**6 // (n * k * 2)))
            weights = [torch.randn(n, k, device="cuda").div_(k**0.5).to(torch.bfloat16)
                       for _ in range(copies)]  # fmt: skip
            cases = [time_case(fusion, rows, n, k, weights, args) for rows in args.rows]
            del weights
            report(fusion, name, n, k, cases)
            results[fusion].append({"name": name, "n": n, "k": k, "cases": cases})
        report_configs(fusion, results[fusion])
    print(f"\n{torch.cuda.get_device_name()}: {time.perf_counter() - start:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "fusions": results}, f, indent=1)


if __name__ == "__main__":
    main()
