"""The FastAPI app of the OpenAI-compatible server: routes, API key, OpenAPI document, lifespan.

The endpoints' work is in `server.py`; this module wires it to paths and methods:

    POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize
    GET  /v1/models, /v1/models/{id}, /version, /openapi.json, /docs
    GET, HEAD  /health, /metrics   (not in the OpenAPI document: one operation per method)

With an API key, every path needs `Authorization: Bearer KEY` except `OPEN_PATHS` (/health,
/version) and /metrics unless `protect_metrics`. A method a path does not take gets 405 with
its `Allow` header.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from phloem.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from phloem.entrypoints.openai.request_body import check_model, read_json
from phloem.entrypoints.openai.server import (
    ServerState,
    create_chat_completion,
    create_completion,
    error_response,
)
from phloem.entrypoints.openai.serving import check_chars, render_chat

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/version")  # never behind the key: probes and load balancers
_REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


class APIKeyMiddleware:
    """Pure ASGI middleware (no body buffering, disconnects pass through): `Authorization:
    Bearer KEY` on every path but `open_paths`; constant-time comparison."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            if scope.get("path", "") not in self.open_paths:
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    error = APIError(
                        401,
                        "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY'.",
                        code="invalid_api_key",
                    )
                    await error_response(error)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _request_body(model_cls) -> dict:
    """`openapi_extra` of a route whose body is read by hand as `model_cls`."""
    ref = {"$ref": f"#/components/schemas/{model_cls.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_document(app: FastAPI, version: str) -> dict:
    """The OpenAPI 3 document of the routes, with the request models' JSON schemas."""
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(
        title="phloem", version=version, routes=app.routes, summary="OpenAI-compatible API"
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model_cls in _REQUEST_MODELS:
        schema = model_cls.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model_cls.__name__] = schema
    return doc


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over a (not yet started) AsyncLLMEngine; the engine starts with the app.

    `state.request_shutdown()` (serve.py calls it on SIGTERM/SIGINT) begins the drain.
    """

    @asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        state.engine.start()
        yield
        state.engine.shutdown(timeout=5.0)
        state.close()

    app = FastAPI(
        title="phloem",
        version=state.version,
        lifespan=lifespan,
        openapi_url=None,  # served below, behind the key like the API
        docs_url=None,
        redoc_url=None,
    )
    app.state.phloem = state
    state.created = int(time.time())
    _add_error_handlers(app)
    _add_generation_routes(app, state)
    _add_service_routes(app, state)
    if state.api_key:
        open_paths = OPEN_PATHS if state.protect_metrics else (*OPEN_PATHS, "/metrics")
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key, open_paths=open_paths)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's shape (`APIError`), unexpected ones as a logged 500."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/completions, /v1/chat/completions and /v1/models."""

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request):
        return await create_completion(state, request)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await create_chat_completion(state, request)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "phloem",
            "root": state.model_name,
            "parent": None,
            "max_model_len": state.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(state, model_id)
        return (await models())["data"][0]


def _add_service_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /metrics, /version, /tokenize, /detokenize, /openapi.json and /docs."""

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    async def health():
        if state.engine.is_dead:
            return error_response(APIError(503, "the engine loop has died", code="engine_dead"))
        return Response(status_code=200)

    @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
    async def metrics():
        from phloem.metrics_prometheus import CONTENT_TYPE

        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": state.version}

    @app.post("/tokenize", openapi_extra=_request_body(TokenizeRequest))
    async def tokenize(request: Request):
        req = await read_json(state, request, TokenizeRequest)
        check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "pass exactly one of 'prompt' or 'messages'", param="prompt")
        ids = await state.off_loop(_tokenize, state, req)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/detokenize", openapi_extra=_request_body(DetokenizeRequest))
    async def detokenize(request: Request):
        req = await read_json(state, request, DetokenizeRequest)
        check_model(state, req.model)
        return {"prompt": await state.off_loop(_detokenize, state, req.tokens)}

    document: dict = {}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi():
        if not document:
            document.update(openapi_document(app, state.version))
        return document

    @app.get("/docs", include_in_schema=False)
    async def docs():
        from fastapi.openapi.docs import get_swagger_ui_html

        return get_swagger_ui_html(openapi_url="/openapi.json", title="phloem - Swagger UI")


def _tokenize(state: ServerState, req: TokenizeRequest) -> list[int]:
    """/tokenize's ids (blocking: run off the event loop); prompts that cannot fit the context
    by the character bound are refused untokenized, as on the generation endpoints."""
    if req.prompt is not None:
        check_chars(state, len(req.prompt), "prompt")
        return state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    check_chars(state, sum(len(m.text()) for m in req.messages or []), "messages")
    return render_chat(state, req.messages, req.add_generation_prompt)[1]


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    """/detokenize's text (blocking: run off the event loop); ids outside the vocabulary: 400."""
    vocab = len(state.tokenizer)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"tokens holds ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens"
        )
    return state.tokenizer.decode(tokens)
