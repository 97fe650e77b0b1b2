"""Request models of the OpenAI-compatible API (pydantic, strict) and the OpenAI error shape.

Requests are validated strictly: unknown fields and wrong JSON types are errors naming the field
(`APIError.param`), never silently coerced. Range checks are `SamplingParams.validate()`'s, so the
HTTP API and the offline API accept exactly the same values. Responses are plain dicts built in
`server.py` in OpenAI's wire format.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from phloem.chat_messages import (
    CHAT_ROLES,
    CONTENT_OPTIONAL_ROLES,
    CONTENT_PART_TYPES,
    content_text,
)
from phloem.sampling_params import SamplingParams, StructuredOutputsParams

MAX_ERROR_MESSAGE_CHARS = 500


class APIError(Exception):
    """An error with its HTTP status, rendered as `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = bound(message)
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status_code, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


def bound(message: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """Cut a message to `limit` characters (client input may be echoed in it)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


class _Strict(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are refused as the field's 400
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema` (OpenAI): the schema and its name."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (`json_schema` required)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(_Strict):
    """vLLM's `structured_outputs` request field (`StructuredOutputsParams`' names)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Strict):
    """Fields shared by both endpoints (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _constraint(self) -> StructuredOutputsParams | None:
        """The request's one structured-output constraint, checked by the grammar library; a
        400 naming the field when it is bad or when several fields set one."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                message = "response_format.json_schema is required when type is 'json_schema'"
                raise APIError(400, message, param="response_format.json_schema")
            given.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given.append(("structured_outputs", fields))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            message = f"set at most one structured-output field, got {names}"
            raise APIError(400, message, param=given[1][0])
        return _checked_constraint(*given[0])

    def _common_params(self) -> dict[str, Any]:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )
        values: dict[str, Any] = {"n": self.n}
        for name in (
            "temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "seed",
            "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos",
            "stop_token_ids", "skip_special_tokens",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        constraint = self._constraint()
        if constraint is not None:
            values["structured_outputs"] = constraint
        return values


def _checked_constraint(param: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    """`StructuredOutputsParams(**fields)` checked by the grammar library; a ValueError becomes
    a 400 naming `param` (`structured_outputs.<field>` for vLLM's object, else the request
    field that carried the constraint)."""
    from phloem.structured_output import validate_constraint

    try:
        constraint = StructuredOutputsParams.from_dict(fields)
        validate_constraint(constraint)
    except ValueError as e:
        message = str(e)
        prefix = "structured_outputs."
        if message.startswith(prefix) and param != "structured_outputs":
            message = param + message[message.index(" ") :]
        elif message.startswith(prefix):
            param = message.split(" ", 1)[0]
        raise APIError(400, message, param=param) from None
    return constraint


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)


def sampling_field_of(error: ValueError) -> str | None:
    """The SamplingParams field a ValueError from `SamplingParams.validate()` or
    `LLMEngine.validate_params` names: their messages start with it. None for other errors."""
    field = str(error).split(" ", 1)[0]
    return field if field in _SAMPLING_FIELDS else None


def make_sampling_params(values: dict[str, Any], rename: dict[str, str] | None = None):
    """SamplingParams from API values; a ValueError becomes a 400 naming the field."""
    try:
        return SamplingParams(**values)
    except ValueError as e:
        message = str(e)
        param = sampling_field_of(e)
        if param is not None and rename and param in rename:
            message = rename[param] + message[len(param) :]
            param = rename[param]
        raise APIError(400, message, param=param) from None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        values = self._common_params()
        values["max_tokens"] = max_tokens
        if self.logprobs is not None:
            if not 0 <= self.logprobs <= 20:
                raise APIError(
                    400, f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs"
                )
            values["logprobs"] = max(self.logprobs, 1)
        return make_sampling_params(values)


class TextContentPart(_Strict):
    """One content part; its accepted types are `phloem.chat_messages.CONTENT_PART_TYPES`."""

    type: Literal[CONTENT_PART_TYPES]  # type: ignore[valid-type]
    text: str


class ChatMessage(_Strict):
    """One chat message, as `phloem.chat_messages` defines it for every entry point (the same
    roles and content parts as `LLM.chat` and `phloem generate` accept)."""

    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role not in CONTENT_OPTIONAL_ROLES:
            raise ValueError(f"content is required for role {self.role!r}")
        return self

    def text(self) -> str:
        """The content as one string (`chat_messages.content_text`: parts joined, None -> "")."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return content_text(self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is not supported", param="tool_choice")
        values = self._common_params()
        values["max_tokens"] = max_tokens
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(
                    400, "top_logprobs requires logprobs to be true", param="top_logprobs"
                )
            if not 0 <= self.top_logprobs <= 20:
                raise APIError(
                    400,
                    f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                    param="top_logprobs",
                )
        if self.logprobs:
            values["logprobs"] = max(self.top_logprobs or 0, 1)
        param = "max_completion_tokens" if self.max_completion_tokens is not None else None
        return make_sampling_params(values, rename={"max_tokens": param} if param else None)


class TokenizeRequest(_Strict):
    """POST /tokenize: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def validation_error(error: ValidationError) -> APIError:
    """A 400 naming the first offending field of a pydantic error (bounded, no echoed input)."""
    errors = error.errors(include_input=False, include_url=False)
    first = errors[0]
    parts = [
        str(p)
        for p in first["loc"]
        if isinstance(p, int) or ("[" not in str(p) and str(p) not in _TYPE_TAGS)
    ]
    param = ".".join(parts) or None
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif first["type"] == "missing":
        message = f"Missing required parameter: {param}"
    else:
        message = f"Invalid value for {param}: {first['msg']}"
    others = len({e["loc"][:1] for e in errors}) - 1
    if others:
        message += f" (and {others} more error{'s' if others > 1 else ''})"
    return APIError(400, message, param=param)
