"""Decode-sized GEMMs against the copy ceiling: cuBLAS (two ways) vs phloem's skinny-GEMM kernel.

Issue 19 (latency): at batch 1 an 8B model's decode step is the time to read its weights, and
cuBLAS, as torch's `F.linear` picks it, reads the small Llama-3.1-8B matrices at 2.6-3.2 TB/s of
~4.2 (benchmarks/results/2026-11-26d-h200-checks/README.md). For each linear layer shape of
Llama-3.1-8B (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and their
TP=2 halves, bf16, and each number of rows M, this times

  F.linear        what the engine runs today (cuBLAS; its split-K reduce kernel included)
  matmul          torch.matmul(W, x.T).T: the same product asked the other way round (another
                  cuBLAS heuristic; the result is a transposed view)
  skinny-default  `phloem.ops.skinny_gemm.skinny_linear` with the config `config_for` gives
  skinny-best     the fastest of a grid of configs (block_n, block_k, split_k, warps, stages)

each captured in a CUDA graph (as a decode step replays it) and timed with CUDA events. L2 (50
MB on an H100/H200) would hold a small weight across replays, which a decode step never lets it
do (15 GB of other weights stream through between two uses), so each graph runs the GEMM over
enough copies of W (>= --stream-mb in all) to stream from HBM; the time is per GEMM. TB/s
counts the weight bytes only; the ceiling is ROOFLINE.md's copy bandwidth
(`phloem.bench.roofline.measure_ceilings`), measured in the same run. Every result is checked
against F.linear within bf16 tolerance (an assertion). The kernel variants are compiled first, in
parallel processes (`phloem.worker.triton_variants`). Prints one table per shape, the per-step
saving of the best kernel at TP=1 and a `CONFIGS` table for phloem/ops/skinny_gemm.py.

    python benchmarks/skinny_gemm.py [--rows 1 2 4 8 16] [--json OUT.json]
        [--configs-out CONFIGS.json]    (GPU, <= 2 min; PHLOEM_SKINNY_GEMM_CONFIGS=CONFIGS.json
        then runs the engine with the measured table)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from phloem.bench.graph_timing import graph_replay_seconds
from phloem.bench.triton_compile import compile_in_child, compile_recorded
from phloem.ops.skinny_gemm import (
    DOT_MIN_ROWS,
    SkinnyConfig,
    config_for,
    rows_bucket,
    skinny_linear,
)

# (name, N, K): Llama-3.1-8B's linear layers (out, in), then each one's TP=2 shard.
SHAPES = (
    ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
    ("qkv/2", 3072, 4096), ("o/2", 4096, 2048), ("gate_up/2", 14336, 4096), ("down/2", 4096, 7168),
)  # fmt: skip
LAYERS = 32  # Llama-3.1-8B's decoder layers, for the per-step estimate


def candidate_configs(rows: int, n: int, k: int) -> list[SkinnyConfig]:
    """The grid tried for a shape, the default config first: tiles of 4-32 KB of W per loop
    step (4 warps up to 8 KB, else 8), split_k 1/2/4 up to ~16 programs per SM; the tensor-core
    product (x padded to 16 rows; 2 or 4 stages) at every rows count, the CUDA-core one below
    DOT_MIN_ROWS rows with the tiles whose fp32 accumulators take <= 64 registers a thread."""
    configs = []
    for tensor_cores in (False, True) if rows < DOT_MIN_ROWS else (True,):
        for block_n in (4, 8, 16, 32, 64):
            for block_k in (128, 256, 512, 1024):
                kb = block_n * block_k * 2 // 1024
                warps = 4 if kb <= 8 else 8
                if not 4 <= kb <= 32 or (tensor_cores and block_n < 16):
                    continue
                if not tensor_cores and rows_bucket(rows) * block_n * block_k > 64 * 32 * warps:
                    continue
                for split_k in (1, 2, 4):
                    too_many = -(-n // block_n) * split_k > 2048
                    if split_k > 1 and (too_many or k < 2 * split_k * block_k):
                        continue
                    configs += [
                        SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k,
                                     num_warps=warps, num_stages=stages,
                                     tensor_cores=None if tensor_cores == (rows >= DOT_MIN_ROWS)
                                     else tensor_cores)
                        for stages in ((2, 4) if tensor_cores else (1,))
                    ]  # fmt: skip
    default = config_for(rows, n, k)
    return [default] + [c for c in configs if c != default]


def compile_all_variants(rows_list: list[int], jobs: int) -> None:
    """Compile every variant the run launches, `jobs` processes at a time, into Triton's cache
    (`phloem.bench.triton_compile`: a child process of this script)."""
    arch = torch.cuda.get_device_capability()
    compile_in_child(__file__, {"arch": list(arch), "rows": rows_list, "jobs": jobs})


def compile_only(request: dict) -> dict:
    """The child of `compile_all_variants`: record the launches of every (rows, shape, config)
    on CPU tensors laid out as the GPU run's (same specialization), then compile them."""

    def launch() -> None:
        for rows in request["rows"]:
            for _, n, k in SHAPES:
                x = torch.empty(rows, k, dtype=torch.bfloat16)
                w = torch.empty(64, k, dtype=torch.bfloat16)  # N only sets the grid
                for config in candidate_configs(rows, n, k):
                    skinny_linear(x, w, None, config)

    return compile_recorded(launch, request)


def per_gemm_us(fn_of_weight, weights: list[torch.Tensor], iters: int) -> float:
    """Microseconds per GEMM of a CUDA graph that runs `fn_of_weight(w)` for every copy of W."""
    seconds = graph_replay_seconds(lambda: [fn_of_weight(w) for w in weights], iters)
    return seconds * 1e6 / len(weights)


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Assert `got` equals F.linear's `want` within bf16 tolerance."""
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    except AssertionError as e:
        raise AssertionError(f"{name} differs from F.linear: {e}") from None


def time_case(rows: int, n: int, k: int, weights: list[torch.Tensor], args) -> dict:
    """Times [us] of every candidate for x [rows, k] against W [n, k]; the best config."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, weights[0])
    check("matmul", torch.matmul(weights[0], x.T).T, want)
    case = {
        "rows": rows,
        "F.linear": per_gemm_us(lambda w: F.linear(x, w), weights, args.iters),
        "matmul": per_gemm_us(lambda w: torch.matmul(w, x.T).T, weights, args.iters),
    }
    configs = candidate_configs(rows, n, k)
    if args.max_configs:
        configs = configs[: args.max_configs]
    if time.perf_counter() > args.deadline:  # past --time-limit: the default config only
        configs = configs[:1]
    timed = []
    for config in configs:
        check(f"skinny {config}", skinny_linear(x, weights[0], None, config), want)
        fn = lambda w, c=config: skinny_linear(x, w, None, c)  # noqa: E731
        timed.append((per_gemm_us(fn, weights, args.iters), config))
    case["skinny-default"] = timed[0][0]
    best_us, best = min(timed, key=lambda t: t[0])
    case["skinny-best"] = best_us
    case["best_config"] = vars(best)
    return case


def report_shape(name: str, n: int, k: int, cases: list[dict], ceiling: float) -> None:
    """One table: us and TB/s (fraction of the copy ceiling) of each candidate per rows."""
    nbytes = n * k * 2
    kinds = ("F.linear", "matmul", "skinny-default", "skinny-best")
    print(f"\n{name}: {k} -> {n}, {nbytes / 1e6:.0f} MB of weights "
          f"(copy ceiling {ceiling / 1e12:.2f} TB/s: {nbytes / ceiling * 1e6:.1f} us)")  # fmt: skip
    print(f"{'M':>3} " + " ".join(f"{kind:>24}" for kind in kinds) + "  best config")
    for c in cases:
        cells = [f"{c[kind]:6.1f} us {nbytes / c[kind] / 1e6:4.2f} TB/s "
                 f"{nbytes / c[kind] * 1e6 / ceiling:4.2f}" for kind in kinds]  # fmt: skip
        b = c["best_config"]
        print(f"{c['rows']:>3} " + " ".join(f"{cell:>24}" for cell in cells) +
              f"  n{b['block_n']} k{b['block_k']} s{b['split_k']} w{b['num_warps']} "
              f"st{b['num_stages']} tc={b['tensor_cores']}")  # fmt: skip


def report_summary(results: dict) -> None:
    """The TP=1 decode step's GEMM time per rows (F.linear vs the best kernel per shape, x 32
    layers) and the CONFIGS table of the best configs (paste into phloem/ops/skinny_gemm.py)."""
    print("\nTP=1 step estimate (4 GEMMs x 32 layers, lm_head excluded):")
    tp1 = [s for s in results["shapes"] if "/" not in s["name"]]
    for i, rows in enumerate(results["rows"]):
        base = sum(s["cases"][i]["F.linear"] for s in tp1) * LAYERS
        best = sum(min(s["cases"][i]["F.linear"], s["cases"][i]["skinny-best"])
                   for s in tp1) * LAYERS  # fmt: skip
        print(f"  M={rows:>2}: F.linear {base:7.0f} us, best per shape {best:7.0f} us "
              f"({base - best:+.0f} us saved)")  # fmt: skip
    print("\nCONFIGS = {  # None: F.linear (cuBLAS) was faster")
    print_config_entries(
        (
            f"({c['rows']}, {s['n']}, {s['k']})",
            c["best_config"] if c["skinny-best"] < c["F.linear"] else None,
            f"F.linear {c['F.linear']:.1f} us, kernel {c['skinny-best']:.1f} us",
        )
        for s in results["shapes"]
        for c in s["cases"]
    )
    print("}")


def print_config_entries(entries) -> None:
    """Print `CONFIGS` entries to paste into a table: (key text, the winning config's fields or
    None, the timing comment) each."""
    for key, config, speed in entries:
        if config is None:
            print(f"    {key}: None,  # {speed}")
        else:
            fields = ", ".join(f"{k}={v}" for k, v in config.items())
            print(f"    {key}: SkinnyConfig({fields}),  # {speed}")


def write_configs(results: dict, path: str) -> None:
    """The CONFIGS table as `phloem.ops.skinny_gemm.load_configs` reads it: per shape and rows,
    the best config where the kernel beat F.linear, else null (F.linear)."""
    entries = [{"rows": c["rows"], "n": s["n"], "k": s["k"],
                "config": c["best_config"] if c["skinny-best"] < c["F.linear"] else None}
               for s in results["shapes"] for c in s["cases"]]  # fmt: skip
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)
    print(f"wrote {len(entries)} configs to {path} (PHLOEM_SKINNY_GEMM_CONFIGS={path})")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES],
                   choices=[s[0] for s in SHAPES])  # fmt: skip
    p.add_argument("--iters", type=int, default=10, help="graph replays timed per candidate")
    p.add_argument("--stream-mb", type=int, default=400, help="weight bytes per graph [MB]")
    p.add_argument("--max-configs", type=int, default=0, help="try only the first N configs")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--time-limit", type=float, default=100.0,
                   help="seconds after which cases time only the default config")  # fmt: skip
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json")
    p.add_argument("--configs-out", help="write the CONFIGS table as JSON (for "
                   "PHLOEM_SKINNY_GEMM_CONFIGS; needs every shape)")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compile_only:
        print(json.dumps(compile_only(json.loads(sys.stdin.read()))))
        return
    from phloem.bench.roofline import measure_ceilings

    start = time.perf_counter()
    args.deadline = start + args.time_limit
    compile_all_variants(args.rows, args.jobs)
    ceiling = measure_ceilings()["bytes_per_s"]
    results = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": ceiling,
               "rows": args.rows, "shapes": []}  # fmt: skip
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        copies = max(2, -(-args.stream_mb * 10**6 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda").div_(k**0.5).to(torch.bfloat16)
                   for _ in range(copies)]  # fmt: skip
        cases = [time_case(rows, n, k, weights, args) for rows in args.rows]
        del weights
        report_shape(name, n, k, cases, ceiling)
        results["shapes"].append({"name": name, "n": n, "k": k, "cases": cases})
    if len(results["shapes"]) == len(SHAPES):
        report_summary(results)
        if args.configs_out:
            write_configs(results, args.configs_out)
    late = time.perf_counter() > args.deadline
    note = " (past --time-limit: later cases timed the default config only)" if late else ""
    print(f"\n{time.perf_counter() - start:.0f} s in all{note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
