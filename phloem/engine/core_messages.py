"""The front <-> engine core contract: plain data, encoded with msgspec's msgpack.

The server process (the front: HTTP, tokens <-> text, stop strings, SSE) and the engine core
process (scheduler + executor loop) talk only in these messages, over two ZeroMQ sockets:

    front --(CoreRequest | CoreAbort | CoreShutdown)--> core      requests, aborts, stop
    front <--(CoreReady | CoreStep | CoreDead)---------- core      one CoreStep per engine step

A `CoreStep` carries every touched request's *delta* (the token ids sampled this step per
sequence, their log-probs when asked, finish/stop reasons), never cumulative lists or text: the
core does not detokenize. Its `CoreStats` are a handful of counters the front turns into
/metrics. Nothing here is live (no tensors, no engine objects). The per-step structs are
`gc=False` (never tracked by the cycle collector: they hold only numbers, strings and lists of
them, so they cannot be part of a cycle): a step decodes hundreds of them at once, and tracking
them tripled the decode's time through the collections they set off. Prior art: vLLM v1's
`EngineCoreRequest` / `EngineCoreOutputs` (msgspec over ZeroMQ); this is our own, smaller set.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from phloem.sampling_params import SamplingParams

# -- front -> core ---------------------------------------------------------------------------------


class CoreRequest(msgspec.Struct, tag="add", array_like=True):
    """Queue one prompt.

    Attributes:
        request_id: unique among unfinished requests.
        prompt_token_ids: the prompt [token ids]; validated by the front already.
        sampling_params: `SamplingParams` fields (`params_to_dict`; `SamplingParams.from_dict`).
        arrival_time: when the front received it [s, time.monotonic() of the front's host].
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    arrival_time: float


class CoreAbort(msgspec.Struct, tag="abort", array_like=True):
    """Stop requests now and free their KV blocks. Unknown or finished ids are ignored.

    Attributes:
        request_ids: whole prompts to abort (the client is gone; counted as aborted).
        stop_seq_ids: sequences the front found a stop string in, to finish as stopped (the
            request id when n == 1, "<id>#<i>" for sample i of n > 1); a prompt whose every
            sequence has finished is forgotten (not counted as aborted).
    """

    request_ids: list[str]
    stop_seq_ids: list[str] = []


class CoreShutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Leave the loop and exit 0."""


FrontMessage = CoreRequest | CoreAbort | CoreShutdown

# -- core -> front ---------------------------------------------------------------------------------


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    """The engine is built. `max_model_len` [tokens] is the context after KV capping."""

    max_model_len: int
    vocab_size: int
    pid: int


class SeqDelta(msgspec.Struct, array_like=True, gc=False):
    """One sequence's news in one step.

    Attributes:
        index: which of the prompt's n sequences.
        token_ids: tokens sampled this step (usually one; none when only its status changed).
        logprobs: per new token, {token id: log-prob} (top-k plus the sampled one); None unless
            the request asked for log-probs.
        cumulative_logprob: running sum over all its tokens; None unless asked.
        finish_reason: "stop" / "length" / "abort" / "error" once finished, else None.
        stop_reason: the stop token id that ended it (never a string: the front applies those).
    """

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """One prompt's news in one step: the sequences that changed, and whether it is done.

    `error` set: the request failed alone in the core (its own setup, non-finite logits);
    `rejected` set too: it was refused when queued (a ValueError, answered as a 400).
    """

    request_id: str
    seqs: list[SeqDelta]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    rejected: bool = False


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core's state after a step, for /metrics (counts; totals since start)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # [tokens], total
    prefix_cache_hits: int  # [tokens], total
    num_preemptions: int  # total
    num_aborted_waiting: int  # total
    num_aborted_running: int  # total
    # optional (added by issue 24, item 4; older senders omit them)
    num_computed_prompt_tokens: int = 0  # [tokens] the model ran, total (recomputes included)
    num_reused_prompt_tokens: int = 0  # [tokens] admitted requests started with, total
    # optional (issue 20): speculative decoding's drafts verified and accepted, total [tokens]
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class CoreStep(msgspec.Struct, tag="step", array_like=True, gc=False):
    """Everything one engine step (or one idle pass over aborts) produced."""

    deltas: list[RequestDelta]
    stats: CoreStats


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    """The engine loop raised out of `step()` (or failed to start); the core exits 1 after."""

    error: str


CoreMessage = CoreReady | CoreStep | CoreDead


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """The constructor fields of `params` (what `SamplingParams.from_dict` takes back)."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def front_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def core_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the front sends (`FrontMessage`)."""
    return msgspec.msgpack.Decoder(FrontMessage)  # type: ignore[arg-type]


def front_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends (`CoreMessage`)."""
    return msgspec.msgpack.Decoder(CoreMessage)  # type: ignore[arg-type]
