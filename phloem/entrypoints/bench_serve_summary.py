"""`phloem bench serve-summary DIR`: serving runs of several engines compared, from the JSON
files `phloem bench serve --json` wrote into DIR (each labelled with `--engine` and
`--workload`; benchmarks/serving.sh writes them).

Per workload and engine: request throughput and TTFT / TPOT / ITL p50 and p99, and the ratios of
`--subject` (default phloem) to `--baseline` (default vllm) measured in the same directory (a
throughput ratio above 1 and latency ratios below 1 favour the subject). Goodput, per engine:
among its Poisson runs (finite offered rate), those whose TTFT p99 <= `--slo-ttft-ms` and TPOT
p99 <= `--slo-tpot-ms` (300 and 25 by default, issue 24's objective); the achieved req/s of the
one with the highest offered rate, 0 when none meets it. Writes DIR/summary.json,
DIR/summary.md (the tables) and DIR/latency_throughput.png (TTFT and TPOT p50 and p99 against
achieved req/s of the Poisson runs, one line per engine; needs matplotlib, else a message and no
plot).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

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


def compare(rows: list[dict], subject: str, baseline: str) -> list[dict]:
    """Per workload run by both engines: subject / baseline of throughput and each latency."""
    by_key = {(r["engine"], r["workload"]): r for r in rows}
    ratios = []
    for (engine, workload), mine in sorted(by_key.items()):
        theirs = by_key.get((baseline, workload))
        if engine != subject or theirs is None:
            continue
        entry = {"workload": workload}
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
                  "| workload | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in summary["ratios"]:
            cells = [r["request_throughput"], r["ttft_p50_ms"], r["ttft_p99_ms"],
                     r["tpot_p50_ms"], r["tpot_p99_ms"]]  # fmt: skip
            lines.append(f"| {r['workload']} | " + " | ".join(_fmt(c, 2) for c in cells) + " |")
    slo = summary["slo"]
    lines += ["", f"Goodput (TTFT p99 <= {slo['ttft_p99_ms']:g} ms, TPOT p99 <= "
              f"{slo['tpot_p99_ms']:g} ms):", ""]  # fmt: skip
    for engine, g in summary["goodput"].items():
        rates = ", ".join(f"{x:g}" for x in g["rates"])
        lines.append(f"- {engine}: {g['goodput']:.2f} req/s (offered {_fmt(g['offered_rate'])}; "
                     f"rates run: {rates})")  # fmt: skip
    if summary.get("goodput_ratio") is not None:
        lines.append(f"- {subject} / {baseline}: {summary['goodput_ratio']:.2f}")
    return "\n".join(lines) + "\n"


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
    rows = [_row(run) for run in load_runs(directory)]
    rows.sort(key=lambda r: (r["engine"], r["workload"], r["offered_rate"]))
    good = goodput(rows, slo_ttft_ms, slo_tpot_ms)
    summary = {
        "subject": subject,
        "baseline": baseline,
        "slo": {"ttft_p99_ms": slo_ttft_ms, "tpot_p99_ms": slo_tpot_ms},
        "runs": rows,
        "ratios": compare(rows, subject, baseline),
        "goodput": good,
        "goodput_ratio": None,
    }
    if subject in good and baseline in good:
        summary["goodput_ratio"] = _ratio(good[subject]["goodput"], good[baseline]["goodput"])
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
