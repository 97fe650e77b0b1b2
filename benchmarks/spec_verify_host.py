"""A verify step's sampling (`spec_decode.verifier.verify_drafts`) for greedy rows, timed on the
host: microseconds a call and the aten operators it dispatches (each a kernel launch on a GPU,
where a small model's verify step is host-bound: results/2026-11-27b-h200), for S rows of k
drafts over a vocabulary of V, bf16 logits, and `launch_verify` of mixed steps (half the rows
without drafts). On the CPU the time includes the operators' compute.

    OMP_NUM_THREADS=1 python benchmarks/spec_verify_host.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phloem.layers.sampler import SamplingRow  # noqa: E402
from phloem.sampling_params import SamplingParams  # noqa: E402
from phloem.spec_decode.verifier import verify_drafts  # noqa: E402

SHAPES = [(1024, 1, 16), (1024, 32, 8), (49152, 1, 16), (49152, 32, 8)]  # (V, S, k)


def measure(vocab: int, num_rows: int, k: int, calls: int) -> dict:
    """One shape: microseconds a call (mean of `calls` after 3 warm-ups) and top-level aten
    operators of one call."""
    logits = torch.randn(num_rows * (k + 1), vocab).to(torch.bfloat16)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(num_rows)]
    drafts = [tuple(range(k))] * num_rows
    for _ in range(3):
        verify_drafts(logits, rows, drafts, None).result()
    start = time.perf_counter()
    for _ in range(calls):
        verify_drafts(logits, rows, drafts, None).result()
    us = (time.perf_counter() - start) / calls * 1e6
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        verify_drafts(logits, rows, drafts, None).result()
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    return {"vocab": vocab, "rows": num_rows, "k": k, "us_per_call": round(us, 1), "aten_ops": ops}


def measure_mixed(vocab: int, num_rows: int, k: int, calls: int) -> dict:
    """`launch_verify` of a step whose even rows verify k drafts and odd rows have none (the
    sampler's path), greedy: microseconds a call and top-level aten operators."""
    from phloem.layers.sampler import Sampler
    from phloem.spec_decode.verifier import launch_verify

    drafts = [tuple(range(k)) if b % 2 == 0 else () for b in range(num_rows)]
    logits = torch.randn(sum(1 + len(d) for d in drafts), vocab).to(torch.bfloat16)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(num_rows)]
    sampler = Sampler()

    def sample_plain(plain_logits, plain):
        return sampler.launch(plain_logits, [rows[b] for b in plain], None)

    def call():
        launch_verify(logits, rows, drafts, None, sample_plain).result()

    for _ in range(3):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    us = (time.perf_counter() - start) / calls * 1e6
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    return {"mixed": True, "vocab": vocab, "rows": num_rows, "k": k, "us_per_call": round(us, 1),
            "aten_ops": ops}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(v, s, k, args.calls) for v, s, k in SHAPES]
    results += [measure_mixed(1024, s, k, args.calls) for s, k in ((2, 16), (32, 8))]
    for r in results:
        print(r)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
