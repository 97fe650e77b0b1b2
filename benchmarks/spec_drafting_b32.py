"""The drafter's work per verify step on a copy batch (issue 20): `Drafter.may_draft` and
`Drafter.propose` driven step by step without an engine or a model, on the copy workload of
`spec_overhead_paced.py` (prompts holding a passage that the outputs copy, with an edit every
`--edit-every` tokens). Each step every running request accepts the longest prefix of its drafts
that the workload emits, then one more token (the greedy verifier's outcome), and the drafter
observes it. The step time learner is not fed (no `launched` / `step_done`), so the cost rule's
model is the CUDA prior of SmolLM2-135M's shape throughout and the run is deterministic: two
trees that make the same choices hand out the same drafts at every step (`digest`, a hash of
every step's drafts), whatever their speed.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_drafting_b32.py \
        --methods suffix ngram --repeats 3 --out x.json

`--profile N`: cProfile of the run, the N functions with the most own time printed to stderr.

Reported per method: proposals, drafts handed out, the digest, and microseconds a proposal
(`propose`, the median over proposals at >= `--min-rows` rows, and the mean; `proposer`: the
median of the part spent in the proposer's `propose`, indexing and drafting) and a step
(`may_draft`), the best of `--repeats` runs (each a fresh drafter).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_overhead_paced import Workload  # noqa: E402

from phloem.config import SpeculativeConfig  # noqa: E402
from phloem.core.request import Request  # noqa: E402
from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput  # noqa: E402
from phloem.sampling_params import SamplingParams  # noqa: E402
from phloem.spec_decode.drafter import Drafter, step_time_model  # noqa: E402
from phloem.spec_decode.ngram_proposer import NgramProposer  # noqa: E402
from phloem.spec_decode.proposer import Proposer  # noqa: E402
from phloem.spec_decode.suffix_proposer import SuffixProposer  # noqa: E402

# SmolLM2-135M's shape (the embedded model), for the cost rule's CUDA prior
SMOL = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    num_hidden_layers=30, intermediate_size=1536, vocab_size=49152)  # fmt: skip


class TimedProposer(Proposer):
    """A proposer that times the calls of the one it wraps [s]."""

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.costly, self.seconds = inner, inner.costly, 0.0

    def propose(self, requests):
        start = time.perf_counter()
        drafts = self.inner.propose(requests)
        self.seconds += time.perf_counter() - start
        return drafts

    def finish(self, request_id: str) -> None:
        self.inner.finish(request_id)


def run(args, method: str, shape) -> dict:
    """One batch to `--max-tokens` outputs each; returns the timings and the digest."""
    workload = Workload("copy", args.batch, args.passage, args.edit_every)
    workload.new_batch(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    running = []
    for seq_id, prompt in workload.prompts:
        r = Request(seq_id, list(prompt), params)
        r.output_token_ids = [workload.token(seq_id, 0)]
        r.num_computed_tokens = r.num_tokens - 1
        running.append(r)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=args.k)
    inner = NgramProposer(spec.proposer_config()) if method == "ngram" else SuffixProposer(
        spec.proposer_config())  # fmt: skip
    proposer = TimedProposer(inner)
    drafter = Drafter(spec, step_time_model(shape, "cuda"), args.budget, proposer)
    digest = hashlib.sha256()
    propose_us, may_us, rows_at, proposer_us = [], [], [], []
    steps = 0
    while running:
        steps += 1
        t0 = time.perf_counter()
        may = drafter.may_draft(running)
        t1 = time.perf_counter()
        if may:
            before = proposer.seconds
            drafter.propose(running)
            propose_us.append((time.perf_counter() - t1) * 1e6)
            proposer_us.append((proposer.seconds - before) * 1e6)
            rows_at.append(len(running))
        may_us.append((t1 - t0) * 1e6)
        scheduled, accepted = [], {}
        for r in running:
            drafts = r.draft_token_ids if may else []
            digest.update(repr((r.request_id, drafts)).encode())
            n = len(r.output_token_ids)
            a = 0
            while a < len(drafts) and drafts[a] == workload.token(r.request_id, n + a):
                a += 1
            if drafts:
                accepted[r.request_id] = a
            scheduled.append(
                ScheduledSequence(
                    r.request_id,
                    r.num_computed_tokens,
                    1 + len(drafts),
                    True,
                    draft_token_ids=tuple(drafts),
                )  # fmt: skip
            )
            new = [workload.token(r.request_id, n + j) for j in range(a + 1)]
            r.output_token_ids.extend(new[: args.max_tokens - n])
            r.num_computed_tokens = r.num_tokens - 1
            r.draft_token_ids = []
        drafter.observe(SchedulerOutput(scheduled=scheduled), accepted)
        for r in [r for r in running if len(r.output_token_ids) >= args.max_tokens]:
            drafter.finish(r.request_id)
            running.remove(r)
    busy = [t for t, n in zip(propose_us, rows_at) if n >= args.min_rows] or [0.0]
    busy_proposer = [t for t, n in zip(proposer_us, rows_at) if n >= args.min_rows] or [0.0]
    return {
        "method": method, "steps": steps, "proposals": len(propose_us),
        "proposals_at_min_rows": len(busy), "drafts": drafter.stats.num_draft_tokens,
        "accepted": drafter.stats.num_accepted_tokens, "digest": digest.hexdigest()[:16],
        "propose_us_median": round(statistics.median(busy), 1),
        "propose_us_mean": round(statistics.fmean(propose_us or [0.0]), 1),
        "proposer_us_median": round(statistics.median(busy_proposer), 1),
        "may_draft_us_median": round(statistics.median(may_us), 1),
        "total_ms": round((sum(propose_us) + sum(may_us)) / 1e3, 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["suffix", "ngram"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passage", type=int, default=400)
    parser.add_argument("--edit-every", type=int, default=25)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--min-rows", type=int, default=24,
                        help="proposals at fewer rows are left out of the median")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    shape = SMOL
    results = []
    for method in args.methods:
        runs = []
        for _ in range(args.repeats):
            profiler = cProfile.Profile() if args.profile else None
            if profiler:
                profiler.enable()
            runs.append(run(args, method, shape))
            if profiler:
                profiler.disable()
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(
                    args.profile
                )
        assert len({r["digest"] for r in runs}) == 1, "the drafts differ between repeats"
        best = min(runs, key=lambda r: r["propose_us_median"])
        best["propose_us_medians"] = [r["propose_us_median"] for r in runs]
        results.append(best)
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
