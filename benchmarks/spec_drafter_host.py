"""The drafter's host work per step at a large running set with no drafts (issue 20): what the
engine calls on every step when a drafter exists (`may_draft`, `launched`, `step_done`, and the
engine's own scan of the step in flight for drafts), timed without a model on N fake decoding
requests whose random prompts the proposer never matches (as batchllm's: no draft is ever
verified). The Llama-3.1-8B-on-H100 prior (`step_time_model(..., "cuda")`), k = 5 (the engine's
default), n-gram or suffix proposer; each step appends a token to every request.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_drafter_host.py --num-seqs 2048 --steps 300

`--ramp R`: R requests join the running set a step (batchllm's prefills ending), `--old-start`:
each method also with the offer rate starting at 1 (the drafter before 2026-11-26h, whose first
proposals asked every request until the rate fell) in the same run.

Reported: requests the proposer indexed, the slowest step [us], microseconds per step of each call (median over steps), proposals and the steps whose
pre-check said yes (each costs the engine a sync: async overlap lost), as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phloem.config import SpeculativeConfig  # noqa: E402
from phloem.core.request import Request  # noqa: E402
from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput  # noqa: E402
from phloem.sampling_params import SamplingParams  # noqa: E402
from phloem.spec_decode.drafter import Drafter, step_time_model  # noqa: E402

LLAMA_8B = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256)  # fmt: skip


def _requests(n: int, prompt_len: int, rng: random.Random) -> list[Request]:
    out = []
    for i in range(n):
        r = Request(str(i), [rng.randrange(1000, 120000) for _ in range(prompt_len)],
                    SamplingParams(temperature=0, max_tokens=10**6))  # fmt: skip
        r.output_token_ids = [rng.randrange(1000, 120000)]
        r.num_computed_tokens = r.num_tokens - 1
        out.append(r)
    return out


def run(args, method: str, old_start: bool = False) -> dict:
    rng = random.Random(0)
    pool = _requests(args.num_seqs, args.prompt_len, rng)
    running = pool[: args.ramp or len(pool)]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=args.k)
    drafter = Drafter(spec, step_time_model(LLAMA_8B, "cuda"), args.budget)
    if old_start:  # the drafter before 2026-11-26h: every request asked until the rate fell
        drafter.offer_rate, drafter._since_proposal = 1.0, 0
    times: dict[str, list[float]] = {"may_draft": [], "propose": [], "launched": [],
                                     "step_done": [], "engine_scan": [], "total": []}  # fmt: skip
    yes = 0
    for _ in range(args.steps):
        if len(running) < len(pool):  # requests join as their prefills end (`--ramp` a step)
            running = pool[: len(running) + args.ramp]
        t0 = time.perf_counter()
        may = drafter.may_draft(running)
        t1 = time.perf_counter()
        if may:
            yes += 1
            drafter.propose(running)
        t2 = time.perf_counter()
        sched = SchedulerOutput(
            scheduled=[
                ScheduledSequence(
                    r.request_id,
                    r.num_computed_tokens,
                    1 + len(r.draft_token_ids),
                    True,
                    draft_token_ids=tuple(r.draft_token_ids),
                )  # fmt: skip
                for r in running
            ]
        )
        t3 = time.perf_counter()
        drafter.launched(sched)
        t4 = time.perf_counter()
        any(s.draft_token_ids for s in sched.scheduled)  # the engine's scan (`_propose_drafts`)
        t5 = time.perf_counter()
        drafter.step_done(sched, t5 - 0.04)  # a 40 ms wait: a decode step of the 8B at this batch
        t6 = time.perf_counter()
        for r in running:  # the update (no drafts are accepted: random prompts)
            r.draft_token_ids = []
            r.output_token_ids.append(rng.randrange(1000, 120000))
            r.num_computed_tokens = r.num_tokens - 1
        for key, dt in zip(times, (t1 - t0, t2 - t1, t4 - t3, t6 - t5, t5 - t4)):
            times[key].append(dt)
        times["total"].append((t2 - t0) + (t6 - t3))
    us = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    mean = {k: round(statistics.fmean(v) * 1e6, 1) for k, v in times.items()}
    return {"method": method, "old_start": old_start, "indexed": len(getattr(drafter.proposer, "_indexes", ())),
            "max_us": round(max(times["total"]) * 1e6), "median_us": us, "mean_us": mean, "pre_check_yes": yes,
            **drafter.counters(), "drafts": drafter.stats.num_draft_tokens}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"])
    parser.add_argument("--ramp", type=int, default=0, help="requests joining a step (0: all)")
    parser.add_argument(
        "--old-start",
        action="store_true",
        help="also run each method with the offer rate starting at 1 (before)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = {
        "args": vars(args) | {"out": None},
        "runs": [
            run(args, m, old)
            for m in args.methods
            for old in ([True, False] if args.old_start else [False])
        ],
    }
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
