"""Where a streamed request's time to first token goes under Poisson load, hop by hop.

The server's front (`EngineCoreClient`, its asyncio side) and the engine core process run for
real; the forward pass is `serving_paced.PacedExecutor`'s step-time model of a GPU (set
`PACED_STEP_MODEL`; the default here, "4.5,20,38", fits the H200 Poisson trace of
benchmarks/results/2026-11-26d-h200-serving: decode steps of ~20 sequences ~5.4 ms, a step with
one 512-token prompt ~15 ms). Without `--http` the front is driven in this process (no HTTP);
with `--http PORT` a real `phloem serve` runs in a child process with the same executor and the
requests are streamed `/v1/completions` over `phloem.entrypoints.sse_client` (the server's ids
are matched to the client's by arrival order). Requests of `--input-len` random ids and
`--output-len` tokens arrive at Poisson times (`--rate`, `--duration`); the ones arriving in the
first second are not counted (the load ramps up). `PHLOEM_TTFT_PATH_LAUNCH="1.0,3"` makes each
launch take the host 1.0 ms + 3 us a prompt token (the H200 trace's launch_ms: ~1.0-1.3 ms for
decode steps, ~2.5-2.8 ms with one 512-token prompt); unset, the paced launch is ~free.

Per request, on the host's monotonic clock (the core process logs its steps to a file):

    submit      the front's `submit` (CoreRequest sent)
    in flight   the step the device was running then (j), and whether j+1 was already launched
    scheduled   the step k whose scheduler output first holds the request, launched at `launch`
    step end    the modelled end of k on the "device"; `collected`: the core's collect returned
    received    the front's `_on_step` applied the delta (`RequestMetrics.first_token_time`)
    consumed    the request's output iterator yielded the first output (`--http`: the client
                read the first token's SSE event; "to_client" is then collected -> consumed)

Printed: the distribution of k - j (1: the step right after the one in flight; 2: one more
step, because j+1 was built before the request came), the gaps between steps on the "device"
(a step launched after the one before it ended) and the p50 / p90 / p99 of each hop [ms].

    PACED_STEP_MODEL=4.5,20,38 python benchmarks/ttft_path.py --model DIR --rate 20 \\
        --duration 10 [--http 18084] --json OUT.json

DIR: any small model config with a tokenizer (`--load-format dummy` weights are used).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving_paced, in the core too

from serving_paced import PacedExecutor  # noqa: E402

from phloem.worker.model_runner import ModelRunnerOutput  # noqa: E402

_LOG_ENV = "PHLOEM_TTFT_PATH_LOG"
_LAUNCH_ENV = "PHLOEM_TTFT_PATH_LAUNCH"  # "BASE_ms,PER_PROMPT_TOKEN_us": host launch time
os.environ.setdefault("PACED_STEP_MODEL", "4.5,20,38")


class ProbeExecutor(PacedExecutor):
    """`PacedExecutor` that appends one JSON line per collected step to $PHLOEM_TTFT_PATH_LOG:
    launch, modelled device start and end, collection time [s, monotonic] and the ids of the
    sequences the step admitted."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self._log = open(os.environ[_LOG_ENV], "a", buffering=1)  # noqa: SIM115 - process-long
        self._index = 0
        text = os.environ.get(_LAUNCH_ENV)
        self.launch_ms = tuple(float(v) for v in text.split(",")) if text else None

    def launch(self, scheduler_output):
        if self.launch_ms is not None and not scheduler_output.is_empty:
            base_ms, per_token_us = self.launch_ms
            prompt = sum(s.num_tokens for s in scheduler_output.scheduled if s.num_tokens > 1)
            time.sleep(1e-3 * base_ms + 1e-6 * per_token_us * prompt)  # the host's launch work
        free, now = self._device_free, time.monotonic()
        launched = super().launch(scheduler_output)
        if launched is None:
            return None
        new = [s.seq_id for s in scheduler_output.scheduled if s.new_sequence is not None]
        record = {"k": self._index, "launch": now, "start": max(now, free), "end": launched[0]}
        record.update(new=new, seqs=len(scheduler_output.scheduled))
        self._index += 1
        return launched, record

    def collect(self, launched) -> ModelRunnerOutput:
        if launched is None:
            return ModelRunnerOutput()
        inner, record = launched
        output = super().collect(inner)
        record["collected"] = time.monotonic()
        self._log.write(json.dumps(record) + "\n")
        return output


async def _one(client, rid: str, at: float, ids: list[int], params, out: dict) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    submitted = time.monotonic()
    first = None
    async for output in client.submit(ids, params, rid):
        if first is None:
            first = time.monotonic()
            received = output.metrics.first_token_time
    out[rid] = {"submit": submitted, "received": received, "consumed": first}


async def _drive(client, args) -> dict:
    from phloem.sampling_params import SamplingParams

    client.start()
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    start, t, tasks, out = time.monotonic() + 0.2, 0.0, [], {}
    while t < args.duration:
        ids = [rng.randrange(1000, 20000) for _ in range(args.input_len)]
        tasks.append(_one(client, f"r{len(tasks)}", start + t, ids, params, out))
        t += rng.expovariate(args.rate)
    await asyncio.gather(*tasks)
    return {"start": start, "requests": out}


async def _one_http(target, rid: str, at: float, body: bytes, out: dict) -> None:
    from phloem.entrypoints.sse_client import stream_data_lines

    await asyncio.sleep(max(0.0, at - time.monotonic()))
    submitted, first = time.monotonic(), None
    async for data in stream_data_lines(target, "/v1/completions", body):
        if first is None and data.startswith(b"{") and b'"text"' in data:
            first = time.monotonic()
    out[rid] = {"submit": submitted, "received": None, "consumed": first}


async def _drive_http(port: int, args) -> dict:
    from phloem.entrypoints.sse_client import Target

    target = Target.from_url(f"http://127.0.0.1:{port}")
    rng = random.Random(args.seed)
    start, t, tasks, out = time.monotonic() + 0.2, 0.0, [], {}
    while t < args.duration:
        ids = [rng.randrange(1000, 20000) for _ in range(args.input_len)]
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": ids,
                "max_tokens": args.output_len,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
            }
        ).encode()
        tasks.append(_one_http(target, f"r{len(tasks):06d}", start + t, body, out))
        t += rng.expovariate(args.rate)
    await asyncio.gather(*tasks)
    return {"start": start, "requests": out}


def _serve(port: int, model: str, log: Path):
    """`phloem serve` with the probe executor in a child process, once /health answers."""
    import subprocess

    import httpx

    flags = ["--model", model, "--served-model-name", "tiny", "--port", str(port),
             "--load-format", "dummy", "--max-model-len", "2048", "--num-gpu-blocks", "20000",
             "--max-num-seqs", "1024", "--max-num-batched-tokens", "8192"]  # fmt: skip
    server = subprocess.Popen([sys.executable, __file__, "serve", *flags],
                              stdout=open(log.with_suffix(".log"), "w"), stderr=subprocess.STDOUT)  # noqa: SIM115  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start in 120 s")


def _match_by_order(steps: list[dict], result: dict) -> None:
    """Rename the client's requests to the server's ids they became: both in arrival order."""
    admitted = [rid for s in steps for rid in s["new"] if s["launch"] >= result["start"]]
    sent = sorted(result["requests"].items(), key=lambda kv: kv[1]["submit"])
    result["requests"] = {rid: r for rid, (_, r) in zip(admitted, sent)}


def _quantiles(values: list[float]) -> str:
    v = sorted(values)
    tail = (f"{v[int(q * (len(v) - 1))]:6.2f}" for q in (0.9, 0.99))
    return f"{statistics.median(v):6.2f} " + " ".join(tail)


def analyse(steps: list[dict], result: dict) -> dict:
    """Per-request hops (see the module docstring) and their summary."""
    by_seq = {rid: s for s in steps for rid in s["new"]}
    rows = []
    for rid, r in result["requests"].items():
        if r["submit"] < result["start"] + 1.0 or rid not in by_seq:
            continue
        k = by_seq[rid]
        running = [s for s in steps if s["start"] <= r["submit"] < s["end"]]
        j = running[0]["k"] if running else k["k"] - 1  # none: the device was idle
        built = any(s["k"] == j + 1 and s["launch"] <= r["submit"] for s in steps)
        rows.append({
            "k_minus_j": k["k"] - j, "next_built": built,
            "to_launch": k["launch"] - r["submit"], "launch_to_start": k["start"] - k["launch"],
            "own_step": k["end"] - k["start"], "to_collect": k["collected"] - k["end"],
        })  # fmt: skip
        if r["received"] is None:
            rows[-1]["to_client"] = r["consumed"] - k["collected"]
        else:
            rows[-1]["to_front"] = r["received"] - k["collected"]
            rows[-1]["to_consumer"] = r["consumed"] - r["received"]
        rows[-1]["ttft"] = r["consumed"] - r["submit"]
    window = [s for s in steps if result["start"] + 1.0 <= s["launch"]]
    gaps = [b["start"] - a["end"] for a, b in zip(window, window[1:])]
    hist: dict[int, int] = {}
    for row in rows:
        hist[row["k_minus_j"]] = hist.get(row["k_minus_j"], 0) + 1
    hops = [k for k in rows[0] if k not in ("k_minus_j", "next_built")] if rows else []
    summary = {h: [1e3 * row[h] for row in rows] for h in hops}
    return {"n": len(rows), "k_minus_j": dict(sorted(hist.items())),
            "next_built": sum(r["next_built"] for r in rows), "ms": summary,
            "steps": len(window), "device_busy_s": sum(s["end"] - s["start"] for s in window),
            "bubbles": sum(g > 1e-4 for g in gaps), "bubble_s": sum(g for g in gaps if g > 1e-4),
            "bubble_while_running": sum(g > 1e-4 and b["seqs"] > len(b["new"])
                                        for g, b in zip(gaps, window[1:]))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from phloem.engine.core_client import EngineCoreClient
    from phloem.engine_args import EngineArgs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rate", type=float, default=20.0, help="req/s (Poisson)")
    p.add_argument("--duration", type=float, default=10.0, help="arrivals over this many s")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http", type=int, metavar="PORT", help="through `phloem serve` on PORT")
    p.add_argument("--json", help="write the per-hop values here")
    args = p.parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="ttft-path-")) / "steps.jsonl"
    os.environ[_LOG_ENV] = str(log)
    if args.http:
        server = _serve(args.http, args.model, log)
        try:
            result = asyncio.run(_drive_http(args.http, args))
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(30)
    else:
        engine_args = EngineArgs(args.model, load_format="dummy", max_model_len=2048,
                                 num_gpu_blocks=20000, max_num_seqs=1024,
                                 max_num_batched_tokens=8192)  # fmt: skip
        client = EngineCoreClient(engine_args, executor_factory="ttft_path:ProbeExecutor")
        try:
            result = asyncio.run(_drive(client, args))
        finally:
            client.shutdown()
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    if args.http:
        _match_by_order(steps, result)
    report = analyse(steps, result)
    print(
        f"{report['n']} requests; k - j (steps after the one in flight at submit): "
        f"{report['k_minus_j']}; j+1 already launched at submit: {report['next_built']}"
    )
    print(
        f"{report['steps']} steps, device busy {report['device_busy_s']:.3f} s; gaps between "
        f"steps: {report['bubbles']} ({1e3 * report['bubble_s']:.1f} ms), "
        f"{report['bubble_while_running']} of them before a step with running sequences"
    )
    print("hop                 p50    p90    p99   [ms]")
    for hop, values in report["ms"].items():
        print(f"{hop:16s} {_quantiles(values)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **report}))
    return 0


def serve(argv: list[str]) -> int:
    """`phloem serve` with `ProbeExecutor` (the child process of `--http`)."""
    from phloem.entrypoints.cli import build_parser
    from phloem.entrypoints.serve import cmd_serve

    args = build_parser().parse_args(["serve", *argv])
    return cmd_serve(args, executor_factory="ttft_path:ProbeExecutor")


if __name__ == "__main__":
    sys.exit(serve(sys.argv[2:]) if sys.argv[1:2] == ["serve"] else main())
