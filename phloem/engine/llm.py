"""The offline API: `LLM(...).generate(prompts, sampling_params)` (vLLM's names).

`generate` hands the whole batch to the engine at once and steps it until every prompt is done,
returning outputs in input order.

One `LLM` runs one call at a time: calls from several threads are serialized (each waits for the
one running), and a call made from inside another on the same thread (e.g. `generate` while
iterating `iter_outputs`) raises RuntimeError instead of deadlocking. A request that fails in
the engine (its setup, sampling, detokenization or stop rules raised) comes back as an output
with `error` set and finish_reason "error" while the others finish; if a whole call fails (an
exception out of the engine loop, an interrupt), its requests are aborted before the exception
propagates, so the object stays usable for later calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from array import array
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from phloem.chat_messages import render_chat
from phloem.core.prefix_planner import PrefixPlan, plan_prefix_groups
from phloem.core.request import SharedPrefix
from phloem.engine.data_parallel import DataParallelEngine, ReplicaReport, with_progress
from phloem.engine.gc_control import gc_frozen, gc_paused
from phloem.engine.llm_engine import LLMEngine
from phloem.engine.prompt_batch import CheckedBatch, check_id_list, planner_input
from phloem.engine.structured_outputs import default_num_threads
from phloem.engine_args import EngineArgs
from phloem.outputs import RequestOutput
from phloem.sampling_params import SamplingParams
from phloem.structured_output import validate_constraints

PromptType = str | dict[str, Any]
ParamsArg = SamplingParams | dict[str, Any]


def _as_list(value: Any, name: str, what: str) -> list[Any]:
    """`value` (a list, tuple or other iterable that is not a string) as a list.

    Raises:
        TypeError: naming `name` and `what` it must be, for anything else (None included).
    """
    if value is None or isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return list(value)


class LLM:
    """An engine for offline batches.

    Args:
        model: None for the embedded default (SmolLM2-135M-Instruct), a `.gguf` file, or an HF
            checkpoint directory (config.json + *.safetensors + tokenizer files).
        **kwargs: the other engine settings, by keyword: exactly the fields of
            `phloem.engine_args.EngineArgs` (`block_size`, `max_num_seqs`,
            `max_num_batched_tokens`, `enable_prefix_caching`, `async_scheduling`, ...), whose
            docstring and help text give each one's meaning, unit and default. With
            `data_parallel_size` N > 1 the LLM starts N replica processes (`close()` or `with
            LLM(...) as llm:` stops them; so does exit) and keeps only the tokenizer and the
            model config: see `phloem.engine.data_parallel`.
    Raises:
        TypeError: naming a keyword argument that is not an engine setting.
        ValueError: naming the argument, for invalid values; naming the file, for a truncated
            GGUF or safetensors file; naming both numbers, for more replicas than CUDA devices.
        ReplicaError: a replica process failed to start (naming it).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        start = time.perf_counter()
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        config = args.create_engine_config()
        engine = DataParallelEngine(args) if args.data_parallel_size > 1 else LLMEngine(config)
        self._init_state(engine, time.perf_counter() - start)

    def _init_state(self, engine: LLMEngine | DataParallelEngine, load_s: float) -> None:
        self.llm_engine: LLMEngine | DataParallelEngine = engine
        self.last_plan: PrefixPlan | None = None  # the last batch's global plan
        self._lock = threading.Lock()  # one call at a time (see the module docstring)
        self._owner: int | None = None  # the thread running the current call
        self.load_s = load_s  # start-up time [s]: imports, model, KV pool

    @classmethod
    def for_planning(cls, engine_args: EngineArgs) -> LLM:
        """An LLM for `plan` and the input checks (`generate --plan-only`): with
        data_parallel_size > 1 no replica starts (until a first batch); else `LLM(...)`."""
        if engine_args.data_parallel_size == 1:
            return cls.from_engine_args(engine_args)
        llm = cls.__new__(cls)
        llm._init_state(DataParallelEngine(engine_args, start=False), 0.0)
        return llm

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An LLM of `engine_args` (the CLI builds one from its flags this way).

        Raises:
            ValueError: as `LLM(...)`.
        """
        return cls(**dataclasses.asdict(engine_args))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def last_replica_report(self) -> ReplicaReport | None:
        """Per replica planned cost vs achieved time, the imbalance and which replica ran each
        request, for the last batch; None with data_parallel_size 1."""
        engine = self.llm_engine
        return engine.last_report if isinstance(engine, DataParallelEngine) else None

    def close(self) -> None:
        """Stop the replica processes (data_parallel_size > 1) or the tensor-parallel rank
        processes (tensor_parallel_size > 1); idempotent; a no-op for one in-process engine.
        Also run by `with LLM(...) as llm:` and at interpreter exit."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _single_engine(self) -> LLMEngine:
        """The in-process engine. Raises RuntimeError with data_parallel_size > 1."""
        if isinstance(self.llm_engine, DataParallelEngine):
            raise RuntimeError(
                "add_requests/iter_outputs drive one in-process engine; with "
                "data_parallel_size > 1 use generate, chat or run_batch"
            )
        return self.llm_engine

    # -- inputs -----------------------------------------------------------------------------------

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt: a string, {"prompt": str} or {"prompt_token_ids"}.

        The tokenizer adds its special tokens (e.g. BOS) as it is configured to. For
        {"prompt_token_ids": ids} the returned list is `ids` itself, not a copy (the engine
        copies the prompts it queues, so a caller changing it later changes no request).
        Raises ValueError naming the field when the prompt has neither form.
        """
        if isinstance(prompt, str):
            return prompt, self.llm_engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                check_id_list(prompt["prompt_token_ids"])  # one pass in C for plain ints
                return prompt.get("prompt"), prompt["prompt_token_ids"]
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.llm_engine.tokenizer.encode(prompt["prompt"])
        raise ValueError(
            "each prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
            f"got {type(prompt).__name__}"
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """(rendered text, token ids) of a conversation; see `render_chat`."""
        return render_chat(self.llm_engine.tokenizer, messages)

    # -- generation -------------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: ParamsArg | Sequence[ParamsArg] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts; returns one RequestOutput per prompt, in order.

        `sampling_params`: one for all prompts or one per prompt, each a `SamplingParams` or a
        dict of its fields (`SamplingParams.from_dict`); None uses the defaults. A request that
        fails in the engine comes back with `error` set (finish_reason "error").

        Raises:
            TypeError: `prompts` is not a prompt or a list of prompts, or `sampling_params` is
                not one of the forms above (naming the argument).
            ValueError: for a malformed prompt, a prompt too long for the context (naming its
                index and the limit), invalid sampling values (naming `sampling_params[i]` and
                the field), or a sampling_params list of the wrong length.
            RuntimeError: called from inside another call on this LLM in the same thread.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        inputs = _as_list(prompts, "prompts", "a prompt (str or dict) or a list of prompts")
        return self._run(inputs, "prompts", self.encode_prompt, sampling_params, use_tqdm)

    def chat(
        self,
        conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: ParamsArg | Sequence[ParamsArg] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Like `generate`, for conversations rendered with the tokenizer's chat template (one
        conversation, or a list of them; messages as `phloem.chat_messages` defines them).

        Raises:
            TypeError, ValueError, RuntimeError: as `generate`, naming `conversations[i]`.
        """
        what = "a conversation (a list of messages) or a list of conversations"
        inputs = _as_list(conversations, "conversations", what)
        if inputs and isinstance(inputs[0], dict):
            inputs = [inputs]
        return self._run(inputs, "conversations", self.encode_chat, sampling_params, use_tqdm)

    def _run(
        self,
        inputs: Sequence[Any],
        name: str,
        encode: Callable[[Any], tuple[str | None, list[int]]],
        sampling_params: ParamsArg | Sequence[ParamsArg] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Encode and validate every input (a ValueError names `name[i]`), queue the batch and
        step it to the end, holding the call lock. Collection is paused while the batch is
        built, and the batch is frozen out of collection while it runs (`gc_paused`,
        `gc_frozen`)."""

        def build() -> tuple[list, list[SamplingParams]]:
            encoded = CheckedBatch(self.llm_engine)  # each prompt's ids packed for the planner
            for i, item in enumerate(inputs):
                try:
                    encoded.add(*encode(item))
                except ValueError as e:
                    raise ValueError(f"{name}[{i}]: {e}") from None
            return encoded, self._params_list(sampling_params, len(encoded))

        results = dict(self.run_batch(build, use_tqdm))
        missing = [i for i in range(len(inputs)) if i not in results]
        if missing:  # a guard: the engine ran out of work before these finished
            raise RuntimeError(f"the engine stopped before inputs {missing[:5]} finished")
        return [results[i] for i in range(len(inputs))]

    def run_batch(
        self,
        build: Callable[
            [], tuple[Sequence[tuple[str | None, list[int]]], Sequence[SamplingParams]]
        ],
        use_tqdm: bool = True,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """The offline batch runner (`generate`/`chat`, `phloem generate`, `phloem run-batch`):
        `build()` returns the batch's (text, token ids) pairs, each prompt already checked by
        `LLMEngine.validate_prompt`, and their sampling parameters; the batch is queued as a
        whole (`add_requests`: planned for prefix sharing) and stepped to the end (with
        data_parallel_size > 1: planned here and dealt to the replicas), yielding
        (index in the batch, RequestOutput) as each request finishes. Collection is paused while
        `build` runs and the batch is queued, and everything alive then is frozen out of
        collection until the iteration ends (`gc_paused`, `gc_frozen`). Holds the call lock
        until the iteration ends; requests still unfinished when it ends early (break,
        exception) are aborted. Raises what `build` or `add_requests` raise."""
        with self._exclusive(), contextlib.ExitStack() as frozen:
            with gc_paused() as gc_enabled:
                encoded, params = build()
                outputs = self._start_batch(encoded, params, use_tqdm)
                if gc_enabled:  # frozen before collection resumes: never traversed at all
                    frozen.enter_context(gc_frozen())
            with contextlib.closing(outputs):
                yield from outputs

    def _start_batch(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        use_tqdm: bool,
    ) -> Generator[tuple[int, RequestOutput], None, None]:
        """Queue a validated batch (or plan it and hand it to the replicas); returns the
        iterator of its (index, output) pairs, in completion order."""
        engine = self.llm_engine
        if isinstance(engine, LLMEngine):
            request_ids = self._add_requests(encoded, params, validated=True)
            index = {request_id: i for i, request_id in enumerate(request_ids)}
            return ((index[o.request_id], o) for o in self._iter_outputs(request_ids, use_tqdm))
        plan = self.plan(planner_input(encoded), params)  # the deal's units, planned once
        planned = engine.config.cache.enable_prefix_caching and len(encoded) > 1
        self.last_plan = plan if planned else None
        return with_progress(engine.run(encoded, params, plan), len(encoded), use_tqdm)

    def _params_list(
        self, sampling_params: ParamsArg | Sequence[ParamsArg] | None, num_prompts: int
    ) -> list[SamplingParams]:
        """One validated SamplingParams per prompt (see `generate` for the accepted forms)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, dict)):
            return [self._check_params(sampling_params, "sampling_params")] * num_prompts
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(
                "sampling_params must be a SamplingParams, a dict of its fields, or a list of "
                f"them, got {type(sampling_params).__name__}"
            )
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries for {num_prompts} prompts"
            )
        backend = self.llm_engine.config.structured_outputs.backend  # grammars checked first,
        validate_constraints(sampling_params, backend, default_num_threads())  # on threads
        checked: dict[int, SamplingParams] = {}  # the same object is checked once
        out = []
        for i, params in enumerate(sampling_params):
            key = id(params)
            if key not in checked:
                checked[key] = self._check_params(params, f"sampling_params[{i}]")
            out.append(checked[key])
        return out

    def _check_params(self, params: ParamsArg, where: str) -> SamplingParams:
        """`params` as a SamplingParams checked against this model, errors naming `where`."""
        if isinstance(params, dict):
            try:
                params = SamplingParams.from_dict(params)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        elif not isinstance(params, SamplingParams):
            raise TypeError(
                f"{where} must be a SamplingParams or a dict of its fields, "
                f"got {type(params).__name__}"
            )
        try:
            self.llm_engine.validate_params(params)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return params

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the call lock for one call: waits while another thread's call runs; raises
        RuntimeError for a call nested in one this thread is running (it would deadlock)."""
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "this LLM is already running a call in this thread (e.g. generate() inside an "
                "iter_outputs() loop); finish that call first"
            )
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def plan(
        self,
        prompts: Sequence[PromptType | list[int] | array],
        sampling_params: ParamsArg | Sequence[ParamsArg] | None = None,
    ) -> PrefixPlan:
        """The global prefix plan for a batch (BatchLLM §4): groups of requests sharing a prefix
        computed once, and the schedule order (decode-heavy first). Runs no model.

        Args:
            prompts: as for `generate`, or token-id lists (or `array('I')`s of ids).
            sampling_params: one for all or one per prompt, as for `generate` (their
                `max_tokens` order the plan).
        Returns:
            the `PrefixPlan` (`describe()` prints it; `planned_reuse_ratio` is its saving).
        Raises:
            TypeError, ValueError: as `generate`, for the prompts and sampling_params.
        """
        with gc_paused():
            # token-id lists as they are: the planner reads them and keeps none
            prompt_token_ids = [
                p if isinstance(p, (list, array)) else self.encode_prompt(p)[1] for p in prompts
            ]
            params_list = self._params_list(sampling_params, len(prompt_token_ids))
            max_model_len = self.llm_engine.max_model_len
            max_tokens = [
                p.max_tokens if p.max_tokens is not None else max_model_len - len(ids)
                for ids, p in zip(prompt_token_ids, params_list)
            ]
            return plan_prefix_groups(
                prompt_token_ids, max_tokens, self.llm_engine.config.cache.block_size
            )

    def add_requests(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        sampling_params: Sequence[SamplingParams],
        *,
        validated: bool = False,
        plan: PrefixPlan | None = None,
    ) -> list[str]:
        """Queue a whole batch, planned globally for prefix sharing when it is enabled: each
        shared group's prefix is computed once and the queue follows the plan's order.
        Returns the request ids in input order. Sets `last_plan` (None when not planned).

        `validated`: every prompt already passed `LLMEngine.validate_prompt` (as `generate`
        checks them while encoding), so `add_request` skips a second pass over its tokens.
        `plan`: this very batch's plan, made elsewhere (a data-parallel replica's share's, from
        the driver's: `replica_partition.share_plan`), taken as it is; None plans it here.
        Collection is paused meanwhile (see `gc_paused`). If any request is rejected, those
        already queued are aborted before the error propagates (nothing of the batch stays).

        Raises:
            ValueError: a prompt or its sampling parameters cannot run on this model.
            RuntimeError: called from inside another call on this LLM in the same thread.
        """
        self._single_engine()
        with self._exclusive():
            return self._add_requests(encoded, sampling_params, validated=validated, plan=plan)

    def _add_requests(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        sampling_params: Sequence[SamplingParams],
        *,
        validated: bool = False,
        plan: PrefixPlan | None = None,
    ) -> list[str]:
        """`add_requests` without the call lock (the caller holds it)."""
        engine = self._single_engine()
        self.last_plan = None
        with gc_paused():
            order: Sequence[int] = range(len(encoded))
            groups: dict[int, SharedPrefix] = {}
            if engine.config.cache.enable_prefix_caching and len(encoded) > 1:
                plan = plan or self.plan(planner_input(encoded), sampling_params)
                self.last_plan = plan
                order = plan.order
                for group in plan.shared_groups:
                    shared = SharedPrefix(
                        group.prefix_len, num_unfinished=len(group.request_indices)
                    )
                    for i in group.request_indices:
                        groups[i] = shared
            request_ids: list[str] = [""] * len(encoded)
            added: list[str] = []
            try:
                for i in order:
                    text, ids = encoded[i]
                    request_ids[i] = engine.add_request(
                        ids,
                        sampling_params[i],
                        prompt=text,
                        shared_prefix=groups.get(i),
                        validated=validated,
                        planned=True,
                    )
                    added.append(request_ids[i])
            except BaseException:
                engine.abort_request(added)
                raise
        return request_ids

    def iter_outputs(
        self, request_ids: list[str], use_tqdm: bool = True
    ) -> Iterator[RequestOutput]:
        """Step the engine and yield each of `request_ids`' finished RequestOutput as soon as it
        finishes (so a job can persist results one by one). The progress bar shows prompts
        done, input/output tokens/s and the prefix reuse ratio. Objects alive at the start
        (the queued batch) are frozen out of garbage collection until the iteration ends
        (`gc_frozen`). Holds the call lock until the iteration ends; requests of `request_ids`
        still unfinished when it ends early (break, exception) are aborted."""
        self._single_engine()
        with self._exclusive(), gc_frozen() if gc.isenabled() else contextlib.nullcontext():
            yield from self._iter_outputs(request_ids, use_tqdm)

    def _iter_outputs(
        self, request_ids: list[str], use_tqdm: bool
    ) -> Generator[RequestOutput, None, None]:
        engine = self._single_engine()
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start = time.monotonic()
        num_in = num_out = num_reused = 0
        try:
            while pending and engine.has_unfinished_requests():
                try:  # FINAL mode (the LLM's engine): every step output is a RequestOutput
                    outputs = cast("list[RequestOutput]", engine.step())
                except BaseException:  # the engine's state is unknown: start the next call clean
                    engine.abort_all()
                    raise
                for output in outputs:
                    if not output.finished or output.request_id not in pending:
                        continue
                    pending.discard(output.request_id)
                    num_in += len(output.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in output.outputs)
                    num_reused += output.num_cached_tokens
                    elapsed = max(time.monotonic() - start, 1e-9)
                    bar.set_postfix_str(
                        f"input: {num_in / elapsed:.1f} toks/s, "
                        f"output: {num_out / elapsed:.1f} toks/s, "
                        f"prefix reuse: {num_reused / max(num_in, 1):.0%}",
                        refresh=False,
                    )
                    bar.update(1)
                    yield output
        finally:
            bar.close()
            if pending:  # left early: these requests have no one to return to
                engine.abort_request(list(pending))

    def run_engine(self, request_ids: list[str], use_tqdm: bool = True) -> list[RequestOutput]:
        """Step until the given requests finish; returns their outputs in the given order."""
        results = {o.request_id: o for o in self.iter_outputs(request_ids, use_tqdm)}
        return [results[r] for r in request_ids]
