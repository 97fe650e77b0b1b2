"""Greedy argmax of a decode step's logits on the GPU: `max(dim=-1)` against `ops.row_max`'s two
stages at several chunk counts, each captured in a CUDA graph (as a step replays it) and timed
with CUDA events; rows x a 128K vocabulary (Llama-3.1-8B's), bf16.

    python benchmarks/row_max.py --rows 1 16 64 --chunks 64 128 256 512 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from phloem.bench.graph_timing import graph_replay_seconds
from phloem.ops.row_max import row_max


def time_graph(fn, iters: int) -> float:
    """Mean microseconds per replay of `fn` captured in a CUDA graph."""
    return graph_replay_seconds(fn, iters) * 1e6


def time_rows(rows: int, args) -> dict:
    """One-stage and two-stage times [us] for `rows` rows; checks the ids agree."""
    logits = torch.randn(rows, args.vocab, device="cuda").to(torch.bfloat16)
    want = logits.max(dim=-1)[1]
    case = {"rows": rows, "one_stage_us": time_graph(lambda: logits.max(dim=-1), args.iters)}
    for chunks in args.chunks:
        assert torch.equal(row_max(logits, split=True, chunks=chunks)[1], want)
        fn = lambda c=chunks: row_max(logits, split=True, chunks=c)  # noqa: E731
        case[f"two_stage_{chunks}_us"] = time_graph(fn, args.iters)
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in case.items()))
    return case


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--json")
    args = p.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "vocab": args.vocab, "cases": []}
    for rows in args.rows:
        result["cases"].append(time_rows(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
