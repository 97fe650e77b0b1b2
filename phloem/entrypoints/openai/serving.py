"""OpenAI request preparation, shared by the server and `phloem run-batch`: a validated
completion or chat request becomes token ids and sampling parameters (`PreparedRequest`), every
client mistake a 400 in OpenAI's shape naming the field (`protocol.APIError`).

Blocking (tokenization, chat templates): the server runs it on its preparation thread. Imports
no web framework, so batch jobs do not load one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from phloem import chat_messages
from phloem.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from phloem.entrypoints.openai.responses import PreparedRequest


@dataclass
class Frontend:
    """What request preparation needs (a ServerState, or run-batch's own): the tokenizer, the
    context length, the engine's prompt check and the served name."""

    tokenizer: Any
    max_model_len: int
    validate_prompt: Any
    model_name: str
    max_prompt_chars: int | None = None  # limits.max_prompt_chars; None: no bound


def check_context(
    front, num_prompt: int, max_tokens: int | None, prompt_param: str, max_tokens_param: str
) -> int:
    """The max_tokens to use. A 400 naming `prompt_param` when the prompt alone leaves no room
    for a token, or `max_tokens_param` when prompt + max_tokens exceeds the context."""
    limit = front.max_model_len
    if num_prompt >= limit:
        advice = f"Please reduce the length of the {prompt_param}."
        param = prompt_param
    elif max_tokens is not None and num_prompt + max_tokens > limit:
        advice = f"Please reduce {max_tokens_param} to at most {limit - num_prompt}."
        param = max_tokens_param
    else:
        return max_tokens if max_tokens is not None else limit - num_prompt
    raise APIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{num_prompt + (max_tokens or 0)} tokens ({num_prompt} in the {prompt_param}, "
        f"{max_tokens or 0} in the completion). {advice}",
        param=param,
        code="context_length_exceeded",
    )


def check_chars(front, num_chars: int, param: str) -> None:
    """A 400, before tokenizing, when a prompt has more characters than can fit (limits.py)."""
    bound = front.max_prompt_chars
    if bound is not None and num_chars > bound:
        raise APIError(
            400,
            f"The {param} has {num_chars} characters; no prompt of more than {bound} characters "
            f"fits in this model's maximum context length of {front.max_model_len} tokens. "
            f"Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def validate_ids(front, ids: list[int], param: str) -> None:
    try:
        front.validate_prompt(ids)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


def prepare_completion(state, req: CompletionRequest) -> PreparedRequest:
    """Tokenize and validate a completion request (400s naming the field)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        raw: list = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        raw = [prompt]
    else:
        raw = list(prompt)
    for item in raw:
        if isinstance(item, str):
            check_chars(state, len(item), "prompt")
    prompts: list[tuple[str | None, list[int]]] = []
    for item in raw:
        if isinstance(item, str):
            ids = state.tokenizer.encode(item)
            prompts.append((item, ids))
        else:
            prompts.append((None, list(item)))
    base = f"cmpl-{uuid.uuid4().hex}"
    params = []
    for _, ids in prompts:
        max_tokens = check_context(state, len(ids), req.max_tokens, "prompt", "max_tokens")
        validate_ids(state, ids, "prompt")
        params.append(req.sampling_params(max_tokens))
    ids_list = [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
    return PreparedRequest(ids_list, prompts, params, req.logprobs)


def prepare_chat(front, req: ChatCompletionRequest) -> PreparedRequest:
    """Render, tokenize and validate a chat request (400s naming the field)."""
    check_chars(front, sum(len(m.text()) for m in req.messages), "messages")
    text, ids = render_chat(front, req.messages, req.add_generation_prompt)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_context(front, len(ids), req.requested_max_tokens(), "messages", param)
    validate_ids(front, ids, "messages")
    params = req.sampling_params(max_tokens)
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    return PreparedRequest([f"chatcmpl-{uuid.uuid4().hex}"], [(text, ids)], [params], top_k)


def render_chat(state, messages, add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """`phloem.chat_messages.render_chat` of the request's messages; its errors become 400s."""
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return chat_messages.render_chat(state.tokenizer, conversation, add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def default_model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model
