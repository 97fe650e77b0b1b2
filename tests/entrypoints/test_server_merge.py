"""`server._merged`, the outputs of a request's several prompts: a slow consumer gets each
prompt's newest output (at most one pending per prompt, nothing queued per step), every prompt's
last output, and a prompt's error; leaving early aborts every prompt's request. A streamed
completion is queued in the engine before its response starts (issue 24: a burst's requests
reached the core only as their responses started, one loop round after another), and a response
that ends before its body began aborts it. Where the engine allows, the preparation thread
queues it (its result reached the handler a loop round later, behind the rest of a burst), and
a handler cancelled meanwhile aborts what the thread queued."""

from __future__ import annotations

import asyncio
import threading

import pytest

from phloem.entrypoints.openai.responses import PreparedRequest
from phloem.entrypoints.openai.server import _merged, _start
from phloem.sampling_params import SamplingParams


class _Engine:
    """`generate` yields `steps` cumulative outputs (ints 1..steps), one per loop turn;
    `submit` records the request (queued at the call) and returns the same iterator."""

    max_model_len = 64
    submits_from_any_thread = False

    def __init__(self, steps: int, fail: str | None = None) -> None:
        self.steps, self.fail = steps, fail
        self.submitted: list[str] = []
        self.threads: list[str] = []  # the thread each submit ran on
        self.aborted: list[str] = []
        self.read: list[str] = []  # requests whose outputs someone began to read

    def submit(self, ids, params, request_id, prompt, arrival):
        self.submitted.append(request_id)
        self.threads.append(threading.current_thread().name)
        return self.generate(ids, params, request_id, prompt, arrival)

    def abort(self, request_id, error=None) -> None:
        self.aborted.append(request_id)

    def validate_prompt(self, ids) -> None:
        pass

    async def generate(self, ids, params, request_id, prompt, arrival):
        self.read.append(request_id)
        for step in range(1, self.steps + 1):
            await asyncio.sleep(0)
            if request_id == self.fail and step == 3:
                raise RuntimeError("failed")
            yield step


def _prep(num: int) -> PreparedRequest:
    ids = [f"r-{i}" for i in range(num)]
    return PreparedRequest(ids, [(None, [1])] * num, [SamplingParams()] * num, None)


def _queued(engine, prep: PreparedRequest):
    """`_merged` over `prep`'s prompts queued now, as the server's handlers queue them."""
    return _merged(engine, prep, 0.0, _start(engine, prep, 0.0))


def test_slow_consumer_gets_the_newest_and_the_last() -> None:
    async def consume():
        seen = []
        async for index, output in _queued(_Engine(200), _prep(3)):
            seen.append((index, output))
            await asyncio.sleep(0.002)  # slower than the engine
        return seen

    seen = asyncio.run(consume())
    for index in range(3):
        mine = [output for i, output in seen if i == index]
        assert mine == sorted(mine) and mine[-1] == 200
    assert len(seen) < 3 * 50  # coalesced: nowhere near one item per step


def test_error_of_one_prompt_is_raised() -> None:
    async def consume():
        async for _ in _queued(_Engine(10, fail="r-1"), _prep(2)):
            pass

    with pytest.raises(RuntimeError, match="failed"):
        asyncio.run(consume())


def test_leaving_early_aborts_every_prompt() -> None:
    engine = _Engine(100)

    async def consume():
        async for index, _ in _queued(engine, _prep(3)):
            if index == 0:
                break

    asyncio.run(consume())
    assert engine.submitted == ["r-0", "r-1", "r-2"]
    assert sorted(engine.aborted) == ["r-0", "r-1", "r-2"]


def test_a_stream_is_queued_before_its_response_starts() -> None:
    from fastapi import Request

    from phloem.entrypoints.openai.server import ServerState, create_completion

    engine = _Engine(5)
    state = ServerState(engine=engine, model_name="m", tokenizer=None)
    body = b'{"prompt": [5, 6, 7], "max_tokens": 4, "stream": true}'

    async def run() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                 "asgi": {"version": "3.0", "spec_version": "2.4"}}  # fmt: skip
        response = await create_completion(state, Request(scope, receive))
        assert len(engine.submitted) == 1 and not engine.aborted  # queued, not yet streamed

        async def send(message):
            raise OSError("the client is gone")  # before the headers: the body never starts

        with pytest.raises(Exception):  # noqa: B017 - Starlette's ClientDisconnect
            await response(scope, receive, send)

    try:
        asyncio.run(run())
    finally:
        state.close()
    assert engine.read == [] and engine.aborted == engine.submitted


class _ThreadSafeEngine(_Engine):
    submits_from_any_thread = True


def _completion_request(body: bytes):
    from fastapi import Request

    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "asgi": {"version": "3.0", "spec_version": "2.4"}}  # fmt: skip
    return Request(scope, receive)


@pytest.mark.parametrize("engine_cls", [_Engine, _ThreadSafeEngine])
def test_the_preparation_thread_queues_where_the_engine_allows(engine_cls) -> None:
    from phloem.entrypoints.openai.server import ServerState, create_completion

    engine = engine_cls(3)
    state = ServerState(engine=engine, model_name="m", tokenizer=None)
    body = b'{"prompt": [5, 6, 7], "max_tokens": 3, "stream": true}'

    async def run() -> None:
        await create_completion(state, _completion_request(body))

    try:
        asyncio.run(run())
    finally:
        state.close()
    assert len(engine.submitted) == 1
    on_prep_thread = engine.threads[0].startswith("phloem-prep")
    assert on_prep_thread is engine_cls.submits_from_any_thread


def test_a_handler_cancelled_while_the_thread_queues_aborts_the_request() -> None:
    from phloem.entrypoints.openai.protocol import CompletionRequest
    from phloem.entrypoints.openai.server import ServerState, _read_and_start
    from phloem.entrypoints.openai.serving import prepare_completion

    engine = _ThreadSafeEngine(3)
    state = ServerState(engine=engine, model_name="m", tokenizer=None)
    entered, release = threading.Event(), threading.Event()

    def prepare(st, req):
        entered.set()
        release.wait(5)
        return prepare_completion(st, req)

    async def run() -> None:
        body = b'{"prompt": [5, 6, 7], "max_tokens": 3}'
        task = asyncio.ensure_future(
            _read_and_start(
                state, _completion_request(body), CompletionRequest, prepare, lambda r: 1
            )  # fmt: skip
        )
        while not entered.is_set():
            await asyncio.sleep(0.001)
        task.cancel()  # the client went away while its request was being prepared
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(500):  # the thread queues it, then the loop undoes it
            if engine.aborted:
                break
            await asyncio.sleep(0.002)

    try:
        asyncio.run(run())
    finally:
        state.close()
    assert len(engine.submitted) == 1 and engine.aborted == engine.submitted
