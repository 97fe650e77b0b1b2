"""Job-level metrics: TTFT, TPOT, throughput and token counts of a finished batch."""

from __future__ import annotations

from collections.abc import Sequence

from phloem.outputs import RequestOutput


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> dict[str, float | None]:
    """Linear-interpolated percentiles {"p50": ..., ...}; None for an empty list."""
    if not values:
        return {f"p{q}": None for q in qs}
    ordered = sorted(values)
    result = {}
    for q in qs:
        pos = (len(ordered) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        result[f"p{q}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return result


def summarize(
    outputs: Sequence[RequestOutput],
    wall_s: float,
    num_failed_requests: int = 0,
    num_computed_prompt_tokens: int | None = None,
    planned_reuse_ratio: float = 0.0,
    load_s: float | None = None,
) -> dict:
    """The job summary (keys are the `--summary-json` schema).

    Args:
        outputs: finished requests (those that failed in the engine, `error` set, count as
            failed). wall_s: job wall time [s].
        num_failed_requests: requests that failed before reaching the engine (bad input lines).
        num_computed_prompt_tokens: prompt tokens the model actually ran (recomputation after
            preemption included; shared prefixes excluded); defaults to the logical count.
        planned_reuse_ratio: the prefix planner's predicted (logical - physical) / logical.
        load_s: the engine's start-up time [s] (`LLM.load_s`), reported when given.
    Reused prompt tokens are those taken from shared KV blocks instead of computed (a group's
    prefix, n > 1 siblings' prompt, radix-cache hits); reuse_ratio = reused / logical.
    """
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_reused = sum(o.num_cached_tokens for o in outputs)
    ttfts = [o.metrics.ttft for o in outputs if o.metrics and o.metrics.ttft is not None]
    tpots = [t for o in outputs if (t := o.tpot) is not None]
    wall = max(wall_s, 1e-9)
    summary = {
        "num_requests": len(outputs) + num_failed_requests,
        "num_failed_requests": num_failed_requests + sum(o.error is not None for o in outputs),
        "num_prompt_tokens": num_prompt,
        "num_computed_prompt_tokens": (
            num_prompt if num_computed_prompt_tokens is None else num_computed_prompt_tokens
        ),
        "num_reused_prompt_tokens": num_reused,
        "reuse_ratio": num_reused / num_prompt if num_prompt else 0.0,
        "planned_reuse_ratio": planned_reuse_ratio,
        "num_output_tokens": num_output,
        "wall_s": wall_s,
        "requests_per_s": len(outputs) / wall,
        "output_tokens_per_s": num_output / wall,
        "total_tokens_per_s": (num_prompt + num_output) / wall,
        "ttft_s": percentiles(ttfts),
        "tpot_s": percentiles(tpots),
    }
    if load_s is not None:
        summary["load_s"] = load_s
    return summary


def format_summary(summary: dict) -> str:
    """A human-readable block of the summary for the console."""

    def ms(p: dict) -> str:
        return " / ".join("-" if v is None else f"{v * 1000:.1f}" for v in p.values())

    lines = [
        f"requests:              {summary['num_requests']} ({summary['num_failed_requests']} failed)",
        f"prompt tokens:         {summary['num_prompt_tokens']} "
        f"(computed {summary['num_computed_prompt_tokens']})",
        f"prefix reuse:          {summary['num_reused_prompt_tokens']} prompt tokens reused, "
        f"ratio {summary['reuse_ratio']:.1%} (planned {summary['planned_reuse_ratio']:.1%})",
        f"output tokens:         {summary['num_output_tokens']}",
        f"wall time:             {summary['wall_s']:.2f} s",
        f"throughput:            {summary['requests_per_s']:.2f} req/s, "
        f"{summary['output_tokens_per_s']:.1f} output tok/s, "
        f"{summary['total_tokens_per_s']:.1f} total tok/s",
        f"TTFT p50/p90/p99 (ms): {ms(summary['ttft_s'])}",
        f"TPOT p50/p90/p99 (ms): {ms(summary['tpot_s'])}",
    ]
    if "load_s" in summary:  # the engine's start-up, before the wall time above
        lines.insert(4, f"load time (load_s):    {summary['load_s']:.2f} s")
    return "\n".join(lines)
