"""What the server calls on an online engine (vLLM's `EngineClient`): the in-thread
`AsyncLLMEngine` (engine/async_engine.py) and the engine core process's `EngineCoreClient`
(engine/core_client.py) both implement it, so the server holds either through one declared
seam.

The two differ in where the engine runs and in when `submit` queues a prompt (the in-thread
engine at the first iteration, the core client at the call); `generate`, `abort_all`,
`is_dead` and the checks before a request is queued are the same logic and live here.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from phloem.outputs import RequestOutput
from phloem.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop has died; no request can run any more."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (e.g. non-finite logits); the others go on."""


class EngineClient(abc.ABC):
    """An online engine as the server sees it (module docstring). Every method runs on the
    event loop, except `submit` (and `abort` of a request it queued, never started) where
    `submits_from_any_thread` says so.

    Attributes (set by the implementation):
        dead_error: the error the engine loop died of, or None while it runs.
        _streams: request id -> the event-loop-side state of each open request (a `finished`
            flag among it).
        submits_from_any_thread: True when `submit` may also run on another thread than the
            event loop's (the server's preparation thread queues a request as soon as it is
            prepared, not one loop round later); its iterator is still consumed on the loop.
    """

    dead_error: BaseException | None
    _streams: dict[str, Any]
    submits_from_any_thread: bool = False

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output) the engine runs [tokens]."""

    @abc.abstractmethod
    def start(self) -> None:
        """Begin serving on the running event loop (which will consume the outputs)."""

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine (waiting up to `timeout` seconds)."""

    @abc.abstractmethod
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError naming the limit when a prompt cannot run."""

    @abc.abstractmethod
    def validate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raise ValueError when the prompt or the sampling parameters cannot run."""

    @abc.abstractmethod
    def submit(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The iterator of one prompt's outputs (cumulative, coalesced; the last has
        `finished=True`), the prompt queued at the call or at the first iteration (the
        implementation says which). Leaving the iteration early aborts the request (an async
        generator, so `aclose` runs the abort; `generate` relies on it).

        Raises (at the call or at the first iteration): ValueError (the prompt or the
        parameters cannot run, or `request_id` is in use), EngineDeadError; the iteration
        raises RequestFailedError, EngineDeadError, or asyncio.CancelledError after `abort`.
        `arrival_time` is `time.monotonic()`'s clock [s]; None: now.
        """

    @abc.abstractmethod
    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request; its iteration raises `error` (default asyncio.CancelledError)."""

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue one prompt and yield its outputs (cumulative, coalesced) until it finishes:
        `submit`'s iterator, the prompt queued at the first iteration. Leaving early (break,
        cancellation, disconnect) aborts the request. Raises as `submit`."""
        outputs = self.submit(prompt_token_ids, sampling_params, request_id, prompt, arrival_time)
        async with aclosing(outputs):
            async for output in outputs:
                yield output

    def abort_all(self, error: BaseException) -> int:
        """Abort every unfinished request, each iteration raising `error` (a server ending
        what is left at its shutdown timeout); returns how many."""
        streams = list(self._streams.items())  # (a snapshot: `submit` may add from a thread)
        request_ids = [rid for rid, stream in streams if not stream.finished]
        for request_id in request_ids:
            self.abort(request_id, error)
        return len(request_ids)

    def _check_new(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams
    ) -> None:
        """Before a request is queued: raise EngineDeadError when the engine is dead,
        ValueError when `request_id` is in use or the request cannot run (`validate`)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead_error}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate(prompt_token_ids, sampling_params)
