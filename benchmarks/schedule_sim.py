"""Scheduler-only simulation of a `phloem bench` prefix workload: the real prefix planner,
admission and chunked-prefill scheduler over a KV pool of a given size, no model (every sampled
token is a dummy), so step counts and decode-only phases show in seconds on a CPU.

    python benchmarks/schedule_sim.py --num-groups 100 --degree 64 --num-blocks 54300 \
        --max-num-seqs 2048 --max-num-batched-tokens 8192

Prints the number of steps, how many are decode-only, and the run-length phases
(kind, steps, and at the phase's first step: sequences, tokens, waiting, running, free blocks).
54,300 blocks of 16 tokens is the pool phloem sizes for Llama-3.1-8B on an H200 at 0.9 memory.
"""

from __future__ import annotations

import argparse

from phloem.bench.workloads import make_workload
from phloem.config import SchedulerConfig
from phloem.core.kv_manager import KVManager
from phloem.core.prefix_planner import plan_prefix_groups
from phloem.core.request import Request, SharedPrefix
from phloem.core.scheduler import Scheduler
from phloem.sampling_params import SamplingParams


def simulate(args: argparse.Namespace) -> list[tuple]:
    """One tuple per step: (kind "D"/"M", sequences, tokens, waiting, running, free blocks)."""
    w = make_workload(args.workload, 128256, num_groups=args.num_groups, degree=args.degree)
    plan = plan_prefix_groups(w.prompts, w.output_lens, args.block_size)
    shared = {}
    for group in plan.shared_groups:
        prefix = SharedPrefix(group.prefix_len, num_unfinished=len(group.request_indices))
        shared.update((i, prefix) for i in group.request_indices)
    kv = KVManager(args.num_blocks, args.block_size, enable_prefix_cache=True)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, async_scheduling=False,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=131072)  # fmt: skip
    scheduler = Scheduler(config, kv)
    for i in plan.order:
        params = SamplingParams(max_tokens=w.output_lens[i], ignore_eos=True)
        scheduler.add_request(Request(str(i), w.prompts[i], params, shared_prefix=shared.get(i)))
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        tokens = sum(s.num_tokens for s in out.scheduled)
        kind = "D" if tokens == len(out.scheduled) else "M"
        steps.append((kind, len(out.scheduled), tokens, len(scheduler.waiting),
                      len(scheduler.running), kv.num_free_blocks))  # fmt: skip
        scheduler.update_from_output(out, {s.seq_id: 5 for s in out.scheduled if s.sample})
    return steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="batchllm", choices=["batchllm", "shared-prefix"])
    p.add_argument("--num-groups", type=int, default=None)
    p.add_argument("--degree", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=54300)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = p.parse_args(argv)
    steps = simulate(args)
    print(f"{len(steps)} steps, {sum(s[0] == 'D' for s in steps)} decode-only")
    phases: list[list] = []
    for step in steps:
        if phases and phases[-1][0] == step[0]:
            phases[-1][1] += 1
        else:
            phases.append([step[0], 1, step[1:]])
    for kind, n, (seqs, tokens, waiting, running, free) in phases:
        print(f"  {kind} x {n:4d}: {seqs} seqs, {tokens} tokens, {waiting} waiting, "
              f"{running} running, {free} free blocks")  # fmt: skip


if __name__ == "__main__":
    main()
