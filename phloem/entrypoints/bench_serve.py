"""`phloem bench serve`: latency and throughput of a running OpenAI-compatible server.

Sends `--num-prompts` streaming requests to `--base-url` (or, with `--duration S` and a finite
rate, rate x S of them), all at once (`--request-rate inf`) or as a Poisson process of the given
rate, optionally capped at `--max-concurrency` in flight, and
reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), request and token
throughput, in vLLM's `benchmark_serving` printout; `--json` writes the result object and
`--plot` draws the latency distributions (PNG, needs matplotlib).

Workloads: `--dataset FILE` (JSONL lines with "prompt" or "messages", optionally "max_tokens",
the `phloem generate` input format), or random token prompts of `--input-len` tokens with an
optional shared `--prefix-len` prefix and `--output-len` tokens each (EOS ignored).

    phloem bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8

`--wait-ready S` first waits up to S seconds for the server's `/health` to answer 200 (a server
still loading its model); `--warmup N` then sends N short requests, not measured (a first start
compiles kernels and captures graphs on its first requests). `--engine` and `--workload` are
labels written into the JSON for `phloem bench serve-summary` (bench_serve_summary.py), which
compares runs of several engines (benchmarks/serving.sh runs the whole comparison).

A server it cannot reach, or one that refuses `/v1/models` (a wrong `--api-key`), is one line
on stderr and exit status 1, before any request is sent. Requests are not logged one by one.

The measured requests stream over `sse_client` (one HTTP/1.1 connection each, the JSON bodies
encoded before the clock starts; https URLs over httpx), so that the client keeps up with ~25k
tokens a second from one process (issue 24; benchmarks/results/2026-11-26f-cpu-serving-burst).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass, field

from phloem.entrypoints.sse_client import HTTPStatusError, Target, stream_data_lines


class ServerUnavailableError(Exception):
    """The server cannot be reached or refuses the benchmark (wrong key, not OpenAI-like)."""


@dataclass
class RequestResult:
    """One request's timings [s] and token counts."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def register_serve_bench(bench_subparsers) -> None:
    """Add `serve` under `phloem bench` (call from bench.py's register with its subparsers)."""
    p = bench_subparsers.add_parser("serve", help="latency/throughput of a running server")
    add_serve_bench_args(p)
    p.set_defaults(func=run_serve_bench)
    from phloem.entrypoints.bench_serve_summary import register_serve_summary

    register_serve_summary(bench_subparsers)


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])  # fmt: skip
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default=None, help="JSONL of {prompt | messages, max_tokens?}")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--input-len", type=int, default=128, help="random prompts: tokens each")
    p.add_argument("--prefix-len", type=int, default=0, help="random prompts: shared prefix")
    p.add_argument("--output-len", type=int, default=64, help="tokens to generate per request")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s of a Poisson process; inf sends all at once")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request [s]")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="Poisson runs: send rate x DURATION requests (overrides --num-prompts)",
    )
    p.add_argument("--warmup", type=int, default=0, help="unmeasured short requests sent first")
    p.add_argument(
        "--wait-ready",
        type=float,
        default=0.0,
        help="wait up to this many seconds for /health to answer 200 first",
    )
    p.add_argument("--engine", default=None, help="label of the server's engine (JSON only)")
    p.add_argument("--workload", default=None, help="label of this run's workload (JSON only)")
    p.add_argument("--json", default=None, help="write the result object to this path")
    p.add_argument(
        "--save-requests",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="put every request's timings (inter-token latencies too) in --json",
    )
    p.add_argument("--plot", default=None, help="draw the latency distributions (PNG)")


# -- the workload ----------------------------------------------------------------------------------


def _load_dataset(path: str, num: int, output_len: int) -> list[dict]:
    items = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            item = {k: record[k] for k in ("prompt", "messages") if k in record}
            if not item:
                raise ValueError(f"{path}: each line needs 'prompt' or 'messages'")
            item["max_tokens"] = record.get("max_tokens", output_len)
            items.append(item)
    if not items:
        raise ValueError(f"{path} holds no requests")
    return [items[i % len(items)] for i in range(num)]


async def _random_workload(client, args) -> list[dict]:
    """Random-token prompts (text from the server's /detokenize, so chat can use them too)."""
    rng = random.Random(args.seed)
    low, high = 1000, 20000  # ordinary tokens of typical vocabularies; no special tokens
    prefix = [rng.randrange(low, high) for _ in range(args.prefix_len)]
    items = []
    for _ in range(args.num_prompts):
        ids = prefix + [rng.randrange(low, high) for _ in range(args.input_len - args.prefix_len)]
        if args.endpoint == "/v1/completions":
            items.append({"prompt": ids, "max_tokens": args.output_len})
            continue
        r = await client.post("/detokenize", json={"tokens": ids})
        _check_response(r)
        text = r.json()["prompt"]
        items.append({"messages": [{"role": "user", "content": text}],
                      "max_tokens": args.output_len})  # fmt: skip
    return items


def _check_response(r) -> None:
    """ServerUnavailableError naming the URL, the status and the server's message unless 200."""
    if r.status_code == 200:
        return
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    raise ServerUnavailableError(f"{r.request.url}: HTTP {r.status_code}: {message}")


async def _server_model(client, base_url: str) -> str:
    """The server's first model id; checks that it is reachable and takes our key."""
    import httpx

    try:
        r = await client.get("/v1/models")
    except httpx.TransportError as e:
        raise ServerUnavailableError(
            f"cannot reach {base_url}: {type(e).__name__}: {e or 'no answer'}"
        ) from None
    _check_response(r)
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerUnavailableError(
            f"{base_url}/v1/models: no model in {r.text[:200]!r}"
        ) from None


# -- one request ------------------------------------------------------------------------------------


async def _send(client, target: Target | None, endpoint: str, body: bytes,
                timeout: float) -> RequestResult:  # fmt: skip
    """One streamed request (`body`: its JSON, encoded before the run's clock started); its
    timings from here to the end of the response, within `timeout` seconds."""
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async with (
            asyncio.timeout(timeout),
            aclosing(_data_lines(client, target, endpoint, body)) as lines,
        ):
            async for data in lines:
                if data == b"[DONE]":
                    result.ok = result.error is None
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    continue
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
    except HTTPStatusError as e:
        result.error = f"HTTP {e.status}: {e.text}"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        result.ok = False
    result.e2e = time.perf_counter() - start
    return result


async def _data_lines(client, target: Target | None, endpoint: str, body: bytes):
    """The `data:` payloads of the response (bytes): over `sse_client` for http:// targets,
    else over httpx (https)."""
    if target is not None:
        async with aclosing(stream_data_lines(target, endpoint, body)) as lines:
            async for data in lines:
                yield data
        return
    headers = {"Content-Type": "application/json"}
    async with client.stream("POST", endpoint, content=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise HTTPStatusError(r.status_code, r.text[:200])
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                yield line[6:].encode()


# -- the run ----------------------------------------------------------------------------------------


async def _wait_ready(client, base_url: str, timeout_s: float) -> None:
    """Poll /health until it answers 200; ServerUnavailableError after `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await client.get("/health", timeout=5)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise ServerUnavailableError(f"{base_url}/health: not ready after {timeout_s:g} s")
        await asyncio.sleep(1.0)


async def _warm_up(client, target: Target | None, args, model: str) -> None:
    """`args.warmup` short requests at once, every other one sharing the first half of its
    prompt (so kernels of shared-prefix steps compile here too); other token ids than the run's,
    so the run finds nothing of them in a prefix cache."""
    rng = random.Random(args.seed + 7919)
    shared = [rng.randrange(1000, 20000) for _ in range(args.input_len // 2)]
    bodies = []
    for i in range(args.warmup):
        head = shared if i % 2 else [rng.randrange(1000, 20000) for _ in shared]
        own = [rng.randrange(1000, 20000) for _ in range(args.input_len - len(head))]
        bodies.append({"prompt": head + own, "model": model, "max_tokens": 16, "stream": True,
                       "ignore_eos": True, "temperature": 0.0})  # fmt: skip
    results = await asyncio.gather(*(_send(client, target, "/v1/completions",
                                           json.dumps(b).encode(), args.timeout)
                                     for b in bodies))  # fmt: skip
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise ServerUnavailableError(f"warm-up requests failed: {failed[0]}")


async def _run(args) -> tuple[list[RequestResult], tuple[float, float], str]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=args.timeout) as client:  # fmt: skip
        if args.wait_ready > 0:
            await _wait_ready(client, args.base_url, args.wait_ready)
        served = await _server_model(client, args.base_url)  # reachable, and the key is right
        model = args.model or served
        target = Target.from_url(args.base_url, headers)
        if args.warmup:
            await _warm_up(client, target, args, model)
        if args.dataset:
            items = _load_dataset(args.dataset, args.num_prompts, args.output_len)
        else:
            items = await _random_workload(client, args)
        results, window = await _send_all(client, target, args, items, model)
        return results, window, model


async def _send_all(client, target: Target | None, args, items: list[dict],
                    model: str) -> tuple[list, tuple]:  # fmt: skip
    """Send `items` (all at once or Poisson), return (results, (start, end)): `time.monotonic()`
    when the first request was sent and when the last one ended [s]. The bodies are encoded
    before the clock starts (the client's own work is not the server's latency)."""
    rng = random.Random(args.seed + 1)
    semaphore = asyncio.Semaphore(args.max_concurrency or len(items))
    extra = {"model": model, "stream": True, "temperature": args.temperature,
             "stream_options": {"include_usage": True}}  # fmt: skip
    if args.dataset is None:
        extra["ignore_eos"] = True
    bodies = [json.dumps({**item, **extra}).encode() for item in items]

    async def one(body: bytes) -> RequestResult:
        async with semaphore:
            return await _send(client, target, args.endpoint, body, args.timeout)

    tasks = []
    start = time.monotonic()
    for body in bodies:
        tasks.append(asyncio.create_task(one(body)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), (start, time.monotonic())


def _stats(values: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 in milliseconds (None when empty); percentiles as
    `phloem.engine.metrics.percentiles` defines them."""
    from phloem.engine.metrics import percentiles

    ms = [v * 1000 for v in values]
    p = percentiles(ms, (50, 90, 99))
    return {"mean": sum(ms) / len(ms) if ms else None, "median": p["p50"], "p90": p["p90"],
            "p99": p["p99"]}  # fmt: skip


def summarize_serve(results: list[RequestResult], window: tuple[float, float], args,
                    model: str) -> dict:  # fmt: skip
    """The result object: labels, counts, throughput, latency statistics, and
    "window_monotonic_s": `time.monotonic()` [s] when the first request was sent and when the
    last ended (the host's clock: a server's step trace on this host is cut to the run by it)."""
    ok = [r for r in results if r.ok]
    duration = window[1] - window[0]
    num_in = sum(r.prompt_tokens for r in ok)
    num_out = sum(r.output_tokens for r in ok)
    return {
        "engine": args.engine,
        "workload": args.workload,
        "model": model,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "input_len": None if args.dataset else args.input_len,
        "prefix_len": None if args.dataset else args.prefix_len,
        "output_len": args.output_len,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration,
        "window_monotonic_s": list(window),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": num_out / duration,
        "total_token_throughput": (num_in + num_out) / duration,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2e for r in ok if r.e2e is not None]),
    }


def format_serve_result(s: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.2f}"

    lines = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        f"{'Successful requests:':<40}{s['completed']:<10}",
        f"{'Failed requests:':<40}{s['failed']:<10}",
        f"{'Request rate configured (RPS):':<40}{s['request_rate']:<10}",
        f"{'Maximum request concurrency:':<40}{s['max_concurrency'] or '-'}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:<10.2f}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:<10.2f}",
        f"{'Total Token throughput (tok/s):':<40}{s['total_token_throughput']:<10.2f}",
    ]
    sections = [
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-token Latency", "ITL"),
        ("e2el_ms", "End-to-end Latency", "E2EL"),
    ]
    for key, title, short in sections:
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"),
                            ("p99", "P99")):  # fmt: skip
            lines.append(f"{f'{label} {short} (ms):':<40}{ms(s[key][stat]):<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def _plot(results: list[RequestResult], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no plot written", file=sys.stderr)
        return
    ok = [r for r in results if r.ok]
    series = [
        ("TTFT (ms)", [r.ttft * 1000 for r in ok if r.ttft is not None]),
        ("TPOT (ms)", [t * 1000 for r in ok if (t := r.tpot) is not None]),
        ("E2E latency (ms)", [r.e2e * 1000 for r in ok if r.e2e is not None]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (label, values) in zip(axes, series):
        if values:
            ordered = sorted(values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
    fig.suptitle("phloem bench serve: latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_serve_bench(args: argparse.Namespace) -> int:
    """The `bench serve` subcommand; prints the report and writes --json / --plot.
    Returns 1 if any request failed."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if not 0 <= args.prefix_len <= args.input_len:
        raise ValueError("--prefix-len must be in [0, --input-len]")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be positive (inf: all at once)")
    if args.duration is not None:
        if args.duration <= 0 or args.request_rate == float("inf"):
            raise ValueError("--duration needs a finite --request-rate and must be positive")
        args.num_prompts = max(1, round(args.request_rate * args.duration))
    if args.warmup < 0:
        raise ValueError("--warmup must be at least 0")
    for name in ("httpx", "httpcore"):  # one INFO line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        results, window, model = asyncio.run(_run(args))
    except ServerUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = summarize_serve(results, window, args, model)
    print(format_serve_result(summary))
    if summary["errors"]:
        print("errors: " + "; ".join(summary["errors"]), file=sys.stderr)
    if args.json:
        record = {
            **summary,
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if args.save_requests:
            record["requests"] = [asdict(r) for r in results]
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    if args.plot:
        _plot(results, args.plot)
    return 0 if summary["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m phloem.entrypoints.bench_serve ...` (same flags as `phloem bench serve`)."""
    parser = argparse.ArgumentParser(prog="phloem bench serve", description=__doc__)
    add_serve_bench_args(parser)
    return run_serve_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
