"""The speculative drafter's per-step pre-check (`cost_rule.uniform_drafts_pay`, which
`Drafter.may_draft` asks every step) timed on the host: microseconds a call over a grid of step
time models (a draft's cost `c_draft_s` and a verify step's fixed cost `t_verify_s`), acceptance
rates and batch sizes, k = 16, and its answer (whether any draft pays). The small-model step of
results/2026-11-27b-h200 (SmolLM2-135M on an H200: ~1.5 ms of host work a step, little GPU time)
is the base model. `choose_num_drafts` (the rule itself, on a proposal's candidates) is timed
too, on batches of candidates with mixed chained rates (`time_choose`).

    OMP_NUM_THREADS=1 python benchmarks/spec_precheck.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phloem.spec_decode.cost_rule import (  # noqa: E402
    CostRuleConfig,
    DraftCandidate,
    StepTimeModel,
    choose_num_drafts,
    uniform_drafts_pay,
)

COSTS = [(4.6e-5, 1e-3), (1e-5, 3e-4), (2e-6, 1e-4)]  # (c_draft_s, t_verify_s)
RATES = [0.3, 0.6, 0.9]
BATCHES = [8, 32, 256]


def time_call(model: StepTimeModel, rate: float, batch: int, calls: int) -> tuple[float, bool]:
    """(microseconds a call, the answer) of the pre-check for `batch` sampled sequences, all
    offered drafts, at ~1,000 tokens of KV each."""
    candidate, config = DraftCandidate(rate, 16), CostRuleConfig(16)
    args = (candidate, batch, batch, batch, batch * 1000, model, config)
    answer = uniform_drafts_pay(*args)
    start = time.perf_counter()
    for _ in range(calls):
        uniform_drafts_pay(*args)
    return (time.perf_counter() - start) / calls * 1e6, answer


def time_choose(model: StepTimeModel, rate: float, batch: int, calls: int) -> tuple[float, int]:
    """(microseconds a call, drafts handed out) of `choose_num_drafts` on `batch` candidates of
    16 drafts each, first rates spread around `rate` and chained (continue rate 0.9), at ~1,000
    tokens of KV each."""
    candidates = [DraftCandidate(min(1.0, rate * (0.5 + b / batch)), 16, 0.9) for b in range(batch)]
    args = (candidates, batch, batch, batch * 1000, model, CostRuleConfig(16))
    answer = sum(choose_num_drafts(*args))
    start = time.perf_counter()
    for _ in range(calls):
        choose_num_drafts(*args)
    return (time.perf_counter() - start) / calls * 1e6, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for c_draft, t_verify in COSTS:
        model = StepTimeModel(t_host_s=1.5e-3, t_weights_s=1e-4, c_token_s=2e-7, c_kv_s=1e-10,
                              c_draft_s=c_draft, t_verify_s=t_verify)  # fmt: skip
        for rate in RATES:
            for batch in BATCHES:
                us, pays = time_call(model, rate, batch, args.calls)
                choose_us, drafts = time_choose(model, rate, batch, max(1, args.calls // 10))
                rows.append({"c_draft_s": c_draft, "t_verify_s": t_verify, "rate": rate,
                             "batch": batch, "us_per_call": round(us, 2), "pays": pays,
                             "choose_us_per_call": round(choose_us, 2),
                             "choose_drafts": drafts})  # fmt: skip
                print(f"c_draft {c_draft:.0e} t_verify {t_verify:.0e} rate {rate} batch {batch}: "
                      f"{us:7.1f} us, pays {pays}; choose {choose_us:7.1f} us, "
                      f"{drafts} drafts")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
