"""Host time of a verify step's per-row work outside the proposers (issue 20), against drafts
per row: the worker's input building (`HostStep.build`), the verify graph's padding
(`pad_verify_step`), the checks of rows stacked on the step in flight (`stack_checks`), the
verifier's launch (`launch_verify`, greedy, a tiny vocabulary so its compute is negligible)
the worker's update after it (`append_verified`), and the engine's: the scheduler's
(`apply_verified`: accepted drafts, stop rules, rollback) and the detokenizer's (`add_run`,
no stop strings, not streaming: `LLM.generate`'s), with d // 2 drafts accepted, for S rows of d drafts each on top of a
step in flight (every row's input token pending, as with async scheduling). Prints, per
function, microseconds a call at each d and the least-squares fit a + b * d (b: microseconds
per draft per step, over all S rows). Then, apart from "total" (its update runs
`apply_verified` again), the scheduler's `schedule` and `update_from_output` over a loop of
verify steps.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_per_draft_host.py --out x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phloem.config import SchedulerConfig  # noqa: E402
from phloem.core.draft_tokens import apply_verified  # noqa: E402
from phloem.core.kv_manager import KVManager  # noqa: E402
from phloem.core.request import Request, RequestStatus  # noqa: E402
from phloem.core.scheduler import Scheduler  # noqa: E402
from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput  # noqa: E402
from phloem.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from phloem.engine.token_updates import add_run  # noqa: E402
from phloem.layers.sampler import SamplingRow  # noqa: E402
from phloem.sampling_params import SamplingParams  # noqa: E402
from phloem.spec_decode.verifier import launch_verify  # noqa: E402
from phloem.worker.input_batch import HostStep, SequenceState, append_verified  # noqa: E402
from phloem.worker.stacked_rows import PreviousStep, stack_checks  # noqa: E402
from phloem.worker.verify_graph import pad_verify_step  # noqa: E402

BLOCK = 16
VOCAB = 64
PROMPT = 300


def make_step(num_rows: int, d: int):
    """(scheduler output, states, previous step) of S rows computing their pending token plus
    d drafts each."""
    states, scheduled = [], []
    for b in range(num_rows):
        outputs = list(range(40 + b))
        state = SequenceState(list(range(PROMPT)), outputs, SamplingParams(temperature=0.0))
        known = PROMPT + len(outputs)
        state.block_ids = list(range(b * 64, b * 64 + (known + 1 + d) // BLOCK + 1))
        states.append(state)
        drafts = tuple((b + j) % VOCAB for j in range(d))
        scheduled.append(ScheduledSequence(f"s{b}", known, 1 + d, True, draft_token_ids=drafts))
    prev = PreviousStep(
        torch.zeros(num_rows, dtype=torch.long),
        {f"s{b}": b for b in range(num_rows)},
        torch.ones(num_rows, dtype=torch.bool),
    )
    return SchedulerOutput(scheduled), states, prev


def time_us(fn, calls: int) -> float:
    """Microseconds a call, the best of 3 rounds of `calls` (after a warm-up)."""
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def measure(num_rows: int, d: int, calls: int) -> dict[str, float]:
    """Microseconds a call of each function at S rows of d drafts."""
    sched, states, prev = make_step(num_rows, d)
    host = HostStep.build(sched, states, BLOCK, False)
    cpu = torch.device("cpu")
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in states]
    drafts = [s.draft_token_ids for s in sched.scheduled]
    logits = torch.randn(len(host.logits_indices), VOCAB)
    accepted = [d // 2] * num_rows
    tokens = [1] * num_rows

    def no_plain(plain_logits, plain):  # (every row drafts: never called)
        raise AssertionError(plain)

    def update() -> None:
        lens = [(len(s.output_token_ids), list(s.block_ids)) for s in states]
        append_verified(states, drafts, accepted, tokens, BLOCK)
        for s, (n, table) in zip(states, lens):
            del s.output_token_ids[n:]
            s.block_ids = table

    out = {
        "build": time_us(lambda: HostStep.build(sched, states, BLOCK, False), calls),
        "pad_verify_step": time_us(
            lambda: pad_verify_step(host, 17, num_rows, 10**6, BLOCK), calls
        ),
        "stack_checks": time_us(lambda: stack_checks(host, sched, states, prev, cpu), calls),
        "launch_verify": time_us(
            lambda: launch_verify(logits, rows, drafts, None, no_plain).result(), calls
        ),
        "append_verified": time_us(update, calls),
    }
    out.update(measure_engine_update(sched, accepted, calls))
    out["total"] = sum(out.values())
    return out


class NoTrim:
    """`KVManager.trim` of a manager holding no blocks."""

    def trim(self, request: Request) -> None:
        pass


def measure_engine_update(sched: SchedulerOutput, accepted: list[int], calls: int) -> dict:
    """Microseconds a step of the scheduler's `apply_verified` over the rows (EOS never
    drafted, no max_tokens: no stop) and of `add_run` over their new tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=None)
    requests = []
    for s in sched.scheduled:
        r = Request(s.seq_id, list(range(PROMPT)), params, eos_token_id=VOCAB + 1)
        r.output_token_ids = list(range(40))
        r.status = RequestStatus.RUNNING
        requests.append(r)
    counts = {s.seq_id: a for s, a in zip(sched.scheduled, accepted)}
    detoks = [IncrementalDetokenizer(None, [1, 2], incremental=False) for _ in requests]
    kv = NoTrim()

    def scheduler_update() -> None:
        for r, s in zip(requests, sched.scheduled):
            r.num_pending_tokens, r.num_computed_tokens = 1 + len(s.draft_token_ids), 0
            apply_verified(r, s, 1, counts, kv, 10**6)  # type: ignore[arg-type]
            del r.output_token_ids[40:]

    def detok_update() -> None:
        for r, detok, a in zip(requests, detoks, accepted):
            r.output_token_ids.extend(range(a + 1))
            add_run(r, detok, a + 1)
            del r.output_token_ids[40:]
            del detok._token_ids[2:]

    return {
        "apply_verified": time_us(scheduler_update, calls),
        "add_run": time_us(detok_update, calls),
    }


def measure_scheduler(num_rows: int, d: int, steps: int) -> dict[str, float]:
    """Median microseconds of `Scheduler.schedule` and `update_from_output` (which runs
    `apply_verified`) over `steps` verify steps of S running requests given d drafts each,
    d // 2 accepted (so each step's rejected drafts roll back: `KVManager.trim`, and the next
    step allocates again), 16-token blocks, prefix caching on, nothing in flight."""
    config = SchedulerConfig(
        max_num_seqs=2 * num_rows,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        memory_centric_admission=False,
    )
    scheduler = Scheduler(config, KVManager(num_rows * 128, BLOCK, enable_prefix_cache=True))
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for b in range(num_rows):
        scheduler.add_request(Request(f"s{b}", [b] * 8 + list(range(PROMPT)), params))
    times: dict[str, list[float]] = {"schedule": [], "update_from_output": []}
    for step in range(steps + 1):
        for r in scheduler.running:
            r.draft_token_ids = [5] * d
        start = time.perf_counter()
        out = scheduler.schedule()
        mid = time.perf_counter()
        sampled = {s.seq_id: 1 for s in out.scheduled if s.sample}
        accepted = {s.seq_id: len(s.draft_token_ids) // 2 for s in out.scheduled}
        scheduler.update_from_output(out, sampled, accepted)
        if step:  # (step 0: the prompts)
            times["schedule"].append(mid - start)
            times["update_from_output"].append(time.perf_counter() - mid)
    return {name: float(np.median(ts)) * 1e6 for name, ts in times.items()}


def fit(ds: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b * d."""
    b, a = np.polyfit(np.array(ds, dtype=float), np.array(ys, dtype=float), 1)
    return float(a), float(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = {d: measure(args.rows, d, args.calls) for d in args.drafts}
    for d in args.drafts:  # (a separate loop: not in "total", which has apply_verified)
        table[d].update(measure_scheduler(args.rows, d, args.calls))
    fits = {}
    for name in table[args.drafts[0]]:
        a, b = fit(args.drafts, [table[d][name] for d in args.drafts])
        fits[name] = {"us_per_step": round(a, 1), "us_per_draft": round(b, 2)}
        cells = " ".join(f"{table[d][name]:7.1f}" for d in args.drafts)
        print(f"{name:16s} {cells}   a={a:7.1f} us  b={b:6.2f} us/draft")
    result = {"rows": args.rows, "drafts": args.drafts, "us": table, "fit": fits}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
