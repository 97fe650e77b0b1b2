"""The step loop: schedule -> execute -> update, plus tokenization, text and outputs.

The engine owns the scheduler (pure Python), the executor (tensors), the grammars of structured
outputs and, per request, the detokenizer that applies stop strings (none in DELTA mode,
`OutputMode`: the server's front makes the text there). A prompt with n > 1 becomes n sequences; children 1..n-1
share the prompt's full blocks (a `SharedPrefix`), and so do the members of a prefix group that
the offline planner found (`add_request(..., shared_prefix=...)`). With speculative decoding the
drafter (`spec_decode/drafter.py`) sets the running requests' drafts before each `schedule()`.

Failure isolation: an exception that belongs to one request fails that request alone, and the step
goes on for the others. The scheduler fails a request whose admission or stop rules raise, the
executor reports per-request failures in `ModelRunnerOutput.failed` (its sampling setup raised, or
the sampler flagged its logits row non-finite), and the engine fails a sequence whose
detokenization, log-probs or grammar (`engine/structured_outputs.py`) fail. A failed prompt (all
its sequences) finishes at the end of the step with `RequestOutput.error` set and finish_reason
"error". Only an exception outside any one request's work (the forward pass, the batched sampler,
the device) leaves `step()`; `abort_all()` then resets the engine for later requests (a `step()`
before it raises: the scheduler counts the failed step as computed, the worker may not).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from phloem.config import EngineConfig
from phloem.core.kv_manager import KVManager
from phloem.core.request import Request, RequestStatus, SharedPrefix
from phloem.core.scheduler import Scheduler, SchedulerOutput
from phloem.engine.detokenizer import IncrementalDetokenizer
from phloem.engine.input_checks import check_params, check_prompt
from phloem.engine.prompt_entry import OutputMode, PromptEntry, SequenceEntry, StepOutput
from phloem.engine.prompt_failures import fail_prompts
from phloem.engine.spec_step import propose_drafts
from phloem.engine.step_observer import LaunchedStep, StepObserver
from phloem.engine.structured_outputs import StructuredOutputs
from phloem.engine.token_updates import apply_tokens
from phloem.outputs import RequestMetrics
from phloem.sampling_params import SamplingParams
from phloem.spec_decode.drafter import Drafter, build_drafter, load_draft_model

if TYPE_CHECKING:
    from phloem.engine.executor import Executor
    from phloem.worker.worker import Worker

logger = logging.getLogger(__name__)


class LLMEngine:
    """Generates text for requests added with `add_request`, one `step()` at a time.

    Args:
        config: the engine config; validated here.
        executor_factory: builds the executor from the loaded worker (default
            `UniProcExecutor`); tests pass one that wraps it (fault injection, other processes).
        output_mode: what `step()` returns (`OutputMode`; default FINAL, the offline path).
    Raises:
        ValueError: on an invalid config, an unknown architecture or an unloadable model.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor_factory: Callable[[Worker], Executor] | None = None,
        output_mode: OutputMode = OutputMode.FINAL,
    ) -> None:
        config.validate()
        self.config = config
        self.output_mode = output_mode
        self._load(config, executor_factory)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager)
        self._prompts: dict[str, PromptEntry] = {}
        self._sequences: dict[str, SequenceEntry] = {}
        self._ids = itertools.count()
        self._in_flight: LaunchedStep | None = None  # async scheduling: collected next step()
        self._step_raised = False  # a step() raised: its state is unknown until `abort_all`
        self._num_steps = 0  # non-empty steps launched
        self._step_observers: list[StepObserver] = []
        self.structured = StructuredOutputs(self.scheduler, self.tokenizer, self.eos_token_id,
            self.hf_config.vocab_size, config.structured_outputs.backend,
            grammar_process=config.structured_outputs.grammar_process)  # fmt: skip
        self.drafter: Drafter | None = None  # speculative decoding (`spec_decode/drafter.py`)
        if config.speculative is not None:
            budget = self.scheduler_config.max_num_batched_tokens
            self.drafter = build_drafter(config, self.hf_config, budget, self.draft_proposer)

    @property
    def stream_outputs(self) -> bool:
        """True when every step reports every prompt that got a token (STREAM, DELTA)."""
        return self.output_mode is not OutputMode.FINAL

    def _load(self, config: EngineConfig, executor_factory) -> None:
        """Tokenizer, model config, worker, executor and KV manager of `config`."""
        from phloem.engine.executor import build_executor
        from phloem.models.loader import (
            load_hf_config,
            load_tokenizer,
            resolve_model,
            startup_source,
        )

        source = startup_source(resolve_model(config.model.model), config.model)
        self.hf_config = load_hf_config(source)
        self.tokenizer = load_tokenizer(source)
        self.eos_token_id = self.tokenizer.eos_token_id
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(config.model.max_model_len or model_len, model_len)
        self.scheduler_config = dataclasses.replace(
            config.scheduler, max_model_len=self.max_model_len
        )
        self.scheduler_config.validate()
        # a draft model ("draft_model" method) loads before the target sizes its KV pool
        self.draft_proposer = load_draft_model(config, self.hf_config, self.scheduler_config)
        self.executor = build_executor(
            config, source, self.hf_config, self.eos_token_id, self.scheduler_config,
            executor_factory,
        )  # fmt: skip
        capacity = self.executor.num_blocks * config.cache.block_size
        if self.max_model_len > capacity:
            if config.model.max_model_len is not None:
                raise ValueError(
                    f"max_model_len={self.max_model_len} tokens does not fit the KV cache "
                    f"({capacity} tokens); lower max_model_len or give the cache more memory"
                )
            logger.warning("max_model_len lowered to the KV cache capacity: %d tokens", capacity)
            self.max_model_len = capacity
            self.scheduler_config = dataclasses.replace(
                self.scheduler_config, max_model_len=capacity
            )
        self.kv_manager = KVManager(
            self.executor.num_blocks,
            config.cache.block_size,
            enable_prefix_cache=config.cache.enable_prefix_caching,
        )

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        shared_prefix: SharedPrefix | None = None,
        *,
        validated: bool = False,
        planned: bool = False,
    ) -> str:
        """Queue one prompt; returns its request id. The engine keeps its own copy of
        `prompt_token_ids` (the caller may reuse the list).

        `shared_prefix` makes the request a member of a planned prefix group (its first
        `prefix_len` tokens are computed once for the whole group); the caller sets the group's
        `num_unfinished` to its member count. With n > 1 the n sequences share their prompt's
        full blocks instead (the group is ignored). `validated`: the caller already ran
        `validate_prompt` on these ids (skips a second pass over them). `planned`: the
        caller planned prefix sharing over the request's whole batch (the offline `LLM`);
        otherwise the scheduler groups it with requests arriving in the same step.

        Sequence i of n > 1 is seeded with `sampling_params.generator_seed(i)` ((seed + i) mod
        2^64). Nothing is queued when this raises.

        Raises:
            ValueError: if the prompt is empty, holds ids outside the vocabulary, or does not
                leave room for one generated token within `max_model_len`; or if the sampling
                parameters exceed what this model can do (`validate_params`).
        """
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._prompts:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not validated:
            self.validate_prompt(prompt_token_ids)
        self.validate_params(sampling_params)
        now = arrival_time if arrival_time is not None else time.monotonic()
        entry = PromptEntry(request_id, prompt, list(prompt_token_ids), [], RequestMetrics(now))
        n = sampling_params.n
        if n > 1:
            shared_prefix = self._siblings_prefix(len(prompt_token_ids), n, shared_prefix)
        entry.sequences = [
            self._new_sequence(entry, sampling_params, i, now, shared_prefix) for i in range(n)
        ]
        added: list[str] = []
        try:
            for seq in entry.sequences:
                self.scheduler.add_request(seq.request, planned)
                added.append(seq.request.request_id)
        except BaseException:
            self.scheduler.abort_requests(added)
            raise
        self._prompts[request_id] = entry
        for seq in entry.sequences:
            self._sequences[seq.request.request_id] = seq
            self.structured.register(seq.request.request_id, sampling_params)
        return request_id

    def _siblings_prefix(
        self, prompt_len: int, n: int, planned: SharedPrefix | None
    ) -> SharedPrefix | None:
        """The group of the n > 1 sequences of one prompt: its full blocks [tokens] shared by
        the siblings (None when the prompt has no full block before its last token). A planned
        group the request was counted in loses it as a member."""
        if planned is not None:
            planned.num_unfinished -= 1
        block_size = self.kv_manager.block_size
        sibling_prefix = (prompt_len - 1) // block_size * block_size
        if sibling_prefix <= 0:
            return None
        return SharedPrefix(prefix_len=sibling_prefix, num_unfinished=n)

    def _new_sequence(
        self,
        entry: PromptEntry,
        sampling_params: SamplingParams,
        index: int,
        now: float,
        shared_prefix: SharedPrefix | None,
    ) -> SequenceEntry:
        """Sequence `index` of the prompt: its scheduler request and (unless DELTA) its
        detokenizer, which applies the stop strings."""
        params = sampling_params
        if sampling_params.n > 1 and sampling_params.seed is not None:
            params = sampling_params.clone(seed=sampling_params.generator_seed(index))
        seq_id = entry.request_id if sampling_params.n == 1 else f"{entry.request_id}#{index}"
        request = Request(
            seq_id,
            entry.prompt_token_ids,
            params,
            eos_token_id=self.eos_token_id,
            arrival_time=now,
            shared_prefix=shared_prefix,
        )
        detok = None
        if self.output_mode is not OutputMode.DELTA:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                entry.prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                incremental=self.stream_outputs,
            )
        seq = SequenceEntry(request, index, entry.request_id, detok)
        if params.logprobs is not None:
            seq.cumulative_logprob, seq.logprobs = 0.0, []
        return seq

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError naming the limit when a prompt cannot run (`input_checks`)."""
        check_prompt(prompt_token_ids, self.max_model_len, self.hf_config.vocab_size)

    def validate_params(self, sampling_params: SamplingParams) -> None:
        """ValueError naming the field: `input_checks.check_params`, `StructuredOutputs.check`."""
        check_params(sampling_params, self.hf_config.vocab_size)
        self.structured.check(sampling_params)

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens the model ran since start (recomputation included) [tokens]."""
        return self.scheduler.num_computed_prompt_tokens

    def abort_all(self) -> None:
        """Abort every unfinished prompt and forget the step in flight (async scheduling).

        For after an exception out of `step()`, whose state is unknown: frees the KV blocks of
        every request, so the engine serves later requests from a clean queue (a constrained
        step still held for its bitmask is dropped unsampled: `StructuredOutputs.drop_held`)."""
        self._in_flight, self._step_raised = None, False
        self.structured.drop_held()
        self.scheduler.forget_unapplied()
        self.abort_request(list(self._prompts))
        self.scheduler.failed_requests.clear()

    def abort_request(self, request_ids: list[str]) -> None:
        """Stop these prompts now and free their KV blocks (with none left, a held constrained
        step is sampled: `StructuredOutputs.sample_if_idle`)."""
        for request_id in request_ids:
            entry = self._prompts.get(request_id)
            if entry is not None:
                self.scheduler.abort_requests([s.request.request_id for s in entry.sequences])
                self._forget(entry)
        self.structured.sample_if_idle(self.executor)

    def stop_sequences(self, seq_ids: list[str]) -> None:
        """Finish sequences as stopped and free their blocks (a front found a stop string:
        "<request id>#<i>", or the request id when n == 1); a prompt whose sequences have all
        finished is forgotten (no output). Unknown or finished ids are ignored."""
        for seq_id in seq_ids:
            seq = self._sequences.get(seq_id)
            if seq is None:
                continue
            self.scheduler.finish_request(seq.request, RequestStatus.FINISHED_STOPPED)
            entry = self._prompts[seq.prompt_id]
            if all(s.request.is_finished for s in entry.sequences):
                self._forget(entry)
        self.structured.sample_if_idle(self.executor)

    def _forget(self, entry: PromptEntry) -> None:  # the prompt and its sequences
        del self._prompts[entry.request_id]
        for seq in entry.sequences:
            self._sequences.pop(seq.request.request_id, None)
            self.structured.forget(seq.request.request_id)
            if self.drafter is not None:
                self.drafter.finish(seq.request.request_id)

    def is_unfinished(self, request_id: str) -> bool:
        """True while the prompt `request_id` is queued or running."""
        return request_id in self._prompts

    def close(self) -> None:
        """Stop the executor's processes (TP ranks) and grammar threads; idempotent, also at exit."""
        self.structured.close()
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        # a step in flight holding only finished requests is collected by the next step()
        return self.scheduler.has_unfinished_requests()

    @property
    def in_flight(self) -> SchedulerOutput | None:
        """The step launched and not yet collected (async scheduling: until the next step())."""
        return self._in_flight.scheduler_output if self._in_flight is not None else None

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one iteration; returns an output for every prompt that finished (and, in the
        STREAM and DELTA modes, for every prompt that got a new token): `RequestOutput`s, or
        `RequestDelta`s in DELTA mode (`OutputMode`).

        One path: schedule, prepare, launch, then collect and update the step before it.
        Synchronous scheduling collects the step it just launched; async scheduling collects
        step N (launched by the previous call) after launching N+1, so the host's work on N+1
        and on N's tokens overlaps the device running N and N+1. A constrained step N+1 is
        launched with its sampling up to the mask (`Executor.presample`) and sampled under its
        grammar bitmask, filled once N's tokens are accepted (`engine/structured_outputs.py`);
        under async scheduling by the next call, after its scheduling and `Executor.prepare`
        (the step is *held* until then; at once when no request is left, `sample_if_idle`):

            schedule(N+2) -> prepare(N+2) -> sample(N+1) -> launch(N+2) -> collect(N+1)
              -> the grammars' advance by N+1's tokens, then the fill of N+2, start
              -> update(N+1) -> outputs of N+1
        """
        if self._step_raised:
            raise RuntimeError("the last step() raised; call abort_all() before the next one")
        self._step_raised = True  # until this step returns
        start = time.perf_counter()
        outputs = self._propose_drafts() if self.drafter is not None else []
        scheduler_output = self.scheduler.schedule()
        if self.drafter is not None and scheduler_output.preempted_seq_ids:
            self.drafter.preempted(scheduler_output.preempted_seq_ids)
        self.structured.mark(scheduler_output)
        if self._in_flight is not None and self.executor.needs_token_history(scheduler_output):
            outputs += self._finish_in_flight()  # penalties read the step before's tokens
        schedule_s = time.perf_counter() - start
        launched = self._launch(scheduler_output, schedule_s)
        if self._in_flight is not None:
            outputs += self._finish_in_flight()
        self._in_flight = launched
        if launched is not None and scheduler_output.structured_seq_ids:
            # not deferred with speculative decoding: its drafter reads the step in flight
            defer = self.scheduler_config.async_scheduling and self.drafter is None
            self.structured.hold(launched, self.executor, defer)
        if not self.scheduler_config.async_scheduling and launched is not None:
            outputs += self._finish_in_flight()  # synchronous: collect right after launch
        if self.scheduler.failed_requests:  # requests that failed alone in this step
            outputs += self._fail_prompts()
        self.structured.sample_if_idle(self.executor)  # none left: no next step() need come
        self._step_raised = False
        return outputs

    def _propose_drafts(self) -> list[StepOutput]:
        """Speculative decoding, before `schedule()`: the drafts for the next step, proposed
        ahead of the step in flight where possible (`engine/spec_step.py`)."""
        assert self.drafter is not None
        grammars = self.structured.manager
        return propose_drafts(self.drafter, self.scheduler, self._in_flight,
                              bool(grammars and grammars.num_live), self._finish_in_flight)  # fmt: skip

    def add_step_observer(self, fn: StepObserver) -> None:
        """Call `fn(StepRecord)` after each non-empty step's outputs are updated (see
        `phloem.engine.step_observer`)."""
        self._step_observers.append(fn)

    def remove_step_observer(self, fn: StepObserver) -> None:
        """Stop calling `fn`. Raises ValueError if it was not added."""
        self._step_observers.remove(fn)

    def _launch(self, scheduler_output: SchedulerOutput, schedule_s: float) -> LaunchedStep | None:
        """Hand the step to the executor (an empty one carries finished ids); None if empty."""
        start = time.perf_counter()
        self.executor.prepare(scheduler_output)  # host only: beside the step in flight's fill
        prepared = time.perf_counter()
        self.structured.sample_held(self.executor)  # the device's order: N+1's sampling first
        start += time.perf_counter() - prepared  # launch_s: prepare + launch, not the wait
        handle = self.executor.launch(scheduler_output)
        if scheduler_output.structured_seq_ids:  # before N's collection: beside the device
            self.executor.presample(handle)
        if scheduler_output.is_empty:
            return None
        self._num_steps += 1
        if self.drafter is not None:
            self.drafter.launched(scheduler_output)
        launch_s = time.perf_counter() - start
        return LaunchedStep(self._num_steps - 1, scheduler_output, handle, schedule_s, launch_s)

    def _finish_in_flight(self) -> list[StepOutput]:
        """Wait for the launched step's tokens, update the scheduler, build its outputs, and
        tell the step observers. A step without samples is still updated (prefix holds)."""
        self.structured.sample_held(self.executor)
        launched = self._in_flight
        assert launched is not None
        self._in_flight = None
        start = time.perf_counter()
        runner_output = self.executor.collect(launched.handle)
        collected = time.perf_counter()
        scheduler_output = launched.scheduler_output
        self.structured.collected(scheduler_output, runner_output.sampled_token_ids)
        accepted = runner_output.num_accepted_drafts
        updated = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids, accepted
        )
        missed = runner_output.missed_guess_seq_ids
        if (accepted or missed) and self.drafter is not None:
            self.drafter.observe(scheduler_output, accepted, missed)
        self.structured.advance(updated)
        outputs = self._process_outputs(scheduler_output, updated, runner_output)
        if self.drafter is not None:  # the step's cost: its host work, its collection, its update
            self.drafter.step_done(scheduler_output, start)
        if self._step_observers:
            record = launched.record(
                runner_output, collected - start, time.perf_counter() - collected
            )
            for fn in list(self._step_observers):
                fn(record)
        return outputs

    def _process_outputs(self, sched: SchedulerOutput, updated, runner_output) -> list[StepOutput]:
        """Text, log-probs, stop strings and metrics for the requests that got a token; returns
        the outputs of the prompts that finished (all touched ones with `stream_outputs`), in
        the order their first sequence appears in `updated`.

        Runs for every sampled token, so the per-token work is kept to the bare loop: a prompt
        can only finish in a step in which one of its sequences finished, so only those are
        checked for being done.
        """
        now = time.monotonic()
        self._stamp_first_scheduled(sched, now)
        sequences, scheduler = self._sequences, self.scheduler
        for seq_id, message in runner_output.failed.items():
            if seq_id in sequences:
                scheduler.fail_request(sequences[seq_id].request, message)
        failed_prompts: set[str] = set()  # prompts failed this step: reported by step()
        if scheduler.failed_requests:
            failed_prompts.update(
                sequences[s].prompt_id for s in scheduler.failed_requests if s in sequences
            )
        touched, maybe_done = apply_tokens(
            updated, runner_output, self._sequences, self._prompts, scheduler, failed_prompts, now
        )
        outputs: list[StepOutput] = []
        stream = self.stream_outputs  # read once a step: this loop runs per touched prompt
        delta = self.output_mode is OutputMode.DELTA
        build = PromptEntry.to_delta if delta else PromptEntry.to_output
        for entry in touched.values():
            if failed_prompts and entry.request_id in failed_prompts:
                continue
            if entry.request_id in maybe_done and all(
                s.request.is_finished for s in entry.sequences
            ):
                entry.finished = True
                entry.metrics.finished_time = now
                self._forget(entry)
            if entry.finished or stream:
                outputs.append(build(entry))
        return outputs

    def _output(self, entry: PromptEntry) -> StepOutput:
        return entry.to_delta() if self.output_mode is OutputMode.DELTA else entry.to_output()

    def _fail_prompts(self) -> list[StepOutput]:
        """Finish the prompts of the sequences in `scheduler.failed_requests` (and clear it;
        `prompt_failures.fail_prompts`); returns one final output per prompt."""
        failures, self.scheduler.failed_requests = self.scheduler.failed_requests, {}
        entries = fail_prompts(failures, self._sequences, self._prompts, self.scheduler)
        for entry in entries:
            self._forget(entry)
        return [self._output(entry) for entry in entries]

    def _stamp_first_scheduled(self, sched: SchedulerOutput, now: float) -> None:
        """Stamp `first_scheduled_time` on prompts scheduled for the first time (a sequence is
        sent as new the step it is admitted, so only those entries are looked at)."""
        for s in sched.scheduled:
            seq = self._sequences.get(s.seq_id) if s.new_sequence is not None else None
            entry = self._prompts.get(seq.prompt_id) if seq is not None else None
            if entry is not None and entry.metrics.first_scheduled_time is None:
                entry.metrics.first_scheduled_time = now
