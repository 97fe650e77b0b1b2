"""Reading a request's body and turning it into a validated request model: bounded on the event
loop, parsed and prepared in one trip to the server's preparation thread (`read_and_prepare`), with
the checks that need no tokens (`check_model`, `check_request_limits`). Every mistake is an
`APIError` (400 naming the field, 404 for an unknown model, 413 past the body limit).

One trip, because the preparation thread is one FIFO thread (`ServerState.off_loop`): with a
trip to parse and another to prepare, a burst's requests queued their second trip behind every
other request's first, so none reached the engine until the whole burst was parsed (800
token-id prompts of 1,280 tokens: ~0.3 s of an idle GPU; benchmarks/results/
2026-11-26f-cpu-serving-burst). JSON is decoded by msgspec first (~3x faster than `json.loads`
on a long token-id list); whatever msgspec refuses goes to `json.loads`, which decides as before
(NaN accepted, the same 400 messages).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from fastapi import Request
from pydantic import ValidationError

from phloem.entrypoints.openai.protocol import APIError, validation_error

if TYPE_CHECKING:
    from phloem.entrypoints.openai.server import ServerState


async def read_json(state: ServerState, request: Request, model_cls):
    """Read the body (bounded, on the loop), then parse and validate it strictly on the
    preparation thread. Raises APIError(400/413).

    The Content-Type is not checked (curl -d sends a form type): the body must be JSON.
    """
    return await state.off_loop(parse_json, await read_body(state, request), model_cls)


async def read_and_prepare(
    state: ServerState,
    request: Request,
    model_cls,
    prepare: Callable,
    num_prompts: Callable,
    start: Callable | None = None,
    undo: Callable | None = None,
):
    """Read the body (on the loop), then in ONE trip to the preparation thread parse and
    validate it (`parse_json`), check the model and the limits, `prepare(state, req)` and, with
    `start`, `start(state, prep)` (the server queues the prompts in the engine there).
    Returns (request model, `PreparedRequest`, what `start` returned or None); raises APIError
    (400/404/413) as those do. `undo(that triple)` runs on the loop when the caller is
    cancelled while the thread works (`ServerState.off_loop`): what `start` began is undone.

    One trip, so that the requests of a burst reach the engine one after another as each is
    prepared, not all after the last one is parsed (the module docstring).
    """
    chunks = await read_body(state, request)
    return await state.off_loop(
        _parse_and_prepare, state, chunks, model_cls, prepare, num_prompts, start, undo=undo
    )


def _parse_and_prepare(state: ServerState, chunks, model_cls, prepare, num_prompts, start):
    req = parse_json(chunks, model_cls)
    check_model(state, req.model)
    check_request_limits(state, req.n, num_prompts(req))
    prep = prepare(state, req)
    return req, prep, (start(state, prep) if start is not None else None)


async def read_body(state: ServerState, request: Request) -> list[bytes]:
    """The body's chunks as they arrive; 413 as soon as it passes the server's limit."""
    limit = state.limits.max_request_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return chunks


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes "
        "(--max-request-body-bytes).",
        code="request_too_large",
    )


_json_decoder = msgspec.json.Decoder()
_NOT_DECODED = object()


def parse_json(chunks: list[bytes], model_cls):
    """JSON body -> validated request model (blocking: run it off the event loop)."""
    body = b"".join(chunks)
    chunks.clear()
    try:  # msgspec: ~3x faster on a long token-id list; anything it refuses, json decides
        data = _json_decoder.decode(body)
    except Exception:  # noqa: BLE001 - the standard parser below gives the error (or a value)
        data = _NOT_DECODED
    try:
        if data is _NOT_DECODED:
            data = json.loads(body)
    except json.JSONDecodeError as e:
        raise APIError(
            400,
            f"We could not parse the JSON body of your request: {e.msg} "
            f"(line {e.lineno}, column {e.colno})",
        ) from None
    except (UnicodeDecodeError, RecursionError, ValueError) as e:
        raise APIError(
            400, f"We could not parse the JSON body of your request: {type(e).__name__}"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def check_model(state, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )


def check_request_limits(state: ServerState, n: int, num_prompts: int) -> None:
    """400s naming `n` or `prompt` past the server's limits (checked before any tokenizing)."""
    limits = state.limits
    if n > limits.max_n:
        raise APIError(
            400, f"n must be at most {limits.max_n} on this server (--max-n), got {n}", param="n"
        )
    if num_prompts > limits.max_prompts_per_request:
        raise APIError(
            400,
            f"prompt holds {num_prompts} prompts; this server takes at most "
            f"{limits.max_prompts_per_request} per request (--max-prompts-per-request)",
            param="prompt",
        )
