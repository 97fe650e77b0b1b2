"""`phloem bench plan-scaling`: the data-parallel scaling model on the CPU: cluster-wide prompt
reuse, planned imbalance and makespan of a workload over N replicas, phloem's prefix-aware
routing vs contiguous slicing vs random routing (`phloem.bench.plan_scaling`).

    phloem bench plan-scaling --workload batchllm --replicas 8,64,512 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

# nominal ceilings of an H100 SXM (dense bf16 FLOP/s, HBM3 bytes/s): only ratios matter here
DEFAULT_FLOPS_PER_S = 989e12
DEFAULT_BYTES_PER_S = 3.35e12


def register_plan_scaling(bench_subparsers) -> None:
    """Add `plan-scaling` under `phloem bench` (called from bench.py's register)."""
    from phloem.bench.workloads import WORKLOADS

    p = bench_subparsers.add_parser(
        "plan-scaling", help="cluster-wide prefix reuse and imbalance over N replicas (CPU)"
    )
    p.add_argument("--model", default="llama-3.1-8b", help="a shipped config name or a config dir")
    p.add_argument("--workload", default="batchllm", choices=list(WORKLOADS))
    p.add_argument("--num-groups", type=int, default=None, help="prefix groups (batchllm, ...)")
    p.add_argument("--num-requests", type=int, default=None, help="scale a workload down")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--replicas", default="8,64,512", help="comma-separated replica counts")
    p.add_argument("--block-size", type=int, default=16, help="KV block size [tokens]")
    p.add_argument("--flops-per-s", type=float, default=DEFAULT_FLOPS_PER_S)
    p.add_argument("--bytes-per-s", type=float, default=DEFAULT_BYTES_PER_S)
    p.add_argument("--seed", type=int, default=0, help="random routing's seed")
    p.add_argument("--json", default=None, help="write the result object to this path")
    p.set_defaults(func=run_plan_scaling)


def _replica_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--replicas must be comma-separated integers >= 1, got {text!r}")
    return counts


def _shape(model: str):
    """The roofline shape of a shipped config name or a directory holding config.json."""
    import os
    import types

    from phloem.bench.roofline import ModelShape
    from phloem.model_configs import model_config_dir

    directory = model_config_dir(model) or model
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"--model {model!r} is neither a shipped config nor a dir with config.json"
        )
    with open(path, encoding="utf-8") as f:
        return ModelShape.from_hf(types.SimpleNamespace(**json.load(f)))


def run_plan_scaling(args: argparse.Namespace) -> int:
    """Print the table (and write --json); exit 2 on a bad argument."""
    from phloem.bench.plan_scaling import format_table, scaling_table
    from phloem.bench.workloads import make_workload

    try:
        counts = _replica_counts(args.replicas)
        shape = _shape(args.model)
        workload = make_workload(args.workload, shape.vocab, seed=args.workload_seed,
                                 num_requests=args.num_requests, num_groups=args.num_groups)  # fmt: skip
    except ValueError as e:
        print(f"phloem bench plan-scaling: {e}", file=sys.stderr)
        return 2
    points = scaling_table(workload, shape, counts, block_size=args.block_size,
                           flops_per_s=args.flops_per_s, bytes_per_s=args.bytes_per_s,
                           seed=args.seed)  # fmt: skip
    print(f"{workload.name}: {workload.num_requests} requests, {workload.num_input_tokens} prompt "
          f"tokens; {args.model} roofline times at {args.flops_per_s:.3g} FLOP/s, "
          f"{args.bytes_per_s:.3g} B/s")  # fmt: skip
    print(format_table(points))
    if args.json:
        result = {
            "benchmark": "plan-scaling",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["phloem", *sys.argv[1:]]),
            "model": args.model,
            "workload": {
                "name": workload.name,
                **workload.shape,
                "num_requests": workload.num_requests,
            },  # fmt: skip
            "block_size": args.block_size,
            "flops_per_s": args.flops_per_s,
            "bytes_per_s": args.bytes_per_s,
            "points": points,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0
