"""SSE frames of streamed responses: the per-token text frame (a template filled with the
text) is byte for byte the generic encoding of the same chunk, and whole streams parse to the
chunks OpenAI clients expect (texts add up, the finish comes last, usage at the end)."""

from __future__ import annotations

import asyncio
import json

import pytest

from phloem.entrypoints.openai.responses import (
    PreparedRequest,
    _TextFrame,
    chat_chunks,
    completion_chunks,
    sse,
)
from phloem.outputs import CompletionOutput, RequestOutput
from phloem.sampling_params import SamplingParams

TEXTS = ["plain", "", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x01\x1f\x7f",
         "東京 🙂 👩‍💻", "\u2028\u2029", "\ufffd", "</script>&<>"]  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_text_frame_is_the_generic_encoding(text) -> None:
    def chunk(t: str) -> dict:
        return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                "choices": [{"index": 3, "text": t, "logprobs": None, "finish_reason": None,
                             "stop_reason": None}], "usage": None}  # fmt: skip

    frame = _TextFrame(chunk(_TextFrame.MARK)).frame(text)
    assert frame == sse(chunk(text))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:].decode("utf-8")) == chunk(text)


class _Front:
    model_name = "m"
    tokenizer = None


async def _outputs(texts: list[str], n: int):
    """A cumulative RequestOutput per step: each of n choices grows by the next piece."""
    done = ""
    for step, piece in enumerate(texts):
        done += piece
        last = step == len(texts) - 1
        outs = [
            CompletionOutput(
                i, done, list(range(step + 1)), None, None, "length" if last else None
            )  # fmt: skip
            for i in range(n)
        ]
        yield 0, RequestOutput("r", None, [1, 2], outs, finished=last)


def _frames(gen) -> list[dict]:
    async def collect():
        return [frame async for frame in gen]

    frames = asyncio.run(collect())
    assert all(isinstance(f, bytes) and f.startswith(b"data: ") for f in frames)
    return [json.loads(f[6:]) for f in frames]


@pytest.mark.parametrize("usage", [None, "final", "every"])
def test_completion_and_chat_streams_parse(usage) -> None:
    pieces = ["Hel", "lo ", "東京", " 🙂", "!"]
    prep = PreparedRequest(["r"], [(None, [1, 2])], [SamplingParams(n=2, max_tokens=5)], None)
    chunks = _frames(completion_chunks(_Front(), prep, _outputs(pieces, 2), "r", 7, 2, usage))
    for index in range(2):
        mine = [
            c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert "".join(c["text"] for c in mine) == "".join(pieces)
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
    if usage is None:
        assert all("usage" not in c for c in chunks)
    else:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
        every = [c["usage"] is not None for c in chunks[:-1]]
        assert all(every) if usage == "every" else not any(every)
    chat = _frames(chat_chunks(_Front(), prep, _outputs(pieces, 2), 7, usage))
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(
        c["choices"][0]["delta"].get("content", "")
        for c in chat
        if c["choices"] and c["choices"][0]["index"] == 1
    )
    assert text == "".join(pieces)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in chat)
