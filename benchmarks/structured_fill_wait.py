"""How long the engine loop waits for a constrained step's bitmask fill, on a CPU standing in
for the GPU host (issue 21).

On the H100 (1,024 requests x 128 tokens under one schema) the loop waited 6.8 ms a step in
`StructuredOutputs.bitmask` for a fill started in `advance` (`2026-11-26f-h100/`). Between the
two the loop processes the previous step's outputs (Python) and draws the step's noise
(`presample`: ~2,000 kernel launches, each a torch call that releases the GIL). This drives the
engine's own `StructuredOutputs` hooks in the engine's order, over `--rows` sequences replaying a
recorded walk of the GPU benchmark's schema (the byte-level 128,256-token tokenizer), with a
stub scheduler and no model:

    mark(N+1) -> collected(N's tokens): the advance, then the fill of N+1, start on the fill
      thread (trees from 2026-11-27c on) -> update: --update-ms of Python (the scheduler's
      update_from_output) -> advance(N's tokens): on trees before, the advance, then the fill
      of N+1 starts -> outputs: --outputs-ms of Python -> presample: --presample-ms of small
      torch ops -> bitmask(N+1): the wait is measured

Per step: the loop's wait for the fill, the fill's own time, how long after `advance`
started it the fill's thread began (`fill_lag`, where the tree under test records it) and
when it ended (`fill_done`: the hand-over to the filled bitmask). `--grammar-process`: the
grammars in a process of their own (`structured_output/grammar_process.py`).
`--trees A,B` runs each tree (a directory with `phloem/`, e.g. a `git archive` of the commit
before a change) in its own process, alternating, `--rounds` times; the walk is recorded once
(`--walk`, a .npy file) and replayed by every process.

    python benchmarks/structured_fill_wait.py --rows 256 --trees /tmp/before,. --rounds 3 \
        --out DIR/fill-wait.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np


class _Request:
    """What `StructuredOutputs.advance` reads of a request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.output_token_ids: list[int] = []
        self.is_finished = False


class _Scheduler:
    """What `StructuredOutputs` calls on the scheduler; counts the requests it fails or stops."""

    def __init__(self, requests: list[_Request]) -> None:
        self.requests = {r.request_id: r for r in requests}
        self.running, self.waiting = list(requests), []
        self.admission_gate = None
        self.config = SimpleNamespace(max_num_seqs=len(requests))  # the grammar process's rows
        self.num_failed = self.num_finished = 0

    def fail_request(self, request: _Request, message: str) -> None:
        request.is_finished = True
        self.num_failed += 1

    def finish_request(self, request: _Request, status) -> None:
        request.is_finished = True
        self.num_finished += 1


def python_work(ms: float) -> None:
    """`ms` of Python holding the GIL (the scheduler's update, the outputs of a step)."""
    end = time.perf_counter() + ms / 1e3
    total = 0
    while time.perf_counter() < end:
        for i in range(50):
            total += i


def loop_work(outputs_ms: float, presample_ms: float, small) -> None:
    """The loop's own work between `advance` and `bitmask`: `outputs_ms` of Python holding the
    GIL (the outputs of step N), then `presample_ms` of torch calls on `small` (each releases
    the GIL while it runs, as the noise draw's kernel launches do)."""
    python_work(outputs_ms)
    end = time.perf_counter() + presample_ms / 1e3
    while time.perf_counter() < end:
        small.add_(1)


def _counters(times) -> tuple[float, ...]:
    """(advance, fill, fill wait, fill lag, fill done) seconds so far of a `LoopTimes`; a tree
    from before `fill_lag_s` or `fill_done_s` existed counts none."""
    counts = dataclasses.asdict(times)
    lag, done = counts.get("fill_lag_s", 0.0), counts.get("fill_done_s", 0.0)
    return times.advance_s, times.fill_s, times.fill_wait_s, lag, done


def _step(num: int, rows: list[str]):
    """A decode step sampling every row (`SchedulerOutput`)."""
    from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput

    return SchedulerOutput(scheduled=[ScheduledSequence(r, num, 1, True) for r in rows])


def replay(args, walk: np.ndarray) -> dict:
    """The hooks over the walk (one step per row of `walk`, [steps, rows] token ids); ms per
    step after the first (mean, and mean over the steps whose fill took longest, a quarter)."""
    import torch

    from benchmarks.structured_fill_contention import tokenizer
    from benchmarks.structured_outputs import schema
    from phloem.engine.structured_outputs import StructuredOutputs
    from phloem.sampling_params import SamplingParams, StructuredOutputsParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data = tokenizer(tmp)
    ids = [f"s{i}" for i in range(walk.shape[1])]
    requests = [_Request(i) for i in ids]
    scheduler = _Scheduler(requests)
    process = {"grammar_process": True} if args.grammar_process else {}  # trees from 2026-11-27e
    hooks = StructuredOutputs(scheduler, data.tokenizer, data.stop_token_ids[0], data.vocab_size,
                              num_compile_threads=args.fill_threads, **process)  # fmt: skip
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema(None, 200, 400)))
    for seq_id in ids:
        hooks.register(seq_id, params)
    assert hooks.manager is not None and hooks.manager.wait_ready(ids)
    first = _step(0, ids)
    hooks.mark(first)
    hooks.bitmask(first)  # the start state's masks, on the loop
    small, times = torch.zeros(64), hooks.times
    collected = getattr(hooks, "collected", None)  # a tree from before 2026-11-27c has none
    steps, sched = [], first
    for num, tokens in enumerate(walk[:-1].tolist(), start=1):
        ran, sched = sched, _step(num, ids)  # the step whose tokens came, the one marked
        hooks.mark(sched)
        before = _counters(times)
        start = time.perf_counter()
        if collected is not None:
            collected(ran, dict(zip(ids, tokens)))
        python_work(args.update_ms)
        for request, token in zip(requests, tokens):
            request.output_token_ids.append(token)
        hooks.advance(requests)
        loop_work(args.outputs_ms, args.presample_ms, small)
        hooks.bitmask(sched)
        after = _counters(times)
        steps.append([time.perf_counter() - start, *(b - a for a, b in zip(before, after))])
    hooks.close()
    assert not scheduler.num_failed, "the walk left the grammar"
    ms = 1e3 * np.array(steps)
    slow = ms[np.argsort(ms[:, 2])[-max(1, len(ms) // 4) :]]
    names = ("step", "advance", "fill", "fill_wait", "fill_lag", "fill_done")
    return {"rows": len(ids), "steps": len(ms), "fill_threads": args.fill_threads,
            "grammar_process": args.grammar_process,
            "update_ms": args.update_ms, "outputs_ms": args.outputs_ms,
            "presample_ms": args.presample_ms,
            "mean_ms": dict(zip(names, ms.mean(axis=0).round(3).tolist())),
            "slowest_quarter_ms": dict(zip(names, slow.mean(axis=0).round(3).tolist())),
            "early_fills": hooks.num_early_fills}  # fmt: skip


def load_walk(args) -> np.ndarray:
    """The walk ([steps, rows] token ids): `args.walk` if it exists, else recorded
    (`structured_masks.record_walk`) and saved there."""
    path = Path(args.walk)
    if path.exists():
        walk = np.load(path)
        if walk.shape == (args.steps, args.rows):
            return walk
    from benchmarks.structured_fill_contention import tokenizer
    from benchmarks.structured_masks import record_walk

    with tempfile.TemporaryDirectory() as tmp:
        data = tokenizer(tmp)
    walk = np.array(record_walk(data, args.rows, args.steps, 1), dtype=np.int64)
    np.save(path, walk)
    return walk


def run_trees(args) -> list[dict]:
    """`replay` of each tree in `args.trees` in a process of its own, alternating, each round."""
    load_walk(args)  # recorded once, here
    child_args = ["--rows", str(args.rows), "--steps", str(args.steps),
                  "--fill-threads", str(args.fill_threads), "--update-ms", str(args.update_ms),
                  "--outputs-ms", str(args.outputs_ms), "--presample-ms", str(args.presample_ms),
                  "--walk", args.walk] + ["--grammar-process"] * args.grammar_process  # fmt: skip
    from phloem.bench.ab_trees import run_in_trees  # the parent's tree (a child's may lack it)

    return run_in_trees(str(Path(__file__).resolve()), child_args, args.trees, args.rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="sequences")
    parser.add_argument("--steps", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--fill-threads", type=int, default=1, help="the library's threads")
    parser.add_argument("--update-ms", type=float, default=0.0,
                        help="Python between the tokens' arrival and advance")  # fmt: skip
    parser.add_argument("--outputs-ms", type=float, default=3.0, help="Python after advance")
    parser.add_argument("--presample-ms", type=float, default=19.0, help="torch calls after it")
    parser.add_argument("--walk", default=None, help=".npy of the walk (default: in /tmp)")
    parser.add_argument("--grammar-process", action="store_true",
                        help="the grammars in a process of their own (StructuredOutputs')")  # fmt: skip
    parser.add_argument("--trees", default=None, help="comma-separated trees to compare")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.walk is None:
        args.walk = str(Path(tempfile.gettempdir()) / f"phloem-walk-{args.rows}x{args.steps}.npy")
    # the tree under test (a child), else this file's, imports first: `phloem`, `benchmarks`
    sys.path.insert(0, args.child or str(Path(__file__).resolve().parents[1]))
    if args.child is not None:
        import phloem

        assert Path(phloem.__file__).resolve().is_relative_to(args.child), phloem.__file__
        print(json.dumps(replay(args, load_walk(args))))
        return
    if args.trees is None:
        runs = [replay(args, load_walk(args))]
        print(json.dumps(runs[0]))
    else:
        runs = run_trees(args)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
