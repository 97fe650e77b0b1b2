"""`phloem serve`: the OpenAI-compatible server (FastAPI + uvicorn) over one engine.

Shutdown on SIGTERM or SIGINT: the listening socket closes at once (new connections are
refused), requests in flight run on for up to `--shutdown-timeout` seconds, streams still open
then end with an in-band error event and `data: [DONE]` (other requests with a 503), and the
process exits 0. A second SIGINT (Ctrl-C) quits at once. The process exits 1 when the engine loop
died: `/health` answers 503 and in-flight requests get their errors during a short grace period
(`--dead-engine-grace-s`), then uvicorn shuts down.

The engine core runs in its own process by default (`--engine-process`;
`phloem.engine.core_client`): this process does HTTP, tokenization, detokenization, stop strings
and SSE (on uvloop's event loop with httptools' parser when they are installed, as they are with
phloem); the core process only schedules and runs steps. `--no-engine-process` runs the engine
in a thread of this process instead (`phloem.engine.async_engine`).

`--step-trace PATH` writes one JSON line per engine step to PATH (its timing, decodes, prompt
chunks and tokens; `phloem.bench.step_trace_file`), flushed every 256 steps and at shutdown;
`phloem bench step-trace PATH` reads it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import signal
import sys

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    """Add `phloem serve` to the CLI."""
    from phloem.entrypoints.cli import add_engine_args

    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /version and "
        "/metrics",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="with --api-key, put /metrics behind the key too (Prometheus then needs it)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: --model)"
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    add_limit_args(p)
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process (default); --no-engine-process runs it "
        "in a thread of the server process",
    )
    p.add_argument(
        "--step-trace",
        default=None,
        metavar="PATH",
        help="write one JSON line per engine step to PATH (read it with `phloem bench "
        "step-trace PATH`)",
    )
    p.add_argument("--dead-engine-grace-s", type=float, default=2.0, help=argparse.SUPPRESS)
    # Online requests often leave max_tokens at the whole context; reserving it up front would
    # cap concurrency at a handful of requests, so serving admits by the blocks needed now and
    # preempts (recomputes) when they run out, as vLLM does.
    add_engine_args(p, memory_centric_admission=False)
    p.set_defaults(func=cmd_serve)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `ServerLimits` field (`--max-n` for `max_n`), its default and help."""
    from phloem.entrypoints.openai.limits import limit_fields

    g = parser.add_argument_group("limits")
    for flag, f in limit_fields():
        g.add_argument(
            flag,
            type=type(f.default),
            default=f.default,
            help=f"{f.metadata['help']} (default {f.default})",
        )


def server_limits(args: argparse.Namespace):
    """The validated `ServerLimits` of the parsed flags (ValueError naming the flag)."""
    from phloem.entrypoints.openai.limits import ServerLimits, limit_fields

    limits = ServerLimits(**{f.name: getattr(args, f.name) for _, f in limit_fields()})
    try:
        limits.validate()
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise ValueError(f"--{name.replace('_', '-')}{str(e)[len(name) :]}") from None
    return limits


def build_state(args: argparse.Namespace, on_death=None, executor_factory: str | None = None):
    """Start the engine of the parsed flags (its own process, or a thread with
    `--no-engine-process`) and wrap it for serving; returns the server state.

    Args:
        args: flags parsed by the `serve` parser.
        on_death: called on the event loop with the exception if the engine loop dies.
        executor_factory: "module:attribute" of `LLMEngine`'s executor factory (None: the
            default executor); tests name one that injects faults (tests/entrypoints/
            fault_server.py). The engine core process imports it.
    Raises:
        ValueError: naming the flag or setting, for invalid values (also
            `--data-parallel-size` > 1: the server serves one engine).
        RuntimeError: the engine core process failed to start.
    """
    import phloem
    from phloem.engine_args import EngineArgs
    from phloem.entrypoints.openai.limits import max_prompt_chars
    from phloem.entrypoints.openai.server import ServerState
    from phloem.entrypoints.openai.serving import default_model_name
    from phloem.metrics_prometheus import EngineMetrics

    limits = server_limits(args)
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.data_parallel_size != 1:
        raise ValueError(
            f"--data-parallel-size {engine_args.data_parallel_size}: phloem serve runs one "
            "engine; start one server per replica behind a load balancer instead"
        )
    name = args.served_model_name or default_model_name(args.model)
    metrics = EngineMetrics(name)
    if args.engine_process:
        from phloem.engine.core_client import EngineCoreClient

        engine = EngineCoreClient(
            engine_args, metrics, on_death, executor_factory, step_trace=args.step_trace
        )
        tokenizer = copy.deepcopy(engine.tokenizer)
    else:
        engine = _thread_engine(engine_args, metrics, on_death, executor_factory, args.step_trace)
        tokenizer = copy.deepcopy(engine.tokenizer)
    return ServerState(
        engine=engine,
        model_name=name,
        tokenizer=tokenizer,
        metrics=metrics,
        api_key=args.api_key,
        version=phloem.__version__,
        limits=limits,
        max_prompt_chars=max_prompt_chars(tokenizer, engine.max_model_len),
        protect_metrics=args.protect_metrics,
    )


def _thread_engine(engine_args, metrics, on_death, executor_factory: str | None,
                   step_trace: str | None = None):  # fmt: skip
    """The in-thread engine (`--no-engine-process`); its step trace, if any, is closed at exit."""
    from phloem.engine.async_engine import AsyncLLMEngine
    from phloem.engine.engine_core import import_factory
    from phloem.engine.llm_engine import LLMEngine, OutputMode

    factory = import_factory(executor_factory) if executor_factory else None
    config = engine_args.create_engine_config("serve")
    engine = LLMEngine(config, executor_factory=factory, output_mode=OutputMode.STREAM)
    if step_trace is not None:
        import atexit

        from phloem.bench.step_trace_file import StepTraceFile

        atexit.register(StepTraceFile.for_engine(step_trace, engine).close)
    return AsyncLLMEngine(engine, metrics=metrics, on_death=on_death)


def cmd_serve(args: argparse.Namespace, executor_factory: str | None = None) -> int:
    """Run the server until shutdown; returns the exit status (1 if the engine loop died or the
    server never started). `executor_factory`: as `build_state`."""
    import asyncio

    import uvicorn

    from phloem.entrypoints.openai.app import build_app

    class Server(uvicorn.Server):
        """uvicorn's server, telling the app when a shutdown signal comes (uvicorn itself only
        stops accepting and waits for connections to close)."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            state.request_shutdown()

        def stop_serving(self) -> None:
            """Shut down as uvicorn does on its exit flag (the engine loop died)."""
            self.should_exit = True

    holder: dict = {}

    def on_death(error: BaseException) -> None:
        holder["dead"] = error
        server = holder.get("server")
        if server is not None:
            logger.error(
                "engine loop died (%s); shutting down in %.1f s", error, args.dead_engine_grace_s
            )
            asyncio.get_running_loop().call_later(args.dead_engine_grace_s, server.stop_serving)

    try:
        state = build_state(args, on_death, executor_factory)
    except RuntimeError as e:  # the engine core process failed to start
        print(f"error: {e}", file=sys.stderr)
        return 1
    server = Server(_uvicorn_config(build_app(state), args, state))
    holder["server"] = server
    _started(state, args)
    # uvicorn re-raises the signal it shut down for once it restores the handlers it found: with
    # these, a drained shutdown exits 0 instead of dying of the signal (143 / 130).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _after_shutdown)
    server.run()
    if "dead" in holder:
        print(f"error: the engine loop died: {holder['dead']}", file=sys.stderr)
        return 1
    if not server.started:
        return 1
    return 0


def _started(state, args: argparse.Namespace) -> None:
    """Start-up is done: freeze what it built out of the cycle collector, print where we serve.

    What start-up built (modules, the app, the tokenizer) lives as long as the server; frozen,
    the collections that load sets off walk only what requests made.
    """
    gc.collect()
    gc.freeze()
    where = f"engine core pid {state.engine.pid}" if args.engine_process else "engine thread"
    print(
        f"phloem: serving {state.model_name} on http://{args.host}:{args.port} "
        f"(max_model_len {state.engine.max_model_len}, {where})",
        file=sys.stderr,
        flush=True,
    )


def _uvicorn_config(app, args: argparse.Namespace, state):
    import uvicorn

    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        # the app ends what is left at --shutdown-timeout; this backstop is never reached
        # unless a response hangs after its request was ended
        timeout_graceful_shutdown=int(state.limits.shutdown_timeout) + 30,
        timeout_keep_alive=30,
        backlog=4096,
        # "auto" (uvicorn's default, said here because it matters): uvloop's event loop and
        # httptools' HTTP parser, dependencies of phloem, else asyncio's loop and h11
        loop="auto",
        http="auto",
    )


def _after_shutdown(sig, frame) -> None:
    """The signal uvicorn re-raises after a graceful shutdown: the drain is done; ignore it."""
