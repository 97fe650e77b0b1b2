"""`phloem bench serve-summary DIR`: serving runs of several engines compared, from the JSON
files `phloem bench serve --json` wrote into DIR (each labelled with `--engine` and
`--workload`; benchmarks/serving.sh writes them).

Per workload and engine: request throughput and TTFT / TPOT / ITL p50 and p99, and the ratios of
`--subject` (default phloem) to `--baseline` (default vllm) measured in the same directory (a
throughput ratio above 1 and latency ratios below 1 favour the subject). Engines labelled
`SUBJECT@NAME` (one server configuration each: benchmarks/serving.sh's PHLOEM_CONFIGS) are
subjects too, each compared with the baseline on its own. Goodput, per engine:
among its Poisson runs (finite offered rate), those whose TTFT p99 <= `--slo-ttft-ms` and TPOT
p99 <= `--slo-tpot-ms` (300 and 25 by default, issue 24's objective); the achieved req/s of the
one with the highest offered rate, 0 when none meets it. Writes DIR/summary.json,
DIR/summary.md (the tables) and DIR/latency_throughput.png (TTFT and TPOT p50 and p99 against
achieved req/s of the Poisson runs, one line per engine; needs matplotlib, else a message and no
plot).

Step traces: where DIR holds ENGINE-steps.jsonl (`phloem serve --step-trace`), each run of that
engine is cut from it by the run's monotonic window, and the summary gets the step analysis of
every run (`phloem.bench.step_analysis`: step duration, wall share and cost fit by step kind)
and its edges (`run_edges`: how much of the client's window came before the engine's first step
and after its last, the prompt tokens the steps computed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_OUTPUTS = ("summary.json",)
_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))


def register_serve_summary(bench_subparsers) -> None:
    """Add `serve-summary` under `phloem bench`."""
    p = bench_subparsers.add_parser("serve-summary", help="compare `bench serve` runs")
    p.add_argument("directory", help="folder of `phloem bench serve --json` files")
    p.add_argument("--subject", default="phloem", help="engine label compared (numerator)")
    p.add_argument("--baseline", default="vllm", help="engine label compared against")
    p.add_argument("--slo-ttft-ms", type=float, default=300.0, help="goodput: TTFT p99 bound")
    p.add_argument("--slo-tpot-ms", type=float, default=25.0, help="goodput: TPOT p99 bound")
    p.set_defaults(func=run_serve_summary)


def load_runs(directory: Path) -> list[dict]:
    """The labelled run files of `directory` (those with "engine" and "workload" set).

    Raises:
        ValueError: naming the directory, when it holds none.
    """
    runs = []
    for path in sorted(directory.glob("*.json")):
        if path.name in _OUTPUTS:
            continue
        record = json.loads(path.read_text())
        if isinstance(record, dict) and record.get("engine") and record.get("workload"):
            record["file"] = path.name
            runs.append(record)
    if not runs:
        raise ValueError(f"{directory}: no `phloem bench serve --json` runs with --engine and "
                         "--workload labels")  # fmt: skip
    return runs


def _row(run: dict) -> dict:
    row = {
        "engine": run["engine"],
        "workload": run["workload"],
        "offered_rate": run["request_rate"],
        "completed": run["completed"],
        "failed": run["failed"],
        "request_throughput": run["request_throughput"],
        "output_throughput": run["output_throughput"],
    }
    for key, _ in _METRICS:
        row[f"{key[:-3]}_p50_ms"] = run[key]["median"]
        row[f"{key[:-3]}_p99_ms"] = run[key]["p99"]
    return row


def goodput(rows: list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> dict[str, dict]:
    """Per engine: {"goodput": achieved req/s at the highest offered rate meeting the SLO (0 if
    none), "offered_rate": that rate (None), "rates": the Poisson rates run}."""
    result: dict[str, dict] = {}
    for row in rows:
        if not math.isfinite(row["offered_rate"]):
            continue
        entry = result.setdefault(row["engine"], {"goodput": 0.0, "offered_rate": None,
                                                  "rates": []})  # fmt: skip
        entry["rates"].append(row["offered_rate"])
        ttft, tpot = row["ttft_p99_ms"], row["tpot_p99_ms"]
        meets = row["failed"] == 0 and ttft is not None and tpot is not None
        meets = meets and ttft <= slo_ttft_ms and tpot <= slo_tpot_ms
        if meets and (entry["offered_rate"] is None or row["offered_rate"] > entry["offered_rate"]):
            entry["offered_rate"] = row["offered_rate"]
            entry["goodput"] = row["request_throughput"]
    for entry in result.values():
        entry["rates"].sort()
    return result


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def is_subject(engine: str, subject: str) -> bool:
    """`engine` is the subject or one of its configurations ("SUBJECT@NAME")."""
    return engine == subject or engine.startswith(subject + "@")


def compare(rows: list[dict], subject: str, baseline: str) -> list[dict]:
    """Per subject engine (`is_subject`) and workload run by it and the baseline: subject /
    baseline of throughput and each latency."""
    by_key = {(r["engine"], r["workload"]): r for r in rows}
    ratios = []
    for (engine, workload), mine in sorted(by_key.items()):
        theirs = by_key.get((baseline, workload))
        if not is_subject(engine, subject) or theirs is None:
            continue
        entry = {"engine": engine, "workload": workload}
        for key in ("request_throughput", *(k for k in mine if k.endswith("_ms"))):
            entry[key] = _ratio(mine[key], theirs[key])
        ratios.append(entry)
    return ratios


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(summary: dict) -> str:
    """The tables of `summary` (runs, ratios, goodput) as Markdown."""
    lines = ["| engine | workload | offered req/s | achieved req/s | TTFT p50 / p99 (ms) | "
             "TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | failed |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in summary["runs"]:
        lines.append(
            f"| {r['engine']} | {r['workload']} | {_fmt(r['offered_rate'])} | "
            f"{_fmt(r['request_throughput'], 2)} | {_fmt(r['ttft_p50_ms'])} / "
            f"{_fmt(r['ttft_p99_ms'])} | {_fmt(r['tpot_p50_ms'])} / {_fmt(r['tpot_p99_ms'])} | "
            f"{_fmt(r['itl_p50_ms'])} / {_fmt(r['itl_p99_ms'])} | {r['failed']} |"
        )
    subject, baseline = summary["subject"], summary["baseline"]
    if summary["ratios"]:
        lines += ["", f"Ratios {subject} / {baseline} (throughput: higher is better; latency: "
                  "lower is better):", "",
                  "| engine | workload | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in summary["ratios"]:
            cells = [r["request_throughput"], r["ttft_p50_ms"], r["ttft_p99_ms"],
                     r["tpot_p50_ms"], r["tpot_p99_ms"]]  # fmt: skip
            lines.append(f"| {r['engine']} | {r['workload']} | "
                         + " | ".join(_fmt(c, 2) for c in cells) + " |")  # fmt: skip
    slo = summary["slo"]
    lines += ["", f"Goodput (TTFT p99 <= {slo['ttft_p99_ms']:g} ms, TPOT p99 <= "
              f"{slo['tpot_p99_ms']:g} ms):", ""]  # fmt: skip
    for engine, g in summary["goodput"].items():
        rates = ", ".join(f"{x:g}" for x in g["rates"])
        lines.append(f"- {engine}: {g['goodput']:.2f} req/s (offered {_fmt(g['offered_rate'])}; "
                     f"rates run: {rates})")  # fmt: skip
    for engine, ratio in summary.get("goodput_ratios", {}).items():
        if ratio is not None:
            lines.append(f"- {engine} / {baseline}: {ratio:.2f}")
    if summary.get("steps"):
        lines += ["", *step_tables(summary["steps"])]
    return "\n".join(lines) + "\n"


def step_analyses(directory: Path, runs: list[dict]) -> dict[str, dict[str, dict]]:
    """{engine: {workload: step analysis}} for the runs whose engine left step traces in
    `directory` (ENGINE-steps*.jsonl, one per server start) and that carry their monotonic
    window. A run is cut from the latest trace created before the run's date (monotonic clocks
    of two machines or boots are not comparable); a run whose window holds no step is left out."""
    from phloem.bench.step_analysis import analyze, in_window

    result: dict[str, dict[str, dict]] = {}
    traces: dict[str, list[tuple[datetime, list[dict]]]] = {}
    for run in runs:
        engine, window = run["engine"], run.get("window_monotonic_s")
        if engine not in traces:
            traces[engine] = _load_traces(directory, engine)
        date = _when(run.get("date"))
        before = [t for t in traces[engine] if date is None or t[0] <= date]
        if not before or not window:
            continue
        mine = in_window(max(before, key=lambda t: t[0])[1], window[0], window[1])
        if mine:
            analysis = analyze(mine)
            analysis["edges"] = run_edges(mine, window)
            result.setdefault(engine, {})[run["workload"]] = analysis
    return result


def run_edges(steps: list[dict], window: list[float]) -> dict:
    """Where a run's client window [s] went around its engine steps (`steps`: those applied
    within it, in order): "before_first_step_s" (window start to the first step's start: the
    requests' way through client, HTTP and front), "steps_span_s" (first step's start to the last
    one's tokens), "after_last_step_s" (the last tokens to the window's end: the front and the
    client catching up), "window_s"; and "steps" and "prefill_tokens" (prompt tokens computed,
    a shared prefix computed once counts once)."""
    start, end = window
    return {
        "window_s": end - start,
        "before_first_step_s": steps[0]["t0"] - start,
        "steps_span_s": steps[-1]["t1"] - steps[0]["t0"],
        "after_last_step_s": end - steps[-1]["t1"],
        "steps": len(steps),
        "prefill_tokens": sum(s["prefill_tokens"] for s in steps),
    }


def _when(text: str | None) -> datetime | None:
    """The time of an ISO 8601 stamp (one without a zone is local time); None if unreadable."""
    try:
        return datetime.fromisoformat(text).astimezone() if text else None
    except ValueError:
        return None


def _load_traces(directory: Path, engine: str) -> list[tuple[datetime, list[dict]]]:
    """(created, steps with durations) of each ENGINE-steps*.jsonl in `directory`."""
    from phloem.bench.step_analysis import with_durations
    from phloem.bench.step_trace_file import read_step_trace

    traces = []
    for path in sorted(directory.glob(f"{engine}-steps*.jsonl")):
        header, steps = read_step_trace(path)
        created = _when(header.get("created")) or datetime.min.replace(tzinfo=UTC)
        traces.append((created, with_durations(steps)))
    return traces


def step_tables(steps: dict[str, dict[str, dict]]) -> list[str]:
    """The Markdown lines of `step_analyses`' result: one row per engine, workload and kind."""
    from phloem.bench.step_analysis import TABLE_COLUMNS, TABLE_HEADER, table_rows

    lines = ["Engine steps (from the step traces; 'ms per decode token': the kind's part of the "
             "decode-weighted step time, about the mean TPOT):", "",
             "| engine | workload " + TABLE_HEADER,
             "|---|---" + "|---" * TABLE_COLUMNS + "|"]  # fmt: skip
    for engine, runs in sorted(steps.items()):
        for workload, analysis in sorted(runs.items()):
            lines += table_rows(analysis, f"| {engine} | {workload} ")
    lines += ["", "Run edges (the client's window around the engine's steps, s):", "",
              "| engine | workload | window | before first step | steps' span | after last step "
              "| steps | prompt tokens computed |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for engine, runs in sorted(steps.items()):
        for workload, analysis in sorted(runs.items()):
            e = analysis.get("edges")
            if e:
                lines.append(f"| {engine} | {workload} | {e['window_s']:.3f} | "
                             f"{e['before_first_step_s']:.3f} | {e['steps_span_s']:.3f} | "
                             f"{e['after_last_step_s']:.3f} | {e['steps']} | "
                             f"{e['prefill_tokens']} |")  # fmt: skip
    return lines


def plot(rows: list[dict], path: Path) -> bool:
    """TTFT and TPOT p50/p99 against achieved req/s (Poisson runs); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    poisson = [r for r in rows if math.isfinite(r["offered_rate"])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (metric, label) in zip(axes, (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))):
        for engine in sorted({r["engine"] for r in poisson}):
            mine = sorted((r for r in poisson if r["engine"] == engine),
                          key=lambda r: r["request_throughput"])  # fmt: skip
            x = [r["request_throughput"] for r in mine]
            for pct, style in (("p50", "-o"), ("p99", "--s")):
                ax.plot(x, [r[f"{metric}_{pct}_ms"] for r in mine], style, label=f"{engine} {pct}")
        ax.set_xlabel("achieved request throughput (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Poisson arrivals: latency against throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def summarize_dir(directory: Path, subject: str, baseline: str, slo_ttft_ms: float,
                  slo_tpot_ms: float) -> dict:  # fmt: skip
    """The summary object of the runs in `directory` (see the module docstring)."""
    runs = load_runs(directory)
    rows = [_row(run) for run in runs]
    rows.sort(key=lambda r: (r["engine"], r["workload"], r["offered_rate"]))
    good = goodput(rows, slo_ttft_ms, slo_tpot_ms)
    summary: dict[str, Any] = {
        "subject": subject,
        "baseline": baseline,
        "slo": {"ttft_p99_ms": slo_ttft_ms, "tpot_p99_ms": slo_tpot_ms},
        "runs": rows,
        "ratios": compare(rows, subject, baseline),
        "goodput": good,
        "goodput_ratio": None,
        "goodput_ratios": {},
        "steps": step_analyses(directory, runs),
    }
    if baseline in good:
        for engine in (e for e in good if is_subject(e, subject)):
            ratio = _ratio(good[engine]["goodput"], good[baseline]["goodput"])
            summary["goodput_ratios"][engine] = ratio
        summary["goodput_ratio"] = summary["goodput_ratios"].get(subject)
    return summary


def run_serve_summary(args: argparse.Namespace) -> int:
    """The `bench serve-summary` subcommand: prints the tables, writes the three files."""
    directory = Path(args.directory)
    if not directory.is_dir():
        raise ValueError(f"directory {directory} does not exist")
    summary = summarize_dir(
        directory, args.subject, args.baseline, args.slo_ttft_ms, args.slo_tpot_ms
    )
    text = markdown(summary)
    print(text, end="")
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    (directory / "summary.md").write_text(text)
    if not plot(summary["runs"], directory / "latency_throughput.png"):
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0
