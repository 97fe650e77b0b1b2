"""Kernel profiles of engine steps (`phloem bench throughput --profile`): torch.profiler over
prefill-heavy and decode steps of a fresh copy of the workload's first requests (CUDA only)."""

from __future__ import annotations

import time
from pathlib import Path


def profile_steps(llm, workload, steps: int, path: str) -> dict:
    """Profile engine steps of a fresh copy of the workload's first requests, twice: right after
    admission (prefill-heavy steps) and once every request has its first token (decode steps).
    Writes both kernel tables to `path`; returns per phase the wall and device time per step and
    the top kernels by device time."""
    import torch

    from phloem import SamplingParams

    engine = llm.llm_engine
    n = min(workload.num_requests, engine.scheduler_config.max_num_seqs)
    # Reversed prompts: the same shapes (and shared prefixes become shared suffixes), but no
    # prefix the run just cached, so the profiled prefill steps compute their prompts.
    ids = [
        engine.add_request(p[::-1], SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
        for p, o in zip(workload.prompts[:n], workload.output_lens[:n])
    ]

    def step() -> None:
        engine.step()

    result: dict[str, dict] = {}
    tables: list[str] = []
    step()
    result["prefill_steps"] = _phase(engine, step, steps, tables, "prefill")
    for _ in range(2000):
        if _all_decoding(engine.scheduler) or not engine.has_unfinished_requests():
            break
        step()
    result["decode_steps"] = _phase(engine, step, steps, tables, "decode")
    engine.abort_request(ids)
    torch.cuda.synchronize()
    Path(path).write_text("\n\n".join(tables))
    return result


def _all_decoding(scheduler) -> bool:
    """True once no request waits and every running one has its first output token (sampled or
    pending): the next steps are pure decode. (The engine's outputs cannot say it: the offline
    engine reports a request only when it finishes.)"""
    return not scheduler.waiting and all(
        r.num_tokens > r.num_prompt_tokens for r in scheduler.running
    )


def _phase(engine, step, steps: int, tables: list[str], label: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    done = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            step()
            done += 1
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    tables.append(
        f"== {label}: {done} steps\n" + averages.table(sort_by="cuda_time_total", row_limit=30)
    )
    events = [e for e in averages if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    device_total = sum(e.self_device_time_total for e in events) / 1e3  # ms
    done = max(done, 1)
    return {
        "steps": done,
        "wall_ms_per_step_profiled": wall * 1e3 / done,
        "device_ms_per_step": device_total / done,
        "top_kernels": [
            {
                "name": e.key[:120],
                "device_ms_per_step": e.self_device_time_total / 1e3 / done,
                "share": e.self_device_time_total / 1e3 / max(device_total, 1e-9),
                "calls_per_step": e.count / done,
            }
            for e in events[:12]
        ],
    }
