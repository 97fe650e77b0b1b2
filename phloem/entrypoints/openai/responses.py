"""OpenAI response bodies of a request's outputs: whole (completion, chat) and streamed (SSE).

Pure formatting over `RequestOutput`s (cumulative: full text and token ids so far); nothing here
touches the engine. Streams send each choice's new text once, holding back a tail that may be
the start of a stop string; usage is counted from the prompts and the outputs so far.

SSE frames are bytes, JSON-encoded by msgspec (UTF-8, non-ASCII unescaped, as `json.dumps(...,
ensure_ascii=False)` but several times faster). The frame of a token's text, the one sent per
token of every stream, is a template: the chunk's fixed fields encoded once per stream, the text
encoded into it per frame (`_TextFrame`); the frames parse to the same objects as the generic
path's (tests/entrypoints/test_sse_frames.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from phloem.sampling_params import SamplingParams

_MIN_LOGPROB = -9999.0  # JSON has no -inf
_json = msgspec.json.Encoder()


def sse(data: dict | str) -> bytes:
    """One SSE event: `data: <JSON or the string as it is>` and a blank line, UTF-8."""
    payload = data.encode() if isinstance(data, str) else _json.encode(data)
    return b"data: " + payload + b"\n\n"


class _TextFrame:
    """The frame of one choice's new text, unfinished, without log-probs: the chunk encoded once
    with a placeholder text, split around it; `frame(text)` encodes only the text."""

    MARK = "\x00phloem-text\x00"  # the placeholder text (JSON "\u0000phloem-text\u0000")

    def __init__(self, data: dict) -> None:
        encoded = sse(data)
        mark = _json.encode(self.MARK)
        self._head, self._tail = encoded.split(mark)

    def frame(self, text: str) -> bytes:
        return self._head + _json.encode(text) + self._tail


def safe_logprob(value: float | None) -> float:
    if value is None or value != value or value < _MIN_LOGPROB:
        return _MIN_LOGPROB
    return float(value)


class _Choice:
    """Streaming state of one choice: what text and tokens have been sent.

    Text ending in a possible stop-string prefix is held back (`holdback` chars): the engine cuts
    the text when the stop string completes, and what was sent cannot be taken back.
    """

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.num_chars = 0
        self.num_tokens = 0
        self.finished = False

    def delta(self, completion, finished: bool) -> tuple[str, int, int]:
        text = completion.text
        end = len(text) if finished else max(self.num_chars, len(text) - self.holdback)
        delta = text[self.num_chars : end]
        start_tokens = self.num_tokens
        self.num_chars = end
        self.num_tokens = len(completion.token_ids)
        return delta, start_tokens, self.num_tokens


def _holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop or []), default=1) - 1  # type: ignore[union-attr]


@dataclass
class PreparedRequest:
    """An API request tokenized and checked: one engine request per prompt (`server.py`)."""

    request_ids: list[str]
    prompts: list[tuple[str | None, list[int]]]
    params: list[SamplingParams]
    top_k: int | None  # logprobs to show per token (None: no logprobs)


def logprobs_completion(tokenizer, completion, start: int, end: int, top_k: int, offset: int):
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for i in range(start, min(end, len(completion.logprobs or []))):
        token_id = completion.token_ids[i]
        entry = completion.logprobs[i] or {}
        piece = tokenizer.decode([token_id])
        tokens.append(piece)
        token_logprobs.append(safe_logprob(entry.get(token_id)))
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top_k]
        top.append({tokenizer.decode([t]): safe_logprob(lp) for t, lp in best} if top_k else None)
        text_offset.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


def logprobs_chat(tokenizer, completion, start: int, end: int, top_k: int):
    content = []
    for i in range(start, min(end, len(completion.logprobs or []))):
        token_id = completion.token_ids[i]
        entry = completion.logprobs[i] or {}
        piece = tokenizer.decode([token_id])
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top_k]
        content.append(
            {
                "token": piece,
                "logprob": safe_logprob(entry.get(token_id)),
                "bytes": list(piece.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (p := tokenizer.decode([t])),
                        "logprob": safe_logprob(lp),
                        "bytes": list(p.encode("utf-8")),
                    }
                    for t, lp in best
                ],
            }
        )
    return {"content": content}


def usage_of(prep: PreparedRequest, outputs: list) -> dict[str, int]:
    """Token counts of a request so far (`outputs[i]`: prompt i's latest output, or None)."""
    prompt = sum(len(ids) for _, ids in prep.prompts)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_response(front, prep: PreparedRequest, finals: list, response_id: str, created: int):
    """The /v1/completions body of finished outputs (one per prompt)."""
    n = prep.params[0].n
    choices = []
    for index, output in enumerate(finals):
        for c in output.outputs:
            choice = {
                "index": index * n + c.index,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if prep.top_k is not None:
                choice["logprobs"] = logprobs_completion(
                    front.tokenizer, c, 0, len(c.token_ids), prep.top_k, 0
                )
            choices.append(choice)
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": front.model_name,
        "choices": choices,
        "usage": usage_of(prep, finals),
        "system_fingerprint": None,
    }


def chat_response(front, prep: PreparedRequest, finals: list, created: int):
    """The /v1/chat/completions body of a finished output."""
    output = finals[0]
    choices = []
    for c in output.outputs:
        logprobs = None
        if prep.top_k is not None:
            logprobs = logprobs_chat(front.tokenizer, c, 0, len(c.token_ids), prep.top_k)
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {
        "id": prep.request_ids[0],
        "object": "chat.completion",
        "created": created,
        "model": front.model_name,
        "choices": choices,
        "usage": usage_of(prep, finals),
        "system_fingerprint": None,
    }


def stream_usage_mode(req) -> str | None:
    """Usage in a stream: None; "final" (`include_usage`: a last chunk with no choices), or
    "every" (with `continuous_usage_stats` too, as vLLM: the counts so far in every chunk)."""
    options = req.stream_options
    if options is None or not options.include_usage:
        return None
    return "every" if options.continuous_usage_stats else "final"


def _chunk_maker(front, object_name: str, response_id: str, created: int, usage_mode, usage_now):
    """A function (choices, final=False) -> the dict of one chunk of a streamed response;
    `usage_now()` gives the token counts so far (see `stream_usage_mode` for `usage_mode`)."""

    def chunk(choice_list, final: bool = False) -> dict:
        data = {
            "id": response_id,
            "object": object_name,
            "created": created,
            "model": front.model_name,
            "choices": choice_list,
        }
        if usage_mode is not None:
            data["usage"] = usage_now() if final or usage_mode == "every" else None
        return data

    return chunk


def _text_frames(prep, usage_mode, template_of) -> dict[int, _TextFrame] | None:
    """Per choice index, its text frame's template (`template_of(index)`: the chunk with the
    placeholder text); None where frames vary beyond the text (log-probs, usage every chunk)."""
    if prep.top_k is not None or usage_mode == "every":
        return None
    return _LazyFrames(template_of)


class _LazyFrames(dict):
    """Choice index -> its `_TextFrame`, built on first use."""

    def __init__(self, template_of) -> None:
        super().__init__()
        self._template_of = template_of

    def __missing__(self, index: int) -> _TextFrame:
        frame = self[index] = _TextFrame(self._template_of(index))
        return frame


async def _choice_deltas(prep, outputs, finals: list):
    """Yield (prompt index, completion, text delta, done, t0, t1) for every completion that has
    new text or just finished; `finals[i]` keeps prompt i's latest output (for usage)."""
    holdback = [_holdback(p) for p in prep.params]
    choices: dict[tuple[int, int], _Choice] = {}
    async for index, output in outputs:
        finals[index] = output
        for c in output.outputs:
            st = choices.setdefault((index, c.index), _Choice(holdback[index]))
            if st.finished:
                continue
            done = c.finish_reason is not None or output.finished
            delta, t0, t1 = st.delta(c, done)
            if not delta and not done:
                continue
            st.finished = done
            yield index, c, delta, done, t0, t1, st.num_chars - len(delta)


async def completion_chunks(front, prep, outputs, response_id, created, n, usage_mode):
    """SSE frames (bytes) of a streamed /v1/completions response; `outputs` yields (prompt
    index, RequestOutput) as the engine produces them."""
    finals: list = [None] * len(prep.request_ids)
    chunk = _chunk_maker(
        front, "text_completion", response_id, created, usage_mode, lambda: usage_of(prep, finals)
    )

    def item(index: int, text: str, finish_reason=None, stop_reason=None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": stop_reason}  # fmt: skip

    frames = _text_frames(prep, usage_mode, lambda i: chunk([item(i, _TextFrame.MARK)]))
    async for index, c, delta, done, t0, t1, offset in _choice_deltas(prep, outputs, finals):
        if frames is not None and not done:
            yield frames[index * n + c.index].frame(delta)
            continue
        choice = item(index * n + c.index, delta)
        if done:
            choice["finish_reason"], choice["stop_reason"] = c.finish_reason, c.stop_reason
        if prep.top_k is not None:
            choice["logprobs"] = logprobs_completion(front.tokenizer, c, t0, t1, prep.top_k, offset)
        yield sse(chunk([choice]))
    if usage_mode is not None:
        yield sse(chunk([], final=True))


async def chat_chunks(front, prep, outputs, created, usage_mode):
    """SSE frames (bytes) of a streamed /v1/chat/completions response (see
    `completion_chunks`)."""
    finals: list = [None]
    chunk = _chunk_maker(
        front,
        "chat.completion.chunk",
        prep.request_ids[0],
        created,
        usage_mode,
        lambda: usage_of(prep, finals),
    )
    for i in range(prep.params[0].n):
        first = {"index": i, "delta": {"role": "assistant", "content": ""}}
        yield sse(chunk([{**first, "logprobs": None, "finish_reason": None}]))

    def template(i: int) -> dict:
        text = {"content": _TextFrame.MARK}
        return chunk([{"index": i, "delta": text, "logprobs": None, "finish_reason": None}])

    frames = _text_frames(prep, usage_mode, template)
    async for _, c, delta, done, t0, t1, _ in _choice_deltas(prep, outputs, finals):
        if frames is not None and not done:
            yield frames[c.index].frame(delta)
            continue
        item = {
            "index": c.index,
            "delta": {"content": delta} if delta else {},
            "logprobs": None,
            "finish_reason": c.finish_reason if done else None,
        }
        if done:
            item["stop_reason"] = c.stop_reason
        if prep.top_k is not None:
            item["logprobs"] = logprobs_chat(front.tokenizer, c, t0, t1, prep.top_k)
        yield sse(chunk([item]))
    if usage_mode is not None:
        yield sse(chunk([], final=True))
