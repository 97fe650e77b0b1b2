"""`phloem bench throughput`: run a named synthetic workload, measure the device's ceilings in the
same run, and report throughput, latency percentiles, the roofline ratio and, with `--compare`,
a peer's throughput on the identical workload and weights.

    phloem bench throughput --model llama-3.1-8b --workload decode-heavy --num-requests 200 \
        --json benchmarks/results/decode-heavy.json --compare transformers

`--model` takes a shipped config name (random weights, `load_format="dummy"`; see
`phloem.model_configs`) or a checkpoint directory. The roofline is shared/docs/ROOFLINE.md's.
This module parses the arguments and runs the measurement; tracing, profiling and reporting
live in `phloem.bench` (`trace`, `profile`, `report`).

`--data-parallel-size N` runs the workload through N replicas (`phloem.engine.data_parallel`:
one GPU each, or N CPU processes) under `--data-parallel-routing` (prefix: the global plan's
groups; contiguous: N slices of the request list). The result then holds the cluster's and the
per-GPU throughput, the cluster-wide prompt reuse (prompt tokens computed by all replicas vs
the workload's) and the per-replica report (planned vs achieved time, makespan, imbalance).
The ceilings are measured in this process on one device (the first visible GPU, before the
replicas start; the sustained ones after they stopped, on the GPU replica 0 heated), and the
roofline of N GPUs is N times that one's: `roofline_ratio` and `roofline_ratio_sustained` are
then per-GPU ratios. Step tracing, profiles and `--compare` need one engine (N = 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import platform
import sys
import tempfile
import time

from phloem.entrypoints.cli import add_engine_args


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (throughput against the roofline)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    from phloem.entrypoints.bench_plan_scaling import register_plan_scaling
    from phloem.entrypoints.bench_serve import register_serve_bench
    from phloem.entrypoints.bench_step_trace import register_step_trace

    register_serve_bench(sub)
    register_step_trace(sub)
    register_plan_scaling(sub)
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


def _model_dir(args: argparse.Namespace, tmp: str) -> tuple[str, bool]:
    """(checkpoint dir, is_shipped_config) for --model, applying --num-layers."""
    from phloem.model_configs import materialize, model_config_dir

    overrides = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    if args.model is not None and model_config_dir(args.model) is not None:
        return str(materialize(args.model, tmp, **overrides)), True
    if overrides:
        raise ValueError("--num-layers needs a shipped config name as --model")
    return args.model, False


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


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_throughput(args: argparse.Namespace) -> int:
    """The `bench throughput` subcommand; prints a summary and writes --json / --plot.

    Raises:
        ValueError: `--trace-steps`, `--profile`, `--profile-window` or `--compare` with
            `--data-parallel-size` > 1 (they need one in-process engine), or `--compare` with
            `--tensor-parallel-size` > 1 or an FP8 run, before any load.
    """
    _check_data_parallel(args)
    import torch

    from phloem.bench import report
    from phloem.bench.power import sample_power
    from phloem.bench.roofline import measure_ceilings
    from phloem.bench.trace import GCPauses
    from phloem.engine.llm import LLM
    from phloem.engine_args import EngineArgs

    tmp = tempfile.mkdtemp(prefix="phloem-bench-")
    model_dir, shipped = _model_dir(args, tmp)
    hf_config, workload = _workload(args, model_dir)
    on_cuda = torch.cuda.is_available() and args.device != "cpu"
    engine_args = EngineArgs.from_cli_args(args)
    load_format = "dummy" if shipped else engine_args.load_format  # shipped: config only
    precision = gemm_precision(engine_args.quantization, hf_config, load_format)
    if args.compare and precision == "fp8":
        raise ValueError("--compare runs transformers on dense weights; not available with FP8")
    # here, on the first visible GPU, in the precision of the run's GEMMs
    ceilings = measure_ceilings(precision=precision) if on_cuda else None
    llm = LLM.from_engine_args(
        dataclasses.replace(engine_args, model=model_dir, load_format=load_format)
    )
    _warm_up(llm, args.data_parallel_size)
    window = tuple(int(x) for x in args.profile_window.split(":")) if args.profile_window else None
    trace = _step_trace(llm, args, window, on_cuda)
    power = sample_power() if on_cuda else None
    computed_before = llm.llm_engine.num_computed_prompt_tokens
    spec_before = report.spec_decode_counts(llm)
    with GCPauses() as gc_pauses, power or contextlib.nullcontext():
        elapsed, outputs = _generate(llm, workload)
    if trace is not None:
        trace.close()
    result = _result(llm, hf_config, workload, outputs, elapsed, on_cuda)
    computed = llm.llm_engine.num_computed_prompt_tokens - computed_before
    result.update(report.cluster_fields(result, computed, llm.last_replica_report))
    spec = report.spec_decode_counts(llm, spec_before)
    _record_run(result, args, precision, gc_pauses, trace, power, spec)
    if args.data_parallel_size > 1:
        llm.close()  # the sustained ceilings need the first GPU's memory back
    _device_fields(result, hf_config, workload, ceilings, elapsed, on_cuda)
    if args.profile and on_cuda and not window:
        from phloem.bench.profile import profile_steps

        result["profile"] = profile_steps(llm, workload, args.profile_steps, args.profile)
    _report(args, llm, hf_config, workload, result)
    return 0


def _record_run(result: dict, args, precision, gc_pauses, trace, power, spec) -> None:
    """The run's own fields of `result`: model, command, GC pauses, the GEMM precision, the step
    trace, speculative-decoding counts and the power samples (None where not taken)."""
    result.update(
        model=args.model, gc=gc_pauses.to_dict(), command="phloem " + " ".join(sys.argv[1:]),
        steps=trace.summary() if trace is not None else None, spec_decode=spec,
        power=power.summary() if power is not None else None,
    )  # fmt: skip
    result["engine"]["quantization"] = precision if precision == "fp8" else None


def _report(args: argparse.Namespace, llm, hf_config, workload, result: dict) -> None:
    """Print and write the result, then run the in-run peer (`--compare`) and the plot."""
    from phloem.bench import report

    report.print_report(result)
    report.write_json(args.json, result)  # before the peer: a slow peer must not cost phloem's
    if args.compare == "transformers":
        result["peer"] = _run_peer(llm, hf_config, workload, result)
        report.print_report({"peer": result["peer"]})
        report.write_json(args.json, result)
    if args.plot:
        report.plot(result, args.plot)


def _check_data_parallel(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for what needs one in-process engine with
    `--data-parallel-size` > 1, and for `--compare` with `--tensor-parallel-size` > 1 (the peer
    would read rank 0's weight shards only)."""
    if args.compare and args.tensor_parallel_size > 1:
        raise ValueError(
            f"--compare needs the whole model in this process; it is not available with "
            f"--tensor-parallel-size {args.tensor_parallel_size}"
        )
    if args.data_parallel_size == 1:
        return
    single = {"--trace-steps": args.trace_steps, "--profile": args.profile,
              "--profile-window": args.profile_window, "--compare": args.compare}  # fmt: skip
    for flag, value in single.items():
        if value:
            raise ValueError(
                f"{flag} needs one in-process engine; it is not available with "
                f"--data-parallel-size {args.data_parallel_size}"
            )


def _workload(args: argparse.Namespace, model_dir: str):
    """(the model's HF config, the workload of the --workload flags for its vocabulary)."""
    from phloem.bench.workloads import make_workload
    from phloem.models.loader import load_hf_config, resolve_model

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
    return hf_config, workload


def _warm_up(llm, num_replicas: int) -> None:
    """Two short requests per replica (no two share a block, so each replica gets two), on
    ids outside the workload's (so no prefix of it gets cached)."""
    from phloem import SamplingParams

    warm = [[100 + (7 * i + j) % 900 for j in range(64)] for i in range(2 * num_replicas)]
    llm.generate(
        [{"prompt_token_ids": p} for p in warm],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )


def _step_trace(llm, args: argparse.Namespace, window, on_cuda: bool):
    """The run's `StepTrace` for --trace-steps or --profile-window; None without either."""
    if not (args.trace_steps or window):
        return None
    from phloem.bench.trace import StepTrace

    cuda = on_cuda and llm.llm_engine.executor.worker.device.type == "cuda"
    return StepTrace(llm.llm_engine, cuda, window, args.profile)


def _result(llm, hf_config, workload, outputs, elapsed: float, on_cuda: bool) -> dict:
    """The result's throughput, latency and engine fields (units: seconds, tokens)."""
    import torch

    from phloem.bench import report

    num_in = workload.num_input_tokens
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.metrics.ttft for o in outputs if o.metrics and o.metrics.ttft]
    return {
        "device": torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu",
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
        "ttft_s": report.latency_summary(ttft),
        "tpot_s": report.latency_summary([o.tpot for o in outputs if o.tpot is not None]),
        "prefix_tokens_reused": sum(o.num_cached_tokens for o in outputs) / max(num_in, 1),
        "output_digest": report.output_digest(outputs),
        "engine": report.engine_info(llm),
        "attention": report.attention_stats(llm),
        "versions": report.versions(),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def gemm_precision(quantization: str | None, hf_config, load_format: str) -> str:
    """The precision of a run's linear-layer GEMMs, which its roofline is measured in: "fp8"
    for `--quantization fp8` or an FP8 checkpoint, else "bf16" (shared/docs/ROOFLINE.md).

    Raises:
        ValueError: as `phloem.layers.quantization.formats.resolve_quantization`.
    """
    from phloem.layers.quantization.formats import resolve_quantization

    quant = resolve_quantization(quantization, hf_config, load_format)
    return "bf16" if quant is None else quant.name


def roofline_num_devices(engine: dict) -> int:
    """The GPUs a run used (its roofline is that many times one's): data-parallel replicas
    times tensor-parallel ranks, from the result's "engine" settings."""
    return engine["data_parallel_size"] * engine.get("tensor_parallel_size", 1)


def _device_fields(result: dict, hf_config, workload, ceilings, elapsed: float,
                   on_cuda: bool) -> None:  # fmt: skip
    """Add the roofline fields (with the sustained ceilings measured now, on the GPU the run
    heated; for N replicas of TP ranks each, the roofline of N * TP such GPUs) and, for one
    in-process engine, the CUDA allocator's counters to `result`, on CUDA."""
    if not on_cuda:
        return
    import torch

    from phloem.bench.report import roofline_fields
    from phloem.bench.roofline import ModelShape, measure_sustained_ceilings

    engine = result["engine"]
    num_devices = roofline_num_devices(engine)
    if ceilings is not None:
        kv_dtype = getattr(torch, result["engine"]["kv_cache_dtype"])
        linear_bytes = 1 if ceilings["precision"] == "fp8" else 2
        shape = ModelShape.from_hf(
            hf_config, torch.tensor([], dtype=kv_dtype).element_size(), linear_bytes
        )
        sustained = measure_sustained_ceilings(precision=ceilings["precision"])
        result["weight_bytes"] = shape.weight_bytes
        total = result["input_tokens"] + result["output_tokens"]
        result.update(
            roofline_fields(shape, workload, ceilings, sustained, elapsed, total, num_devices)
        )
    if engine["data_parallel_size"] > 1:  # this process ran no engine
        return
    stats = torch.cuda.memory_stats()
    result["cuda_allocator"] = {
        k: stats.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                  "num_sync_all_streams", "num_ooms")
    }  # fmt: skip


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
