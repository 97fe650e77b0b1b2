"""SiLU-and-mul fused into the skinny down GEMM vs the two kernels apart (issues 19 and 24; GPU).

A decode layer runs `silu_and_mul` (one small kernel, 1-3 us with its gap) between gate_up and
down; `phloem.ops.skinny_gated` folds it into the down projection's skinny GEMM, which then
computes silu(gate) * up while loading x (recomputing it in every program along N). For
Llama-3.1-8B's down projection (14336 -> 4096) and its TP=2 half (7168 -> 4096), bf16, at each
rows count, this times, each captured in a CUDA graph (as a decode step replays it) over enough
copies of W to stream from HBM (as benchmarks/skinny_gemm.py):

  silu        the standalone SiLU-and-mul kernel alone (what the fusion removes)
  apart       silu_and_mul, then the engine's down GEMM (the skinny kernel with `config_for`)
  fused       `skinny_gated.silu_and_mul_linear` with its `config_for` (the engine's launch
              where `skinny_gated.fuses` the rows: column "engine")
  fused-best  the fastest fused config of benchmarks/skinny_gemm.py's grid (--no-grid: skipped)

and prints us per call, fused / apart (< 1: the fusion is faster), the activations each fused
config recomputes per weight element (`skinny_gated.silu_per_weight`), and a
`skinny_gated.CONFIGS` table (None where apart was faster). Every fused result is checked against apart within bf16
tolerance (an assertion). The variants are compiled first, in parallel processes.

    python benchmarks/skinny_gated.py [--rows 1 2 4 8 16] [--shapes down down/2] [--no-grid]
        [--json OUT.json]    (GPU, ~1-2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.skinny_gemm import candidate_configs, per_gemm_us  # noqa: E402
from phloem.ops import skinny_gated  # noqa: E402
from phloem.ops import skinny_gemm as sk  # noqa: E402
from phloem.ops.activation import silu_and_mul  # noqa: E402

SHAPES = (("down", 4096, 14336), ("down/2", 4096, 7168))  # (name, N, K)


def launches(rows_list: list[int], shapes: list[str], grid: bool) -> None:
    """Every kernel launch the timed run makes, on CPU tensors laid out as its own (for the
    compile-only driver): SiLU-and-mul, the down GEMM, the fused kernel (and its grid)."""
    for name, n, k in SHAPES:
        if name not in shapes:
            continue
        w = torch.empty(n, k, dtype=torch.bfloat16)
        for rows in rows_list:
            gate_up = torch.empty(rows, 2 * k, dtype=torch.bfloat16)
            sk.skinny_linear(silu_and_mul(gate_up), w)
            for config in fused_configs(rows, n, k, grid):
                skinny_gated.silu_and_mul_linear(gate_up, w, None, config)


def fused_configs(rows: int, n: int, k: int, grid: bool) -> list[sk.SkinnyConfig]:
    """The engine's fused config first, then (grid) the rest of skinny_gemm.py's grid."""
    default = skinny_gated.config_for(rows, n, k)
    rest = [c for c in candidate_configs(rows, n, k) if c != default] if grid else []
    return [default] + rest


def compile_variants(args) -> None:
    """Compile every variant the run launches, `args.jobs` processes at a time, into Triton's
    cache (a child process: recording takes over its Triton driver)."""
    request = {"arch": list(torch.cuda.get_device_capability()), "rows": args.rows,
               "shapes": args.shapes, "grid": args.grid, "jobs": args.jobs}  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--compile-only"], text=True,
                          input=json.dumps(request), capture_output=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"compiling the variants failed:\n{done.stderr[-4000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"compiled {summary['variants']} variants ({summary['errors']} errors) in "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip


def compile_only(request: dict) -> dict:
    """The child of `compile_variants`: record `launches`, then compile them."""
    from phloem.worker.triton_variants import compile_all, cuda_target, record_variants

    target = cuda_target(tuple(request["arch"]))
    variants = record_variants(
        lambda: launches(request["rows"], request["shapes"], request["grid"]), target
    )
    reports = compile_all(variants, request["jobs"])
    errors = [r for r in reports if "error" in r]
    for r in errors[:5]:
        print(r, file=sys.stderr)
    return {"variants": len(variants), "errors": len(errors)}


def time_case(rows: int, n: int, k: int, weights: list[torch.Tensor], args) -> dict:
    """Times [us] of silu, apart, fused and the best fused config for one rows count."""
    gate_up = torch.randn(rows, 2 * k, device="cuda").mul_(2).to(torch.bfloat16)
    want = sk.skinny_linear(silu_and_mul(gate_up), weights[0])
    case = {
        "rows": rows,
        "silu": per_gemm_us(lambda w: silu_and_mul(gate_up), weights, args.iters),
        "apart": per_gemm_us(
            lambda w: sk.skinny_linear(silu_and_mul(gate_up), w), weights, args.iters
        ),
    }
    timed = []
    for config in fused_configs(rows, n, k, args.grid):
        got = skinny_gated.silu_and_mul_linear(gate_up, weights[0], None, config)
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
        fn = lambda w, c=config: skinny_gated.silu_and_mul_linear(gate_up, w, None, c)  # noqa: E731
        timed.append((per_gemm_us(fn, weights, args.iters), config))
    case["fused"] = timed[0][0]
    case["fused-best"], best = min(timed, key=lambda t: t[0])
    case["best_config"] = vars(best)
    case["engine"] = "fused" if skinny_gated.fuses(rows, n, k) else "apart"
    case["silu_per_weight"] = [skinny_gated.silu_per_weight(timed[0][1], rows),
                               skinny_gated.silu_per_weight(best, rows)]  # fmt: skip
    return case


def report(name: str, n: int, k: int, cases: list[dict]) -> None:
    """One table per shape: us per call, fused / apart, the best fused config."""
    print(f"\n{name}: {k} -> {n} ({n * k * 2 / 1e6:.0f} MB of weights), us per call")
    print(f"{'M':>3} {'engine':>6} {'silu':>6} {'apart':>7} {'fused':>7} {'ratio':>6} "
          f"{'best':>7} {'ratio':>6}  silu/w  best fused config")  # fmt: skip
    for c in cases:
        b = c["best_config"]
        print(
            f"{c['rows']:>3} {c['engine']:>6} {c['silu']:6.1f} {c['apart']:7.1f} "
            f"{c['fused']:7.1f} {c['fused'] / c['apart']:6.3f} {c['fused-best']:7.1f} "
            f"{c['fused-best'] / c['apart']:6.3f}  {c['silu_per_weight'][0]:.2f}/"
            f"{c['silu_per_weight'][1]:.2f}  n{b['block_n']} k{b['block_k']} s{b['split_k']} "
            f"w{b['num_warps']} st{b['num_stages']} tc={b['tensor_cores']}"
        )


def report_configs(results: list[dict]) -> None:
    """The `skinny_gated.CONFIGS` table the run measured (paste into phloem/ops/skinny_gated.py;
    only rows buckets the run timed, keyed by bucket)."""
    print("\nCONFIGS = {  # None: SiLU-and-mul and the GEMM apart were faster")
    for s in results:
        for c in s["cases"]:
            key = f"({sk.rows_bucket(c['rows'])}, {s['n']}, {s['k']})"
            speed = f"apart {c['apart']:.1f} us, fused {c['fused-best']:.1f} us"
            if c["fused-best"] < c["apart"]:
                cfg = ", ".join(f"{k}={v}" for k, v in c["best_config"].items())
                print(f"    {key}: SkinnyConfig({cfg}),  # {speed}")
            else:
                print(f"    {key}: None,  # {speed}")
    print("}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES],
                   choices=[s[0] for s in SHAPES])  # fmt: skip
    p.add_argument("--no-grid", dest="grid", action="store_false",
                   help="time the engine's fused config only")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="graph replays timed per candidate")
    p.add_argument("--stream-mb", type=int, default=400, help="weight bytes per graph [MB]")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compile_only:
        print(json.dumps(compile_only(json.loads(sys.stdin.read()))))
        return
    start = time.perf_counter()
    compile_variants(args)
    results = []
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        copies = max(2, -(-args.stream_mb * 10**6 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda").div_(k**0.5).to(torch.bfloat16)
                   for _ in range(copies)]  # fmt: skip
        cases = [time_case(rows, n, k, weights, args) for rows in args.rows]
        del weights
        report(name, n, k, cases)
        results.append({"name": name, "n": n, "k": k, "cases": cases})
    report_configs(results)
    print(f"\n{torch.cuda.get_device_name()}: {time.perf_counter() - start:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()
