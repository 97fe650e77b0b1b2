"""Where a benchmark run's host time goes: per-step phases by step kind (a step observer of the
engine), an optional torch.profiler window over chosen steps, and Python's GC pauses."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING

from phloem.engine.step_observer import StepRecord

if TYPE_CHECKING:
    from torch.profiler import profile


class GCPauses:
    """Time the host spends in Python's cyclic garbage collector (gc.callbacks), by generation,
    while installed (`with GCPauses() as gc_pauses:`). Full collections walk every live container,
    e.g. every queued prompt's token list: long pauses here stall the step loop."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self.longest_s = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        spent = time.perf_counter() - self._start
        generation = info.get("generation", 2)
        self.seconds[generation] += spent
        self.collections[generation] += 1
        self.longest_s = max(self.longest_s, spent)

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def to_dict(self) -> dict:
        return {"pause_s": sum(self.seconds), "pause_s_by_generation": self.seconds,
                "collections": self.collections, "longest_pause_s": self.longest_s}  # fmt: skip


_PHASES = ("step", "schedule", "launch", "wait", "update")


class StepTrace:
    """Per-step host time of an engine by step kind, and on CUDA the device span of each step,
    from the engine's step observer (`LLMEngine.add_step_observer`; `close()` removes it).

    Host phases of a step (`phloem.engine.step_observer`): `schedule`, `launch` (input building,
    planning and kernel launches), `wait` (for its sampled tokens) and `update` (token
    bookkeeping and outputs); `step` is their sum. A step is "decode" when every request
    computes one token, else "mixed". On CUDA a timing event is recorded on the stream at each
    observer call, behind the kernels of the last launched step (under async scheduling the step
    after the observed one); `device_ms` is the stream time between consecutive events, so it
    includes any time the device waited for the host. Events are read in `summary()`: no syncs
    during the run.

    Args:
        engine: the `LLMEngine` to observe.
        cuda: record device events (the engine runs on a CUDA device).
        profile_window: (start, count): torch.profiler over steps [start, start + count),
            tables written to `profile_path` (default "profile-window.txt") and a Chrome trace
            beside it (`.trace.json`).
    """

    def __init__(self, engine, cuda: bool = False, profile_window: tuple[int, int] | None = None,
                 profile_path: str | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.profile_window, self.profile_path = profile_window, profile_path
        self._cuda = cuda
        self._prof: profile | None = None  # torch.profiler's, over `profile_window`
        # kind, seqs, tokens, step, schedule, launch, wait, update [s]
        self.steps: list[tuple] = []
        self._events: list = []  # (index of the step whose kernels end at the event, event)
        self._async = engine.scheduler_config.async_scheduling
        engine.add_step_observer(self.observe)

    def close(self) -> None:
        """Stop observing (the trace keeps what it recorded)."""
        self.engine.remove_step_observer(self.observe)

    def observe(self, record: StepRecord) -> None:
        """The step observer: one row per step, one device event per call."""
        sched = record.scheduler_output
        num_seqs, num_tokens = len(sched.scheduled), sched.total_num_scheduled_tokens
        kind = "decode" if num_tokens == num_seqs else "mixed"
        phases = (record.schedule_s, record.launch_s, record.wait_s, record.update_s)
        self.steps.append((kind, num_seqs, num_tokens, sum(phases), *phases))
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            # rows are numbered from the trace's start; the event ends this row's step, or
            # under async scheduling the next one's
            self._events.append((len(self.steps) - 1 + self._async, event))
        self._profile_tick(len(self.steps))

    def _profile_tick(self, index: int) -> None:
        """Start torch.profiler before step `start` of `profile_window` (counted from the
        trace's start; `index` steps are done) and stop it after step start + count - 1: host ops by self CPU time (syncs and allocations show up as long
        CUDA API calls), device time by kernel, and the timeline as a Chrome trace."""
        if self.profile_window is None:
            return
        start, count = self.profile_window
        if index == start and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * self._cuda
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        elif index == start + count and self._prof is not None:
            self._write_profile(self._prof, start, count)

    def _write_profile(self, prof: profile, start: int, count: int) -> None:
        import torch

        if self._cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        averages = prof.key_averages()
        tables = [
            f"== steps {start}..{start + count - 1}, by self CPU time\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=40),
            "== by device time\n" + averages.table(sort_by="cuda_time_total", row_limit=30),
        ]
        path = Path(self.profile_path or "profile-window.txt")
        path.write_text("\n\n".join(tables))
        # the timeline too (chrome://tracing, Perfetto, benchmarks/trace_gaps.py)
        prof.export_chrome_trace(str(path.with_suffix(".trace.json")))
        self.profile_window = None

    def _device_s(self) -> dict[int, float]:
        """Row of `steps` -> device span [s] (CUDA; synchronizes once)."""
        if not self._events:
            return {}
        import torch

        torch.cuda.synchronize()
        pairs = zip(self._events, self._events[1:])
        return {index: begin.elapsed_time(end) / 1e3 for (_, begin), (index, end) in pairs}

    def summary(self) -> dict:
        """Per step kind: steps, mean sequences and tokens, sequences per step at the 0th, 10th,
        50th, 90th and 100th percentile (`seqs_p0` ... `seqs_p100`: a batch that runs in waves,
        e.g. a KV pool holding 430 of 500 long sequences, shows as a low p10 beside a high
        p90), total seconds, mean ms per phase and `device_ms` (None off CUDA)."""
        device = self._device_s()
        out = {}
        for kind in ("decode", "mixed"):
            rows = [(i, r) for i, r in enumerate(self.steps) if r[0] == kind]
            if not rows:
                continue
            n = len(rows)
            mean = [sum(r[c] for _, r in rows) / n for c in range(1, 8)]
            spans = [device[i] for i, _ in rows if i in device]
            seqs = sorted(r[1] for _, r in rows)
            out[kind] = {
                "steps": n,
                "mean_seqs": mean[0],
                **{f"seqs_p{q}": seqs[(n - 1) * q // 100] for q in (0, 10, 50, 90, 100)},
                "mean_tokens": mean[1],
                "total_s": mean[2] * n,
                **{f"{p}_ms": m * 1e3 for p, m in zip(_PHASES, mean[2:])},
                "device_ms": sum(spans) / len(spans) * 1e3 if spans else None,
            }
        return out
