"""CPU time of the server's front per streamed token: the new tree against an older one.

The front is everything the server process does for a token once the engine core has sampled
it: read the core's `CoreStep` (msgspec over ZeroMQ), apply each request's delta (incremental
detokenization, stop strings), wake the request's consumer, build its cumulative output and
format the SSE frame of its `/v1/completions` stream (`server._in_band_errors` over
`responses.completion_chunks`), encoded to bytes as Starlette does. Not measured: HTTP parsing
and the socket writes (uvicorn's loop and protocol), and the request's preparation
(tokenization happens once per request, not per token).

The engine core is a stand-in process (`stand_in_core`) speaking the message contract: it sends
`CoreReady`, then every `--step-ms` one `CoreStep` with one new token for every request it holds,
until each has `--tokens` (finish "length"). The tokens cycle through the embedded model's
tokenization of a multilingual text (ASCII, accents, CJK, emoji: characters that span tokens),
each request from its own offset. `--streams` requests start at once. The front is the tree's
own `EngineCoreClient` with the embedded model's tokenizer; it imports `run_engine_core` from
`phloem.engine.engine_core` when it is built, and this script registers a module of that name
holding the stand-in first (both trees alike), so no model loads. Measured: `time.process_time`
of the front's process (the core is another process) from the first request to the last frame,
divided by the tokens streamed; the median over `--repeats` runs per tree, old and new
interleaved, each run in a fresh process. The new tree's front freezes its start-up objects out
of the cycle collector before the rounds, as `phloem serve` does once started (`serve._started`;
`--no-freeze-new` leaves that out).

Run from the repository root, with the old tree extracted beside it:

    git archive 28d3507 phloem | tar -x -C /tmp/old
    python benchmarks/front_path.py --old /tmp/old --json OUT.json

`--profile` (one tree, `--only new|old`) prints cProfile's top functions of one run instead.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (
    "The river runs past the old mill; naïve café owners — 東京タワーの近くで 🙂🚀 — "
    "count €5 coins. Ünïcödé ✓, 中文字符 und Straße. 👩‍💻 Then the story goes on, line by line.\n"
)
_TOKENS_ENV = "PHLOEM_FRONT_PATH_TOKENS"
_STEP_ENV = "PHLOEM_FRONT_PATH_STEP_MS"


# -- the stand-in engine core (its own process, spawned by the front's EngineCoreClient) ----------


def stand_in_core(
    args, input_path: str, output_path: str, executor_factory, step_trace=None
) -> None:
    """`run_engine_core`'s signature: one token per held request every step, no model."""
    import msgspec
    import zmq

    from phloem.engine import core_messages as m

    tokens = json.loads(Path(os.environ[_TOKENS_ENV]).read_text())
    step_s = float(os.environ[_STEP_ENV]) / 1000
    context = zmq.Context(1)
    out = context.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(output_path)
    inp = context.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.connect(input_path)
    encoder, decoder = msgspec.msgpack.Encoder(), m.core_decoder()
    out.send(encoder.encode(m.CoreReady(4096, 49152, os.getpid())))
    held: dict[str, list[int]] = {}  # request id -> [tokens sent, tokens wanted, offset]
    next_step = time.monotonic()
    while True:
        while inp.poll(max(0, int((next_step - time.monotonic()) * 1000))):
            message = decoder.decode(inp.recv())
            if isinstance(message, m.CoreShutdown):
                return
            if isinstance(message, m.CoreRequest):
                wanted = message.sampling_params["max_tokens"]
                held[message.request_id] = [0, wanted, len(held) * 7919]
            elif isinstance(message, m.CoreAbort):
                for request_id in message.request_ids:
                    held.pop(request_id, None)
        next_step += step_s
        if not held:
            continue
        deltas = []
        for request_id, state in list(held.items()):
            token = tokens[(state[2] + state[0]) % len(tokens)]
            state[0] += 1
            done = state[0] == state[1]
            seq = m.SeqDelta(0, [token], finish_reason="length" if done else None)
            deltas.append(m.RequestDelta(request_id, [seq], done))
            if done:
                del held[request_id]
        stats = m.CoreStats(len(held), 0, 1000, 1000, 0, 0, 0, 0, 0)
        out.send(encoder.encode(m.CoreStep(deltas, stats)))


# -- the front (one tree, one run, in this process) ------------------------------------------------


async def _stream(engine, front, prep, request_id: str) -> tuple[int, int]:
    """One /v1/completions stream, as server.py builds it; returns (frames, bytes)."""
    from phloem.entrypoints.openai.responses import completion_chunks
    from phloem.entrypoints.openai.server import _in_band_errors, _merged

    outputs = _merged(engine, prep, time.monotonic())
    frames = _in_band_errors(completion_chunks(front, prep, outputs, request_id, 0, 1, "final"))
    num_frames = num_bytes = 0
    async for frame in frames:
        data = frame if isinstance(frame, bytes) else frame.encode("utf-8")  # as Starlette
        num_frames += 1
        num_bytes += len(data)
    return num_frames, num_bytes


async def _round(engine, front, num_streams: int, num_tokens: int, tag: str) -> dict:
    from phloem.entrypoints.openai.responses import PreparedRequest
    from phloem.sampling_params import SamplingParams

    engine.start()
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    preps = [
        PreparedRequest([f"{tag}-{i}"], [(None, [100 + i, 200, 300, 400])], [params], None)
        for i in range(num_streams)
    ]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(
        *(_stream(engine, front, prep, prep.request_ids[0]) for prep in preps)
    )
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    tokens = num_streams * num_tokens
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "tokens": tokens,
        "frames": sum(r[0] for r in results),
        "bytes": sum(r[1] for r in results),
        "cpu_us_per_token": cpu / tokens * 1e6,
    }


def run_front(num_streams: int, num_tokens: int, profile: bool, loop: str, freeze: bool) -> dict:
    """Start the tree's front over the stand-in core; a warm-up round, then the measured one,
    on asyncio's own event loop or uvloop's (`loop`); `freeze`: start-up objects frozen out of
    the cycle collector first, as `phloem serve` now does once it has started."""
    sys.modules["phloem.engine.engine_core"] = types.ModuleType("phloem.engine.engine_core")
    sys.modules["phloem.engine.engine_core"].run_engine_core = stand_in_core  # type: ignore[attr-defined]
    from phloem.engine.core_client import EngineCoreClient
    from phloem.engine_args import EngineArgs
    from phloem.metrics_prometheus import EngineMetrics

    engine = EngineCoreClient(EngineArgs(), EngineMetrics("front-path"))
    front = types.SimpleNamespace(model_name="front-path", tokenizer=engine.tokenizer)
    if freeze:
        gc.collect()
        gc.freeze()

    async def main() -> dict:
        await _round(engine, front, 8, 16, "warm")
        if not profile:
            return await _round(engine, front, num_streams, num_tokens, "run")
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        result = await _round(engine, front, num_streams, num_tokens, "run")
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
        return result

    factory = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main())
    finally:
        engine.shutdown()


# -- the parent: trees, repeats, the table ------------------------------------------------------------


def _token_file(path: Path) -> None:
    from phloem.engine_args import EngineArgs
    from phloem.models.loader import load_tokenizer, resolve_model, startup_source

    config = EngineArgs().create_engine_config()
    tokenizer = load_tokenizer(startup_source(resolve_model(None), config.model))
    path.write_text(json.dumps(tokenizer.encode(TEXT * 4, add_special_tokens=False)))


def _child(tree: Path, args, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", str(tree), "--streams", str(args.streams),
           "--tokens", str(args.tokens), "--loop", args.loop]  # fmt: skip
    if tree == ROOT and args.freeze_new:
        cmd.append("--freeze")
    if args.profile:
        cmd.append("--profile")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=600)
    if args.profile:
        print(r.stderr, file=sys.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"front run in {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, default=None, help="a tree with the old phloem/")
    p.add_argument("--only", choices=["old", "new"], default=None)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    p.add_argument("--step-ms", type=float, default=20.0, help="the stand-in core's step time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--loop",
        choices=["asyncio", "uvloop"],
        default="asyncio",
        help="the front's event loop (the server runs uvloop when it is installed)",
    )
    p.add_argument(
        "--freeze-new",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the new tree's front freezes start-up objects (serve.py does since)",
    )
    p.add_argument("--freeze", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        sys.path.insert(0, str(args.child))
        result = run_front(args.streams, args.tokens, args.profile, args.loop, args.freeze)
        print(json.dumps(result))
        return 0
    trees = {"new": ROOT}
    if args.old is not None:
        trees["old"] = args.old.resolve()
    if args.only:
        trees = {args.only: trees[args.only]}
    token_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"front-path-tokens-{os.getpid()}.json"
    sys.path.insert(0, str(ROOT))
    _token_file(token_path)
    env = dict(os.environ, **{_TOKENS_ENV: str(token_path), _STEP_ENV: str(args.step_ms)})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(1 if args.profile else args.repeats):
        for name, tree in trees.items():
            runs[name].append(_child(tree, args, env))
            print(f"{name}: {runs[name][-1]['cpu_us_per_token']:.1f} us/token", file=sys.stderr)
    token_path.unlink()
    summary = {
        name: statistics.median(r["cpu_us_per_token"] for r in results)
        for name, results in runs.items()
    }
    record = {
        "benchmark": "front_path",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu": os.cpu_count(),
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "step_ms": args.step_ms,
        "loop": args.loop,
        "new_tree_freezes_startup_objects": args.freeze_new,
        "median_cpu_us_per_token": summary,
        "runs": runs,
    }
    if "old" in summary and "new" in summary:
        record["new_over_old"] = summary["new"] / summary["old"]
    print(json.dumps({k: record[k] for k in record if k != "runs"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
