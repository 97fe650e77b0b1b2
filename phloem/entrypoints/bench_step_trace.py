"""`phloem bench step-trace FILE...`: where a server's step time went, from step traces that
`phloem serve --step-trace FILE` wrote (`phloem.bench.step_trace_file`).

Per trace and step kind (decode-only, mixed, prefill-only): steps, share of the wall time,
duration p50 / p99, mean tokens, decoding sequences and prompt chunks, the share of steps that
may replay a CUDA graph, host time before launch, the kind's part of the decode-weighted step
time (about the mean TPOT), and the fit duration ~ a + b * tokens + c * decode_seqs
(`phloem.bench.step_analysis`). `--run RUN.json` (a `phloem bench serve --json` result, same
host) or `--window START:END` (monotonic seconds) cuts each trace to one run; `--json` writes
the analyses.

    phloem serve --model M --step-trace /tmp/steps.jsonl &
    phloem bench serve --request-rate 30 --duration 30 --json /tmp/run.json
    phloem bench step-trace /tmp/steps.jsonl --run /tmp/run.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register_step_trace(bench_subparsers) -> None:
    """Add `step-trace` under `phloem bench`."""
    p = bench_subparsers.add_parser("step-trace", help="step time by kind from a step trace")
    p.add_argument("files", nargs="+", help="step trace files (phloem serve --step-trace)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--run", default=None, help="cut to this `bench serve --json` run's window")
    g.add_argument("--window", default=None, help="START:END, monotonic seconds")
    p.add_argument("--json", default=None, help="write {file: analysis} to this path")
    p.set_defaults(func=run_step_trace)


def run_window(path: str | Path) -> tuple[float, float]:
    """The (start, end) monotonic window [s] of a `phloem bench serve --json` result.

    Raises:
        ValueError: naming the file, when it has no "window_monotonic_s" (an older result).
    """
    record = json.loads(Path(path).read_text())
    window = record.get("window_monotonic_s") if isinstance(record, dict) else None
    if not window:
        raise ValueError(f"{path}: no window_monotonic_s (not a `phloem bench serve --json` "
                         "result of this version)")  # fmt: skip
    return float(window[0]), float(window[1])


def _parse_window(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        window = float(start), float(end)
    except ValueError:
        window = None
    if not sep or window is None or window[0] >= window[1]:
        raise ValueError(f"--window must be START:END with START < END, got {text!r}")
    return window


def analyze_file(path: str | Path, window: tuple[float, float] | None = None) -> dict:
    """The `step_analysis.analyze` result of one trace (cut to `window`), with its header.

    Raises:
        ValueError: not a step trace, or no steps (in the window).
    """
    from phloem.bench.step_analysis import analyze, in_window, with_durations
    from phloem.bench.step_trace_file import read_step_trace

    header, steps = read_step_trace(path)
    steps = with_durations(steps)
    if window is not None:
        steps = in_window(steps, *window)
    try:
        result = analyze(steps)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    result["header"] = header
    return result


def run_step_trace(args: argparse.Namespace) -> int:
    """The `bench step-trace` subcommand: one table per file; --json writes them all."""
    from phloem.bench.step_analysis import markdown

    window = None
    if args.run:
        window = run_window(args.run)
    elif args.window:
        window = _parse_window(args.window)
    analyses = {}
    for path in args.files:
        analyses[path] = analyze_file(path, window)
        print(markdown(analyses[path], path))
    if args.json:
        Path(args.json).write_text(json.dumps(analyses, indent=2))
    return 0
