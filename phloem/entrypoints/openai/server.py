"""The OpenAI-compatible server's request handling: read, check, generate, answer (OpenAI format).

`app.py` maps the routes to these functions, `serving.py` turns a request into token ids and
sampling parameters (shared with run-batch), `responses.py` formats what they answer, and
`limits.py` holds what one request may ask.

Every client mistake is a 4xx in OpenAI's error shape (`protocol.APIError`); a 5xx means the
server failed (non-finite logits: 500 for that request only; a dead engine loop: 503, and
`/health` turns 503). A request is aborted as soon as its client disconnects, streaming or not,
so its KV blocks return to the pool and, if it was still waiting, it never runs.

Bodies are read and parsed by `request_body.py` (not by FastAPI) so that malformed JSON, wrong
types and unknown fields all get the same bounded 400 naming the field. Nothing heavy runs on
the event loop: the body is read there (bounded by `ServerLimits.max_request_body_bytes`, else
413), then parsed, checked (`n`, prompt count, prompt characters against `limits.py`'s bound),
validated and tokenized in one trip to one worker thread (`ServerState.off_loop`). A prepared
generation request is queued in the engine at once, before its response starts (`_start`): on
that thread itself when the engine allows it (`_start_early`), since the thread's result waits a
loop round behind the rest of a burst before the handler sees it.

Shutdown (SIGTERM/SIGINT, `serve.py`): uvicorn stops accepting; in-flight requests run on for
`shutdown_timeout` seconds; then those left get `ServerShuttingDownError` (in-band for streams,
before `data: [DONE]`; 503 otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from phloem.engine.engine_client import EngineClient, EngineDeadError, RequestFailedError
from phloem.entrypoints.openai.limits import ServerLimits
from phloem.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_field_of,
)
from phloem.entrypoints.openai.request_body import read_and_prepare
from phloem.entrypoints.openai.responses import (
    PreparedRequest,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    sse,
    stream_usage_mode,
)
from phloem.entrypoints.openai.serving import (
    prepare_chat,
    prepare_completion,
)

logger = logging.getLogger(__name__)


class ServerShuttingDownError(RuntimeError):
    """The server is shutting down and its drain timeout has passed; the request was ended."""


_ENGINE_ERRORS = (EngineDeadError, RequestFailedError, ServerShuttingDownError, ValueError)


@dataclass
class ServerState:
    """The server's engine, tokenizer and settings, plus its shutdown state (event loop only)."""

    engine: EngineClient  # the core's process (EngineCoreClient), or an in-thread AsyncLLMEngine
    model_name: str
    tokenizer: Any  # the front's own copy: the streams (or the engine thread) decode with theirs
    metrics: Any = None
    api_key: str | None = None
    version: str = "0"
    created: int = 0
    limits: ServerLimits = field(default_factory=ServerLimits)
    max_prompt_chars: int | None = None  # limits.max_prompt_chars; None: no bound
    protect_metrics: bool = False  # /metrics behind the API key too
    draining: bool = False  # a shutdown signal came: in-flight requests run on
    closed: bool = False  # the drain timeout passed: requests left were ended
    loop: asyncio.AbstractEventLoop | None = None  # the app's loop, set when it starts
    _prep: ThreadPoolExecutor | None = None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.engine.validate_prompt(prompt_token_ids)

    async def off_loop(self, fn, *args, undo: Callable[[Any], None] | None = None):
        """`fn(*args)` on the request-preparation thread (parsing, validation, tokenization,
        and queueing a prepared request in an engine that `submits_from_any_thread`).

        One thread: the front's tokenizer is never used by two threads at once (HF fast
        tokenizers raise "Already borrowed" when they are), and it releases the GIL while it
        encodes, so the event loop keeps serving streams and /health meanwhile. With `undo`,
        a caller cancelled before `fn` returned does not lose its result: `undo(result)` runs
        on the loop once `fn` returns (a request it queued is aborted, not leaked).
        """
        if self._prep is None:
            self._prep = ThreadPoolExecutor(1, thread_name_prefix="phloem-prep")
        future = asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)
        if undo is None:
            return await future
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else undo(f.result())
            )
            raise

    def request_shutdown(self) -> None:
        """Begin the drain from a signal handler or another thread (no-op before start)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.begin_shutdown)

    def begin_shutdown(self) -> None:
        """A shutdown signal came (on the event loop): uvicorn stops accepting connections;
        requests in flight get `limits.shutdown_timeout` seconds, then `end_in_flight`."""
        if self.draining:
            return
        self.draining = True
        timeout = self.limits.shutdown_timeout
        logger.warning("shutting down: in-flight requests get up to %.0f s to finish", timeout)
        asyncio.get_running_loop().call_later(timeout, self.end_in_flight)

    def end_in_flight(self) -> None:
        """End every request still running: each gets `ServerShuttingDownError`."""
        self.closed = True
        error = ServerShuttingDownError(
            f"the server is shutting down and its drain timeout "
            f"({self.limits.shutdown_timeout:g} s) has passed; the request was ended"
        )
        num = self.engine.abort_all(error)
        if num:
            logger.warning("ended %d request(s) still running at the drain timeout", num)

    def close(self) -> None:
        if self._prep is not None:
            self._prep.shutdown(wait=False, cancel_futures=True)
            self._prep = None


# -- helpers --------------------------------------------------------------------------------------


def error_response(error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers)


def _num_prompts(prompt) -> int:
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def engine_error(error: BaseException) -> APIError:
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), code="engine_dead")
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), code="request_failed")
    if isinstance(error, ServerShuttingDownError):
        return APIError(503, str(error), code="server_shutting_down")
    if isinstance(error, ValueError):  # the engine's prompt or sampling-parameter checks
        return APIError(400, str(error), param=sampling_field_of(error) or "prompt")
    return APIError(500, f"internal error: {type(error).__name__}")


async def wait_disconnect(request: Request) -> None:
    """Return when the client has gone (the body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- the endpoints' core --------------------------------------------------------------------------


def _start(engine: EngineClient, prep: PreparedRequest, arrival: float):
    """Queue every prompt of `prep` in the engine now (`submit`): their output iterators, in
    prompt order. On an error the prompts already queued are aborted and the error raised
    (ValueError, EngineDeadError)."""
    gens: list = []
    try:
        for rid, (text, ids), params in zip(prep.request_ids, prep.prompts, prep.params):
            gens.append(engine.submit(ids, params, rid, text, arrival))
    except BaseException:
        for rid in prep.request_ids[: len(gens)]:
            engine.abort(rid)
        raise
    return gens


async def _merged(engine: EngineClient, prep: PreparedRequest,
                  arrival: float, gens: list | BaseException):  # fmt: skip
    """Yield (prompt index, RequestOutput) from all prompts of one API request as they come
    (`gens`: `_start`'s iterators, or the error `_start` raised, raised here).

    Outputs are cumulative, so only each prompt's newest matters: one pump task per prompt
    keeps it in `newest` (never waiting on this consumer), and the consumer takes what is there
    in prompt order. A slow reader thus holds at most one output per prompt, and no engine
    stream waits for it. Leaving early aborts every prompt's request, read or not.
    """
    if isinstance(gens, BaseException):
        raise gens
    try:
        if len(gens) == 1:
            async for output in gens[0]:
                yield 0, output
        else:
            async for item in _merge_many(gens):
                yield item
    finally:
        for rid in prep.request_ids:  # no-op for the finished; forgets the never read
            engine.abort(rid)


async def _merge_many(gens: list):
    """`_merged`'s pumps for several prompts."""
    newest: dict[int, Any] = {}
    errors: list[BaseException] = []
    news = asyncio.Event()
    running = len(gens)

    async def pump(index: int, gen) -> None:
        nonlocal running
        try:
            async for output in gen:
                newest[index] = output
                news.set()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            errors.append(e)
        finally:
            running -= 1
            news.set()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        while newest or running:
            await news.wait()
            news.clear()
            ready = sorted(newest.items())
            newest.clear()
            for index, output in ready:
                yield index, output
            if errors:
                raise errors[0]
        if errors:
            raise errors[0]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Started:
    """A request's prompts queued by the preparation thread (`_start_early`)."""

    gens: list | BaseException  # `_start`'s iterators, or the engine error it raised
    arrival: float  # [s, time.monotonic] when they were queued


def _start_early(state: ServerState, prep: PreparedRequest) -> _Started | None:
    """On the preparation thread, right after `prep` is made: queue its prompts in the engine
    (`_start_or_error`) if the engine takes requests from any thread and the server is open,
    else None (the handler queues them on the loop). Why: the thread's result comes back to
    the handler one loop round later, behind the rest of a burst's reads and responses: on a
    2-core CPU the first of 800 requests reached the core 0.19-0.31 s after the client began
    instead of 0.08 s (benchmarks/results/2026-11-27h-cpu-burst-trace)."""
    if not state.engine.submits_from_any_thread or state.draining or state.closed:
        return None
    arrival = time.monotonic()
    return _Started(_start_or_error(state, prep, arrival), arrival)


def _undo_early(state: ServerState, prepared) -> None:
    """Abort what `_start_early` queued for `read_and_prepare`'s result `prepared` (its
    handler is gone, or the server closed meanwhile)."""
    _, prep, started = prepared
    if started is not None and not isinstance(started.gens, BaseException):
        for rid in prep.request_ids:
            state.engine.abort(rid)


async def _read_and_start(state: ServerState, request: Request, model_cls, prepare, num_prompts):
    """`read_and_prepare` with the prompts queued on the preparation thread where the engine
    allows (`_start_early`), else here on the loop; the server must still be open (else what
    the thread queued is aborted). Returns (request model, prep, arrival [s], `_start`'s
    iterators or its engine error)."""
    prepared = await read_and_prepare(
        state,
        request,
        model_cls,
        prepare,
        num_prompts,
        start=_start_early,
        undo=lambda p: _undo_early(state, p),
    )
    req, prep, started = prepared
    try:
        _check_open(state)
    except BaseException:
        _undo_early(state, prepared)
        raise
    if started is None:
        arrival = time.monotonic()
        return req, prep, arrival, _start_or_error(state, prep, arrival)
    return req, prep, started.arrival, started.gens


def _start_or_error(state: ServerState, prep: PreparedRequest, arrival: float):
    """`_start`, or the engine error it raised (a stream reports it in-band, as before)."""
    try:
        return _start(state.engine, prep, arrival)
    except _ENGINE_ERRORS as e:
        return e


async def _collect(state: ServerState, prep: PreparedRequest, arrival: float, gens):
    finals: list = [None] * len(prep.request_ids)
    async for index, output in _merged(state.engine, prep, arrival, gens):
        finals[index] = output
    return finals


async def _run_or_disconnect(request: Request, coro):
    """Await `coro`; if the client disconnects first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _final_outputs(
    state: ServerState, request: Request, prep: PreparedRequest, arrival, gens
):
    """The final RequestOutput of each of `prep`'s requests (in order), or None when the client
    disconnected first (its requests are aborted). Engine errors become their HTTP errors.
    `gens`: as `_merged`'s."""
    try:
        return await _run_or_disconnect(request, _collect(state, prep, arrival, gens))
    except _ENGINE_ERRORS as e:
        raise engine_error(e) from None
    finally:  # a disconnect before `_collect` ran never entered `_merged`: queued, never read
        for rid in prep.request_ids:  # (no-op for the finished)
            state.engine.abort(rid)


class _EngineStream(StreamingResponse):
    """A StreamingResponse that calls `on_end()` once it is over, however it ended (its
    requests were queued in the engine before it started: `_start`)."""

    def __init__(self, content, on_end: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


def _stream_response(state: ServerState, request: Request, chunks: AsyncIterator[str], ids):
    """SSE response whose request ids are aborted if the client goes away.

    Starlette already listens for the client's disconnect while it streams and cancels this
    body when it comes; a second listener on the same connection would race it for ASGI
    messages, so the abort rides on that cancellation (`finally`). A response that ends before
    its body began (a client gone before the headers) aborts them when it ends (`_EngineStream`).
    Aborting a request that has finished is a no-op.
    """
    completed = False

    def abort_unless_completed() -> None:
        if not completed:
            for request_id in ids:
                state.engine.abort(request_id)

    async def body():
        nonlocal completed
        try:
            async for chunk in chunks:
                yield chunk
            completed = True
        finally:
            abort_unless_completed()
            await chunks.aclose()  # type: ignore[attr-defined]

    return _EngineStream(
        body(),
        abort_unless_completed,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# -- completions ----------------------------------------------------------------------------------


def _check_open(state: ServerState) -> None:
    if state.closed:
        raise engine_error(ServerShuttingDownError("the server is shutting down"))


async def create_completion(state: ServerState, request: Request):
    req, prep, arrival, gens = await _read_and_start(
        state, request, CompletionRequest, prepare_completion, lambda r: _num_prompts(r.prompt)
    )
    created = int(time.time())
    response_id = (
        prep.request_ids[0].rsplit("-", 1)[0] if len(prep.request_ids) > 1 else prep.request_ids[0]
    )
    n = req.n
    if req.stream:
        usage = stream_usage_mode(req)
        outputs = _merged(state.engine, prep, arrival, gens)
        chunks = _in_band_errors(
            completion_chunks(state, prep, outputs, response_id, created, n, usage)
        )
        return _stream_response(state, request, chunks, prep.request_ids)
    finals = await _final_outputs(state, request, prep, arrival, gens)
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(completion_response(state, prep, finals, response_id, created))


async def _in_band_errors(frames):
    """Pass SSE frames through; once headers are sent, errors are reported in-band, and the
    stream always ends with [DONE] (a cancelled stream just stops)."""
    try:
        async for frame in frames:
            yield frame
    except asyncio.CancelledError:
        raise
    except _ENGINE_ERRORS as e:
        yield sse(engine_error(e).body())
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
        logger.exception("stream failed")
        yield sse(APIError(500, f"internal error: {type(e).__name__}").body())
    yield sse("[DONE]")


# -- chat -----------------------------------------------------------------------------------------


async def create_chat_completion(state: ServerState, request: Request):
    req, prep, arrival, gens = await _read_and_start(
        state, request, ChatCompletionRequest, prepare_chat, lambda r: 1
    )
    created = int(time.time())
    if req.stream:
        usage = stream_usage_mode(req)
        outputs = _merged(state.engine, prep, arrival, gens)
        chunks = _in_band_errors(chat_chunks(state, prep, outputs, created, usage))
        return _stream_response(state, request, chunks, prep.request_ids)
    finals = await _final_outputs(state, request, prep, arrival, gens)
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(chat_response(state, prep, finals, created))
