"""Where a server's step time goes, from its step trace (`phloem.bench.step_trace_file`): step
duration by kind, each kind's share of the wall time, a linear cost model per kind, and how much
of the time a decoding sequence waits per token each kind accounts for.

Step kinds: "decode" (no prompt chunk), "prefill" (prompt chunks only), "mixed" (both).

Duration of step i: t1[i] - max(t1[i-1], t0[i]). Under async scheduling (the serving default)
step i is scheduled before step i-1 is collected, so this is the time between consecutive
collections: what a decoding sequence waits between two tokens, host work between steps
included. After an idle engine, or under synchronous scheduling, it is the step's own span
from scheduling to applied tokens; the host time between steps (sending outputs, reading
requests) then shows only in the wall-time share left to "between steps / idle".

Per kind, a least-squares fit `duration ~ a + b * tokens + c * decode_seqs`: `a` the fixed cost
of a step [ms], `b` per token computed [us], `c` per decoding sequence beyond its token (its
attention over the context, sampling, bookkeeping) [us]. A coefficient whose column is constant
or a combination of the others in that kind's steps (decode steps: tokens == decode_seqs;
prefill steps: decode_seqs == 0) is left out (None) and its cost goes to the others.

Host and device: the host phases of a step are on its line (`schedule_ms + launch_ms`, the host
time before the step is on the device; `wait_ms`, the time the host then blocked for its
tokens). A wait near zero means the device had finished first: the loop is host-bound there.

The decode-weighted step time, sum(duration * decode_seqs) / sum(decode_seqs), is the mean time a
decoding sequence waits per token (about a client's mean TPOT); split by kind, it attributes a
TPOT gap to mixed steps or to decode steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from phloem.engine.metrics import percentiles

KINDS = ("decode", "mixed", "prefill")


def step_kind(step: dict) -> str:
    """The step's kind: "decode", "mixed" or "prefill" (see the module docstring)."""
    if not step["prefill_chunks"]:
        return "decode"
    return "prefill" if not step["decode_seqs"] else "mixed"


def with_durations(steps: list[dict]) -> list[dict]:
    """The steps (in trace order) with "dur" set: the duration of the module docstring [s]."""
    previous_end = -math.inf
    for step in steps:
        step["dur"] = step["t1"] - max(previous_end, step["t0"])
        previous_end = step["t1"]
    return steps


def in_window(steps: list[dict], start: float, end: float) -> list[dict]:
    """The steps whose tokens were applied (t1) within [start, end] (monotonic [s])."""
    return [s for s in steps if start <= s["t1"] <= end]


def fit_step_time(durations_ms: Sequence[float], tokens: Sequence[float],
                  decode_seqs: Sequence[float]) -> dict | None:  # fmt: skip
    """Least squares of duration [ms] ~ a + b * tokens + c * decode_seqs.

    Returns {"a_ms", "b_us_per_token", "c_us_per_seq", "rms_ms", "r2", "n"}, a coefficient None
    when its column adds nothing (constant, or a combination of the columns before it, in the
    order 1, tokens, decode_seqs); None when there are fewer steps than coefficients + 1.
    """
    y = np.asarray(durations_ms, dtype=np.float64)
    columns = [np.ones_like(y), np.asarray(tokens, np.float64), np.asarray(decode_seqs, np.float64)]
    kept: list[int] = []
    for i in range(len(columns)):
        trial = np.stack([columns[j] for j in kept + [i]], axis=1)
        norms = np.linalg.norm(trial, axis=0)
        if norms[-1] == 0:
            continue
        if np.linalg.matrix_rank(trial / norms, tol=1e-9 * len(y)) == len(kept) + 1:
            kept.append(i)
    if len(y) < len(kept) + 1:
        return None
    x = np.stack([columns[j] for j in kept], axis=1)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    total = float(np.sum((y - y.mean()) ** 2))
    values: list[float | None] = [None, None, None]
    for j, c in zip(kept, coef):
        values[j] = float(c)
    return {
        "a_ms": values[0],
        "b_us_per_token": None if values[1] is None else values[1] * 1e3,
        "c_us_per_seq": None if values[2] is None else values[2] * 1e3,
        "rms_ms": float(np.sqrt(np.mean(residual**2))),
        "r2": 1.0 - float(np.sum(residual**2)) / total if total > 0 else None,
        "n": len(y),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _kind_summary(rows: list[dict], span_s: float, total_decode: int) -> dict:
    durs = [r["dur"] * 1e3 for r in rows]
    p = percentiles(durs, (50, 90, 99))
    host = percentiles([r["schedule_ms"] + r["launch_ms"] for r in rows], (50,))
    tokens = [r["tokens"] for r in rows]
    decode = [r["decode_seqs"] for r in rows]
    weighted = sum(r["dur"] * r["decode_seqs"] for r in rows)
    return {
        "steps": len(rows),
        "wall_share": sum(durs) / 1e3 / span_s if span_s > 0 else None,
        "dur_p50_ms": p["p50"],
        "dur_p90_ms": p["p90"],
        "dur_p99_ms": p["p99"],
        "dur_mean_ms": _mean(durs),
        "mean_tokens": _mean(tokens),
        "mean_decode_seqs": _mean(decode),
        "mean_prefill_tokens": _mean([r["prefill_tokens"] for r in rows]),
        "mean_prefill_chunks": _mean([r["prefill_chunks"] for r in rows]),
        "graph_share": sum(bool(r["graph"]) for r in rows) / len(rows),
        "host_before_launch_p50_ms": host["p50"],
        "wait_p50_ms": percentiles([r["wait_ms"] for r in rows], (50,))["p50"],
        "decode_weighted_ms": weighted * 1e3 / total_decode if total_decode else None,
        "fit": fit_step_time(durs, tokens, decode),
    }


def analyze(steps: list[dict]) -> dict:
    """The analysis of steps that carry "dur" (`with_durations`, then optionally `in_window`).

    Returns {"steps", "span_s" (first t0 to last t1), "busy_share" (sum of durations / span),
    "decode_weighted_step_ms" (None without decodes), "kinds": {kind: {"steps", "wall_share",
    "dur_p50_ms", "dur_p90_ms", "dur_p99_ms", "dur_mean_ms", "mean_tokens",
    "mean_decode_seqs", "mean_prefill_tokens", "mean_prefill_chunks", "graph_share",
    "host_before_launch_p50_ms", "wait_p50_ms", "decode_weighted_ms" (this kind's part of the
    decode-weighted step time), "fit" (`fit_step_time`)}}}; kinds without steps are left out.

    Raises:
        ValueError: when `steps` is empty.
    """
    if not steps:
        raise ValueError("no steps to analyze (an empty trace, or a window with no steps)")
    span = steps[-1]["t1"] - steps[0]["t0"]
    total_decode = sum(s["decode_seqs"] for s in steps)
    by_kind: dict[str, list[dict]] = {k: [] for k in KINDS}
    for step in steps:
        by_kind[step_kind(step)].append(step)
    kinds = {k: _kind_summary(rows, span, total_decode) for k, rows in by_kind.items() if rows}
    weighted = sum(s["dur"] * s["decode_seqs"] for s in steps)
    return {
        "steps": len(steps),
        "span_s": span,
        "busy_share": sum(s["dur"] for s in steps) / span if span > 0 else None,
        "decode_weighted_step_ms": weighted * 1e3 / total_decode if total_decode else None,
        "kinds": kinds,
    }


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_fit(fit: dict | None) -> str:
    """'a + b/token + c/seq (rms)' in ms and us, '-' for a coefficient left out."""
    if fit is None:
        return "too few steps"
    return (f"{_fmt(fit['a_ms'], 2)} ms + {_fmt(fit['b_us_per_token'], 2)} us/tok + "
            f"{_fmt(fit['c_us_per_seq'], 2)} us/seq (rms {_fmt(fit['rms_ms'], 2)} ms)")  # fmt: skip


TABLE_HEADER = (
    "| kind | steps | wall share | duration p50 / p99 (ms) | tokens | decode seqs | prefill "
    "tokens / chunks | graph | host before launch p50 (ms) | wait p50 (ms) | ms per decode token | "
    "fit |"
)
TABLE_COLUMNS = 12


def table_rows(analysis: dict, prefix: str = "") -> list[str]:
    """One Markdown row per kind of `analysis` (`TABLE_HEADER`'s columns after `prefix`, which
    holds leading cells such as "| engine | workload " for a wider table)."""
    rows = []
    for kind, k in analysis["kinds"].items():
        rows.append(
            f"{prefix}| {kind} | {k['steps']} | {_fmt(k['wall_share'] and k['wall_share'] * 100)}"
            f"% | {_fmt(k['dur_p50_ms'], 2)} / {_fmt(k['dur_p99_ms'], 2)} | "
            f"{_fmt(k['mean_tokens'])} | {_fmt(k['mean_decode_seqs'])} | "
            f"{_fmt(k['mean_prefill_tokens'])} / {_fmt(k['mean_prefill_chunks'], 2)} | "
            f"{_fmt(k['graph_share'] * 100, 0)}% | {_fmt(k['host_before_launch_p50_ms'], 2)} | "
            f"{_fmt(k['wait_p50_ms'], 2)} | {_fmt(k['decode_weighted_ms'], 2)} | "
            f"{format_fit(k['fit'])} |"
        )
    return rows


def markdown(analysis: dict, title: str) -> str:
    """`analysis` as a titled Markdown table with its totals."""
    busy = analysis["busy_share"]
    lines = [
        f"### {title}",
        "",
        f"{analysis['steps']} steps over {analysis['span_s']:.2f} s; in steps "
        f"{_fmt(busy and busy * 100)}% of the time; decode-weighted step time "
        f"{_fmt(analysis['decode_weighted_step_ms'], 2)} ms (about the mean TPOT)",
        "",
        TABLE_HEADER,
        "|" + "---|" * TABLE_COLUMNS,
        *table_rows(analysis),
    ]
    return "\n".join(lines) + "\n"
