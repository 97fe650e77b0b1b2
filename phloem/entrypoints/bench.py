"""`phloem bench throughput`: run a named synthetic workload, measure the device's ceilings in the
same run, and report throughput, latency percentiles, the roofline ratio and, with `--compare`,
a peer's throughput on the identical workload and weights.

    phloem bench throughput --model llama-3.1-8b --workload decode-heavy --num-requests 200 \
        --json benchmarks/results/decode-heavy.json --compare transformers

`--model` takes a shipped config name (random weights, `load_format="dummy"`; see
`phloem.model_configs`) or a checkpoint directory. The roofline is shared/docs/ROOFLINE.md's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from phloem.entrypoints.cli import add_engine_args, build_llm


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (throughput against the roofline)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    from phloem.entrypoints.bench_serve import register_serve_bench

    register_serve_bench(sub)
    p = sub.add_parser("throughput", help="throughput of a synthetic workload, with its roofline")
    add_engine_args(p)
    g = p.add_argument_group("workload")
    from phloem.bench.workloads import WORKLOADS

    g.add_argument("--workload", default="decode-heavy", choices=list(WORKLOADS))
    g.add_argument("--num-requests", type=int, default=None, help="scale a workload down")
    g.add_argument("--num-groups", type=int, default=None, help="prefix groups (batchllm, ...)")
    g.add_argument("--degree", type=int, default=None, help="requests per prefix group")
    g.add_argument("--input-len", type=int, default=None)
    g.add_argument("--output-len", type=int, default=None)
    g.add_argument("--prefix-len", type=int, default=None)
    g.add_argument("--suffix-len", type=int, default=None)
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="write the result object to this path")
    o.add_argument("--plot", default=None, help="draw throughput vs the roofline (PNG)")
    o.add_argument("--compare", default=None, choices=["transformers"], help="in-run peer")
    o.add_argument("--profile", default=None, help="torch.profiler top kernels -> this file")
    o.add_argument("--profile-steps", type=int, default=12)
    o.add_argument(
        "--trace-steps",
        action="store_true",
        help="time every step's host phases and GPU work (CUDA events)",
    )
    o.add_argument(
        "--profile-window",
        default=None,
        help="START:COUNT: torch.profiler over those steps of the measured run -> --profile",
    )
    p.set_defaults(func=run_throughput)


def _percentiles(values: list[float]) -> dict | None:
    """mean, p50, p90, p99 of `values` (percentiles as `phloem.engine.metrics.percentiles`
    defines them, like the job summary's); None when empty."""
    from phloem.engine.metrics import percentiles

    if not values:
        return None
    return {"mean": statistics.fmean(values), **percentiles(values, (50, 90, 99))}


def _model_dir(args: argparse.Namespace, tmp: str) -> tuple[str, bool]:
    """(checkpoint dir, is_shipped_config) for --model, applying --num-layers."""
    from phloem.model_configs import materialize, model_config_dir

    overrides = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    if args.model is not None and model_config_dir(args.model) is not None:
        return str(materialize(args.model, tmp, **overrides)), True
    if overrides:
        raise ValueError("--num-layers needs a shipped config name as --model")
    return args.model, False


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


def _generate(llm, workload) -> tuple[float, list]:
    from phloem import SamplingParams

    def params(o: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)

    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    _sync()
    start = time.perf_counter()
    if workload.sequential:
        outputs = []
        for prompt, o in zip(prompts, workload.output_lens):
            outputs += llm.generate([prompt], params(o), use_tqdm=False)
    else:
        sampling = [params(o) for o in workload.output_lens]
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
    _sync()
    return time.perf_counter() - start, outputs


class StepTrace:
    """Per-step host and device time of an engine, by step kind (wraps its methods in place).

    Host phases of one `step()` call: `schedule`, `launch` (input building, planning and kernel
    launches), `wait` (for the sampled tokens of the step being collected: the previous one
    under async scheduling) and `update` (token bookkeeping and outputs: the rest). On CUDA,
    `device_ms` is the span from the step's first kernel launch to its sampled tokens (CUDA
    events, read at the end: no extra syncs); the device is busy for all of it unless it waits
    for the host's launches. A step is "decode" when every request computes one token, else
    "mixed".
    """

    def __init__(self, engine, profile_window: tuple[int, int] | None = None,
                 profile_path: str | None = None) -> None:  # fmt: skip
        import torch

        self.profile_window, self.profile_path = profile_window, profile_path
        self._prof = None
        # (kind, seqs, tokens, step s, schedule s, launch s, wait s, update s, begin, end)
        self.steps: list[list] = []
        runner = engine.executor.worker.model_runner
        self._cuda = torch.cuda.is_available() and runner.device.type == "cuda"
        schedule, launch, collect = engine.scheduler.schedule, runner.launch, runner.collect
        step = engine.step
        state: dict = {}

        def traced_schedule():
            start = time.perf_counter()
            out = schedule()
            state["schedule"] = time.perf_counter() - start
            state["sched"] = out
            return out

        def traced_launch(sched):
            start = time.perf_counter()
            out = launch(sched)
            if self._cuda and "begin" in state:
                state["end"] = torch.cuda.Event(enable_timing=True)
                state["end"].record()
            state["launch"] = time.perf_counter() - start
            return out

        def traced_collect(launched):
            start = time.perf_counter()
            out = collect(launched)
            state["wait"] = state.get("wait", 0.0) + time.perf_counter() - start
            return out

        def mark_begin(fn):  # the step's first kernel launch starts the device clock
            def wrapped(*args, **kwargs):
                if "begin" not in state:
                    state["begin"] = torch.cuda.Event(enable_timing=True)
                    state["begin"].record()
                return fn(*args, **kwargs)

            return wrapped

        def traced_step():
            self._profile_tick(len(self.steps))
            start = time.perf_counter()
            state.clear()
            outs = step()
            total = time.perf_counter() - start
            sched = state.get("sched")
            if sched is not None and sched.scheduled:
                num_tokens = sum(x.num_tokens for x in sched.scheduled)
                kind = "decode" if num_tokens == len(sched.scheduled) else "mixed"
                host = state["schedule"] + state.get("launch", 0.0) + state.get("wait", 0.0)
                self.steps.append([kind, len(sched.scheduled), num_tokens, total,
                                   state["schedule"], state.get("launch", 0.0),
                                   state.get("wait", 0.0), total - host,
                                   state.get("begin"), state.get("end")])  # fmt: skip
            return outs

        engine.scheduler.schedule = traced_schedule
        runner.launch, runner.collect = traced_launch, traced_collect
        engine.step = traced_step
        if self._cuda:
            runner.model.forward = mark_begin(runner.model.forward)
            if runner.graph_runner is not None:
                runner.graph_runner.run = mark_begin(runner.graph_runner.run)

    def _profile_tick(self, index: int) -> None:
        """torch.profiler over steps [start, start + count) of the run (`profile_window`):
        host ops by self CPU time (syncs and allocations show up as long CUDA API calls), device
        time by kernel, and the timeline as a Chrome trace next to the tables (`.trace.json`)."""
        if self.profile_window is None:
            return
        start, count = self.profile_window
        if index == start and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * self._cuda
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        elif index == start + count and self._prof is not None:
            import torch

            if self._cuda:
                torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            averages = self._prof.key_averages()
            tables = [
                f"== steps {start}..{start + count - 1}, by self CPU time\n"
                + averages.table(sort_by="self_cpu_time_total", row_limit=40),
                "== by device time\n" + averages.table(sort_by="cuda_time_total", row_limit=30),
            ]
            path = Path(self.profile_path or "profile-window.txt")
            path.write_text("\n\n".join(tables))
            # the timeline too (chrome://tracing, Perfetto, benchmarks/trace_gaps.py)
            self._prof.export_chrome_trace(str(path.with_suffix(".trace.json")))
            self.profile_window = None

    def summary(self) -> dict:
        """Per step kind: steps, mean sequences and tokens, total and mean ms per phase."""
        import torch

        if self._cuda:
            torch.cuda.synchronize()
        for row in self.steps:
            begin, end = row[8], row[9]
            row[8] = begin.elapsed_time(end) / 1e3 if begin is not None and end else None
        out = {}
        for kind in ("decode", "mixed"):
            rows = [r for r in self.steps if r[0] == kind]
            if not rows:
                continue
            n = len(rows)
            mean = {i: sum(r[i] for r in rows) / n for i in range(1, 8)}
            device = [r[8] for r in rows if r[8] is not None]
            out[kind] = {
                "steps": n,
                "mean_seqs": mean[1],
                "mean_tokens": mean[2],
                "total_s": sum(r[3] for r in rows),
                "step_ms": mean[3] * 1e3,
                "schedule_ms": mean[4] * 1e3,
                "launch_ms": mean[5] * 1e3,
                "wait_ms": mean[6] * 1e3,
                "update_ms": mean[7] * 1e3,
                "device_ms": sum(device) / len(device) * 1e3 if device else None,
            }
        return out


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _attention_stats(llm) -> dict | None:
    """Which attention path each step took (the shared-prefix backend counts them); None for a
    backend that keeps no counters."""
    return llm.llm_engine.executor.worker.model_runner.backend.stats() or None


def _engine_info(llm) -> dict:
    worker = llm.llm_engine.executor.worker
    sched = llm.llm_engine.scheduler_config
    return {
        "device_type": worker.device.type,
        "dtype": str(worker.dtype).replace("torch.", ""),
        "kv_cache_dtype": str(worker.kv_dtype).replace("torch.", ""),
        "attention_backend": worker.model_runner.backend.name,
        "cuda_graphs": bool(getattr(worker, "cuda_graphs", False)),
        "compiled_layers": getattr(worker, "compiled_layers", 0),
        "num_kv_blocks": worker.num_blocks,
        "block_size": llm.llm_engine.config.cache.block_size,
        "kv_layout": llm.llm_engine.config.cache.kv_layout,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "async_scheduling": sched.async_scheduling,
        "max_model_len": sched.max_model_len,
    }


def _versions() -> dict:
    import torch
    import transformers

    import phloem

    out = {
        "phloem": getattr(phloem, "__version__", "?"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    try:
        import flashinfer

        out["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    return out


def _profile(llm, workload, steps: int, path: str) -> dict:
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
    seen: set[str] = set()

    def step() -> None:
        seen.update(o.request_id for o in engine.step())

    result, tables = {}, []
    step()
    result["prefill_steps"] = _profile_phase(engine, step, steps, tables, "prefill")
    for _ in range(2000):
        if len(seen) >= n or not engine.has_unfinished_requests():
            break
        step()
    result["decode_steps"] = _profile_phase(engine, step, steps, tables, "decode")
    engine.abort_request(ids)
    torch.cuda.synchronize()
    Path(path).write_text("\n\n".join(tables))
    return result


def _profile_phase(engine, step, steps: int, tables: list[str], label: str) -> dict:
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


def run_throughput(args: argparse.Namespace) -> int:
    """The `bench throughput` subcommand; prints a summary and writes --json / --plot."""
    import torch

    from phloem.bench.power import sample_power
    from phloem.bench.roofline import ModelShape, measure_ceilings, measure_sustained_ceilings
    from phloem.bench.workloads import make_workload
    from phloem.models.loader import load_hf_config, resolve_model

    tmp = tempfile.mkdtemp(prefix="phloem-bench-")
    model_dir, shipped = _model_dir(args, tmp)
    if shipped:
        args.load_format = "dummy"
    hf_config = load_hf_config(resolve_model(model_dir))
    workload = make_workload(
        args.workload,
        hf_config.vocab_size,
        seed=args.workload_seed,
        num_requests=args.num_requests,
        num_groups=args.num_groups,
        input_len=args.input_len,
        output_len=args.output_len,
        degree=args.degree,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
    )
    on_cuda = torch.cuda.is_available() and args.device != "cpu"
    ceilings = measure_ceilings() if on_cuda else None
    model_arg, args.model = args.model, model_dir
    llm = build_llm(args)
    warm = [[100 + (7 * i + j) % 900 for j in range(64)] for i in range(2)]
    llm.generate(  # warm-up (ids outside the workload's, so no prefix of it gets cached)
        [{"prompt_token_ids": p} for p in warm],
        __import__("phloem").SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    window = None
    if args.profile_window:
        window = tuple(int(x) for x in args.profile_window.split(":"))
    trace = None
    if args.trace_steps or window:
        trace = StepTrace(llm.llm_engine, window, args.profile)
    power = sample_power() if on_cuda else None
    with GCPauses() as gc_pauses, power or contextlib.nullcontext():
        elapsed, outputs = _generate(llm, workload)
    num_in = workload.num_input_tokens
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result: dict = {
        "device": torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu",
        "model": model_arg,
        "architecture": hf_config.architectures[0],
        "num_layers": hf_config.num_hidden_layers,
        "workload": workload.name,
        "shape": workload.shape,
        "num_requests": workload.num_requests,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "elapsed_s": elapsed,
        "requests_per_s": workload.num_requests / elapsed,
        "input_tokens_per_s": num_in / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "ttft_s": _percentiles([o.metrics.ttft for o in outputs if o.metrics and o.metrics.ttft]),
        "tpot_s": _percentiles([o.tpot for o in outputs if o.tpot is not None]),
        "prefix_tokens_reused": sum(o.num_cached_tokens for o in outputs) / max(num_in, 1),
        "engine": _engine_info(llm),
        "attention": _attention_stats(llm),
        "steps": trace.summary() if trace is not None else None,
        "gc": gc_pauses.to_dict(),
        "power": power.summary() if power is not None else None,
        "versions": _versions(),
        "command": "phloem " + " ".join(sys.argv[1:]),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if ceilings is not None:
        kv_dtype = llm.llm_engine.executor.worker.kv_dtype
        shape = ModelShape.from_hf(hf_config, torch.tensor([], dtype=kv_dtype).element_size())
        sustained = measure_sustained_ceilings()  # right after the run, on the GPU it heated
        result.update(
            roofline_fields(shape, workload, ceilings, sustained, elapsed, num_in + num_out)
        )
    if on_cuda:
        stats = torch.cuda.memory_stats()
        result["cuda_allocator"] = {
            k: stats.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                      "num_sync_all_streams", "num_ooms")
        }  # fmt: skip
    if args.profile and on_cuda and not window:
        result["profile"] = _profile(llm, workload, args.profile_steps, args.profile)
    _report(result)
    _write(args.json, result)  # before the peer: a slow peer must not cost phloem's numbers
    if args.compare == "transformers":
        result["peer"] = _run_peer(llm, hf_config, workload, result)
        _report({"peer": result["peer"]})
        _write(args.json, result)
    if args.plot:
        _plot(result, args.plot)
    return 0


def roofline_fields(
    shape, workload, ceilings: dict, sustained: dict, elapsed_s: float, total_tokens: int
) -> dict:
    """The JSON's roofline fields, both ratios of shared/docs/ROOFLINE.md: `ceilings` (burst,
    measured before the model loads, on a cool GPU) give `roofline_ratio`; `sustained` (the
    same matmul and copy back to back for seconds right after the run, on the GPU the run
    heated) give `roofline_ratio_sustained`, the one goals are stated against: a power-capped
    board holds a lower clock through a long run than through a short burst.
    Units: FLOP/s, bytes/s, seconds."""
    from phloem.bench.roofline import workload_roofline

    def bound(c: dict):
        return workload_roofline(shape, workload, c["flops_per_s"], c["bytes_per_s"])

    roof, roof_sustained = bound(ceilings), bound(sustained)
    return {
        "ceilings": ceilings,
        "roofline": roof.to_dict(),
        "bound_total_tokens_per_s": total_tokens / roof.bound_time_s,
        "roofline_ratio": roof.bound_time_s / elapsed_s,
        "ceilings_sustained": sustained,
        "roofline_ratio_sustained": roof_sustained.bound_time_s / elapsed_s,
    }


def _run_peer(llm, hf_config, workload, result: dict) -> dict:
    """transformers' continuous batching on phloem's weights; phloem's engine is freed first."""
    import torch

    from phloem.bench.peers import build_hf_model, hf_state_dict, run_transformers_generate_batch

    worker = llm.llm_engine.executor.worker
    device, dtype = worker.device, worker.dtype
    state = hf_state_dict(worker.model, "cpu")
    del worker
    llm.llm_engine = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        model = build_hf_model(hf_config, state, dtype, device)
        del state
        peer = run_transformers_generate_batch(model, workload)
    except Exception as e:  # the peer is context, not the measurement: record why it failed
        return {"name": "transformers", "error": f"{type(e).__name__}: {e}"}
    peer["ratio"] = result["total_tokens_per_s"] / peer["total_tokens_per_s"]
    return peer


def _write(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def _report(r: dict) -> None:
    from phloem.bench.power import CAPPED_FRACTION_OF_LIMIT

    if set(r) == {"peer"}:
        return _report_peer(r["peer"])
    lines = [
        f"device {r['device']}  model {r['model']} ({r['num_layers']} layers)  "
        f"workload {r['workload']} {r['shape']}",
        f"  {r['num_requests']} requests in {r['elapsed_s']:.2f} s: {r['requests_per_s']:.2f} req/s, "
        f"input {r['input_tokens_per_s']:.0f} tok/s, output {r['output_tokens_per_s']:.0f} tok/s, "
        f"total {r['total_tokens_per_s']:.0f} tok/s",
    ]
    for key in ("ttft_s", "tpot_s"):
        if r.get(key):
            p = r[key]
            lines.append(
                f"  {key[:-2].upper()} ms: p50 {p['p50'] * 1e3:.1f}  p90 {p['p90'] * 1e3:.1f}  "
                f"p99 {p['p99'] * 1e3:.1f}"
            )
    lines.append(f"  prefix tokens reused: {r['prefix_tokens_reused']:.1%}")
    if r.get("gc"):
        g = r["gc"]
        lines.append(
            f"  host gc: {g['pause_s']:.2f} s in {sum(g['collections'])} collections (gen 2: "
            f"{g['collections'][2]}, longest {g['longest_pause_s'] * 1e3:.0f} ms)"
        )
    power = r.get("power")
    if power and power.get("samples"):
        limit, capped = power["power_limit_w"], power["capped_fraction"]
        at_limit = "" if capped is None else (
            f" (limit {limit:.0f} W; within {1 - CAPPED_FRACTION_OF_LIMIT:.0%} of it in "
            f"{capped:.0%} of {power['samples']} samples)"
        )  # fmt: skip
        clock = power["sm_clock_mhz"]
        lines.append(
            f"  power: {power['power_w']['p50']:.0f} W median{at_limit}, SM clock "
            f"{clock['p50']:.0f} MHz median ({clock['min']:.0f}-{clock['max']:.0f})"
        )
    for kind, t in (r.get("steps") or {}).items():
        device = "" if t["device_ms"] is None else f", device {t['device_ms']:.1f}"
        lines.append(
            f"  {kind} steps: {t['steps']} x {t['mean_seqs']:.0f} seqs / {t['mean_tokens']:.0f} "
            f"tokens, {t['step_ms']:.1f} ms each (schedule {t['schedule_ms']:.1f}, launch "
            f"{t['launch_ms']:.1f}, wait {t['wait_ms']:.1f}, update {t['update_ms']:.1f}"
            f"{device}) = {t['total_s']:.1f} s"
        )
    if "roofline" in r:
        c, roof = r["ceilings"], r["roofline"]
        lines.append(
            f"  ceilings: {c['flops_per_s'] / 1e12:.0f} TFLOP/s, {c['bytes_per_s'] / 1e12:.2f} TB/s; "
            f"bound {roof['bound_time_s']:.2f} s ({roof['limiter']}) = "
            f"{r['bound_total_tokens_per_s']:.0f} total tok/s; roofline ratio {r['roofline_ratio']:.3f}"
        )
        sustained = r.get("ceilings_sustained")
        if sustained:
            lines.append(
                f"  sustained ceilings (after the run): {sustained['flops_per_s'] / 1e12:.0f} "
                f"TFLOP/s, {sustained['bytes_per_s'] / 1e12:.2f} TB/s; roofline ratio sustained "
                f"{r['roofline_ratio_sustained']:.3f} (burst {r['roofline_ratio']:.3f})"
            )
    print("\n".join(lines))


def _report_peer(peer: dict) -> None:
    if "error" in peer:
        print(f"  peer {peer['name']}: failed: {peer['error']}")
    else:
        print(
            f"  peer {peer['name']}: {peer['total_tokens_per_s']:.0f} total tok/s; "
            f"phloem / peer = {peer['ratio']:.2f}x"
        )


def _plot(r: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no plot written", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["phloem"]
    values = [r["total_tokens_per_s"]]
    if r.get("peer") and "total_tokens_per_s" in r["peer"]:
        names.append(r["peer"]["name"])
        values.append(r["peer"]["total_tokens_per_s"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, values, color="tab:green")
    if "bound_total_tokens_per_s" in r:
        ax.axhline(r["bound_total_tokens_per_s"], color="tab:red", ls="--", label="roofline bound")
        ax.legend()
    ax.set_ylabel("total tokens/s")
    ax.set_title(f"{r['workload']} on {r['device']}")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    """`python -m phloem.entrypoints.bench throughput ...`: the bench without the other
    subcommands' imports (the GPU machine lacks some of the server's dependencies)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="phloem")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
