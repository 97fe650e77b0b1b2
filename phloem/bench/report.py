"""What `phloem bench throughput` reports: the result's summary fields (latency percentiles, the
engine's settings, versions, both roofline ratios), the printed summary, the JSON file and the
plot. Pure formatting over a result dict, except `engine_info`/`versions` that read the run."""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path


def latency_summary(values: list[float]) -> dict | None:
    """mean, p50, p90, p99 of `values` (percentiles as `phloem.engine.metrics.percentiles`
    defines them, like the job summary's); None when empty."""
    from phloem.engine.metrics import percentiles

    if not values:
        return None
    return {"mean": statistics.fmean(values), **percentiles(values, (50, 90, 99))}


def attention_stats(llm) -> dict | list | None:
    """Which attention path each step took (the shared-prefix backend counts them); None for a
    backend that keeps no counters. With data-parallel replicas: each replica's counters, as a
    list (from the last batch's report)."""
    from phloem.engine.data_parallel import DataParallelEngine

    engine = llm.llm_engine
    if isinstance(engine, DataParallelEngine):
        return engine.last_report.attention if engine.last_report is not None else None
    return engine.executor.worker.model_runner.backend.stats() or None


def engine_info(llm) -> dict:
    """The settings the run's engine resolved (device, dtypes, backend, KV pool, step limits);
    with data-parallel replicas, replica 0's plus their number and routing."""
    from phloem.engine.data_parallel import DataParallelEngine

    engine = llm.llm_engine
    if isinstance(engine, DataParallelEngine):
        return {**engine.replica_engines[0], "data_parallel_size": engine.num_replicas,
                "data_parallel_routing": engine.routing}  # fmt: skip
    worker = llm.llm_engine.executor.worker
    sched = llm.llm_engine.scheduler_config
    return {
        "device_type": worker.device.type,
        "dtype": str(worker.dtype).replace("torch.", ""),
        "kv_cache_dtype": str(worker.kv_dtype).replace("torch.", ""),
        "attention_backend": worker.model_runner.backend.name,
        "cuda_graphs": worker.cuda_graphs,
        "piecewise_cuda_graphs": worker.model_runner.piecewise_runner is not None,
        "compiled_layers": worker.compiled_layers,
        "num_kv_blocks": worker.num_blocks,
        "block_size": llm.llm_engine.config.cache.block_size,
        "kv_layout": llm.llm_engine.config.cache.kv_layout,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "async_scheduling": sched.async_scheduling,
        "max_model_len": sched.max_model_len,
        "data_parallel_size": 1,
        "tensor_parallel_size": llm.llm_engine.config.parallel.tensor_parallel_size,
    }


def spec_decode_counts(llm, before: dict | None = None) -> dict | None:
    """Speculative decoding's counters (`SpecDecodeStats.as_dict`: verify rows, drafted and
    accepted tokens, steps, acceptance rate, mean accepted length; the verify steps that
    replayed a full CUDA graph, `num_verify_graph_replays`; and the drafter's host costs,
    `Drafter.counters`: syncs, proposals, seconds in `may_draft` and `propose`), less `before`
    (an earlier call's dict: the run's own share); None without speculative decoding (or with
    data-parallel replicas, which keep theirs)."""
    from phloem.engine.data_parallel import DataParallelEngine
    from phloem.spec_decode.drafter import SpecDecodeStats

    engine = llm.llm_engine
    if isinstance(engine, DataParallelEngine) or engine.drafter is None:
        return None
    counts = engine.drafter.stats.as_dict()
    verify = engine.executor.worker.model_runner.verify_runner
    replays = "num_verify_graph_replays"
    counts[replays] = 0 if verify is None else verify.num_replays
    host = engine.drafter.counters()
    counts.update(host)
    if before is None:
        return counts
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_spec_steps")
    delta = SpecDecodeStats(*(counts[k] - before[k] for k in keys)).as_dict()
    for key in (replays, *host):
        delta[key] = counts[key] - before[key]
    return delta


def output_digest(outputs) -> str:
    """A short hash of every output's token ids, in input order: equal digests, equal outputs
    (DP = 1 against DP = N on one workload)."""
    import hashlib

    ids = [list(c.token_ids) for o in outputs for c in o.outputs]
    return hashlib.sha256(repr(ids).encode()).hexdigest()[:16]


def cluster_fields(result: dict, num_computed_prompt_tokens: int, replica_report) -> dict:
    """The result's cluster fields: prompt tokens computed (by every replica) and the
    cluster-wide reuse ratio (1 - computed / the workload's prompt tokens); with data-parallel
    replicas (`replica_report` not None) also the per-GPU throughput (the cluster's over N) and
    the `data_parallel` object (`ReplicaReport.to_dict`: per-replica planned vs achieved time,
    makespan, imbalance). Units: tokens, requests/s, tokens/s."""
    num_in = result["input_tokens"]
    out = {
        "num_computed_prompt_tokens": num_computed_prompt_tokens,
        "prompt_reuse_ratio": 1 - num_computed_prompt_tokens / num_in if num_in else 0.0,
    }
    if replica_report is None:
        return out
    n = len(replica_report.replicas)
    keys = ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s")
    out.update({f"{k}_per_gpu": result[k] / n for k in keys})
    out["data_parallel"] = replica_report.to_dict()
    return out


def versions() -> dict:
    """Versions of phloem, torch, CUDA, transformers, Python (and FlashInfer if installed)."""
    import torch
    import transformers

    import phloem

    out = {
        "phloem": phloem.__version__,
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


def roofline_fields(
    shape,
    workload,
    ceilings: dict,
    sustained: dict,
    elapsed_s: float,
    total_tokens: int,
    num_devices: int = 1,
) -> dict:
    """The JSON's roofline fields, both ratios of shared/docs/ROOFLINE.md: `ceilings` (burst,
    measured before the model loads, on a cool GPU) give `roofline_ratio`; `sustained` (the
    same matmul and copy back to back for seconds right after the run, on the GPU the run
    heated) give `roofline_ratio_sustained`, the one goals are stated against: a power-capped
    board holds a lower clock through a long run than through a short burst. The ceilings are
    one device's; the roofline of `num_devices` devices (data-parallel replicas times
    tensor-parallel ranks) is
    `num_devices` times that one's, so both ratios are then per-device ratios.
    Units: FLOP/s, bytes/s, seconds."""
    from phloem.bench.roofline import workload_roofline

    def bound(c: dict):
        n = num_devices
        return workload_roofline(shape, workload, n * c["flops_per_s"], n * c["bytes_per_s"])

    roof, roof_sustained = bound(ceilings), bound(sustained)
    return {
        "ceilings": ceilings,
        "roofline_num_devices": num_devices,
        "roofline": roof.to_dict(),
        "bound_total_tokens_per_s": total_tokens / roof.bound_time_s,
        "roofline_ratio": roof.bound_time_s / elapsed_s,
        "ceilings_sustained": sustained,
        "roofline_ratio_sustained": roof_sustained.bound_time_s / elapsed_s,
    }


def write_json(path: str | None, result: dict) -> None:
    """Write `result` as indented JSON to `path` (folders made as needed); None: nothing."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def print_report(r: dict) -> None:
    """Print a result's summary (a result holding only "peer": the peer's line)."""
    if set(r) == {"peer"}:
        return print_peer(r["peer"])
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
    lines.append(
        f"  prefix tokens reused: {r['prefix_tokens_reused']:.1%}; prompt tokens computed "
        f"{r['num_computed_prompt_tokens']} of {r['input_tokens']} (reuse "
        f"{r['prompt_reuse_ratio']:.1%})"
    )
    lines += _data_parallel_lines(r)
    if r.get("gc"):
        g = r["gc"]
        lines.append(
            f"  host gc: {g['pause_s']:.2f} s in {sum(g['collections'])} collections (gen 2: "
            f"{g['collections'][2]}, longest {g['longest_pause_s'] * 1e3:.0f} ms)"
        )
    lines += _power_lines(r.get("power")) + _step_lines(r.get("steps")) + _roofline_lines(r)
    print("\n".join(lines))


def _data_parallel_lines(r: dict) -> list[str]:
    dp = r.get("data_parallel")
    if not dp:
        return []
    lines = [
        f"  {dp['num_replicas']} replicas ({dp['routing']} routing): per GPU "
        f"{r['requests_per_s_per_gpu']:.2f} req/s, {r['total_tokens_per_s_per_gpu']:.0f} total "
        f"tok/s; makespan {dp['makespan_s']:.2f} s, imbalance planned "
        f"{dp['planned_imbalance']:.3f}, achieved {dp['achieved_imbalance']:.3f}; "
        f"{dp['num_split_groups']} groups split"
    ]
    for s in dp["replicas"]:
        lines.append(
            f"    replica {s['replica']}: {s['num_requests']} requests, {s['num_groups']} groups, "
            f"{s['achieved_s']:.2f} s, {s['num_computed_prompt_tokens']} prompt tokens computed"
        )
    return lines


def _power_lines(power: dict | None) -> list[str]:
    from phloem.bench.power import CAPPED_FRACTION_OF_LIMIT

    if not power or not power.get("samples"):
        return []
    limit, capped = power["power_limit_w"], power["capped_fraction"]
    at_limit = "" if capped is None else (
        f" (limit {limit:.0f} W; within {1 - CAPPED_FRACTION_OF_LIMIT:.0%} of it in "
        f"{capped:.0%} of {power['samples']} samples)"
    )  # fmt: skip
    clock = power["sm_clock_mhz"]
    return [
        f"  power: {power['power_w']['p50']:.0f} W median{at_limit}, SM clock "
        f"{clock['p50']:.0f} MHz median ({clock['min']:.0f}-{clock['max']:.0f})"
    ]


def _step_lines(steps: dict | None) -> list[str]:
    lines = []
    for kind, t in (steps or {}).items():
        device = "" if t["device_ms"] is None else f", device {t['device_ms']:.1f}"
        lines.append(
            f"  {kind} steps: {t['steps']} x {t['mean_seqs']:.0f} seqs / {t['mean_tokens']:.0f} "
            f"tokens, {t['step_ms']:.1f} ms each (schedule {t['schedule_ms']:.1f}, launch "
            f"{t['launch_ms']:.1f}, wait {t['wait_ms']:.1f}, update {t['update_ms']:.1f}"
            f"{device}) = {t['total_s']:.1f} s"
        )
    return lines


def _roofline_lines(r: dict) -> list[str]:
    if "roofline" not in r:
        return []
    c, roof = r["ceilings"], r["roofline"]
    n = r.get("roofline_num_devices", 1)
    devices = f" (one device; the roofline is of {n} such, ratios per device)" if n > 1 else ""
    lines = [
        f"  ceilings{devices}: {c['flops_per_s'] / 1e12:.0f} TFLOP/s, "
        f"{c['bytes_per_s'] / 1e12:.2f} TB/s; "
        f"bound {roof['bound_time_s']:.2f} s ({roof['limiter']}) = "
        f"{r['bound_total_tokens_per_s']:.0f} total tok/s; roofline ratio {r['roofline_ratio']:.3f}"
    ]
    sustained = r.get("ceilings_sustained")
    if sustained:
        lines.append(
            f"  sustained ceilings (after the run): {sustained['flops_per_s'] / 1e12:.0f} "
            f"TFLOP/s, {sustained['bytes_per_s'] / 1e12:.2f} TB/s; roofline ratio sustained "
            f"{r['roofline_ratio_sustained']:.3f} (burst {r['roofline_ratio']:.3f})"
        )
    return lines


def print_peer(peer: dict) -> None:
    """Print the peer's line: its throughput and phloem's ratio to it, or why it failed."""
    if "error" in peer:
        print(f"  peer {peer['name']}: failed: {peer['error']}")
    else:
        print(
            f"  peer {peer['name']}: {peer['total_tokens_per_s']:.0f} total tok/s; "
            f"phloem / peer = {peer['ratio']:.2f}x"
        )


def plot(r: dict, path: str) -> None:
    """Bar chart of phloem's (and the peer's) total tokens/s against the roofline bound, as a
    PNG at `path`; prints a note instead when matplotlib is missing."""
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
