"""Turns the scheduler's integer decisions into tensors, runs the model and samples.

This is the only place a step's tensors are built: input ids, positions, the slot mapping, block
tables and the positions whose logits are sampled. The model sees packed tokens (no batch dim)
and reads its attention metadata from the forward context. Each step calls the backend's
`begin_step` once (planning backends such as FlashInfer); decode-only steps replay a captured
CUDA graph when `capture_cuda_graphs` ran (see cuda_graph.py).

A request whose own sampling setup (its generator, its row) or sampling raises, or whose logits
row holds NaN or inf (counted on the device by the sampler, copied behind the step's tokens),
fails alone: its row is sampled as a placeholder so the batch goes on, and its id lands in
`ModelRunnerOutput.failed` for the engine to fail it (see `phloem.engine.llm_engine`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from phloem.core.scheduler import SchedulerOutput
from phloem.forward_context import ForwardContext, forward_context
from phloem.layers.sampler import (
    NON_FINITE_MESSAGE,
    SampledTokens,
    Sampler,
    SamplingRow,
    seeded_generator,
)
from phloem.ops.attention.interface import AttentionBackend, DecodePath
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.kv_store import allocate_kv_cache
from phloem.ops.staging import to_device
from phloem.sampling_params import SamplingParams
from phloem.worker.cuda_graph import CUDAGraphRunner

# the row sampled for a request whose own row failed: greedy, so it draws no randomness
_PLACEHOLDER_PARAMS = SamplingParams(temperature=0.0)


def _placeholder_row(request) -> SamplingRow:
    """The row sampled for a request that failed alone: greedy, no bans, draws nothing."""
    return SamplingRow(_PLACEHOLDER_PARAMS, request.prompt_token_ids, [], generator=None)


@dataclass
class ModelRunnerOutput:
    """Per sampled request (by id): the new token, its log-prob under the model's raw
    distribution, and the top-k log-probs when the request asked for them; `failed` maps the
    requests that failed alone this step to the reason (their token is a placeholder);
    `num_nans_in_logits` counts the NaN/inf values of each sampled row that had any (vLLM's
    name; those requests are in `failed` with `NON_FINITE_MESSAGE`)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float | None] = field(default_factory=dict)
    top_logprobs: dict[str, dict[int, float] | None] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    num_nans_in_logits: dict[str, int] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose sampling is enqueued on the device (see `ModelRunner.launch`)."""

    request_ids: list[str]  # the sampled requests, in row order
    sampled: SampledTokens
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed


def shared_prefix_len(s) -> int:
    """Tokens at the start of the request's block table that are its prefix group's shared
    blocks (0 when it has none, or they are not held yet).

    Comparing the first and the last prefix block is enough: a table holds a group's block at
    the same index only by attaching the group's blocks (or a radix-cache path through them,
    which fixes every block before it), never by a fresh allocation.
    """
    group = s.request.shared_prefix
    if group is None or group.block_ids is None:
        return 0
    ids, table = group.block_ids, s.block_ids
    n = len(ids)
    if len(table) >= n and table[n - 1] == ids[-1] and table[0] == ids[0]:
        return group.prefix_len
    return 0


@dataclass
class _HostStep:
    """A step's inputs on the host (T tokens, B sequences, S sampled): numpy arrays for what
    becomes a tensor, lists for what backends plan from."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B] the scheduler's lists (not copies: read only)
    logits_indices: list[int]  # [S]
    sampled: list[int]  # [S]
    prefix_lens: list[int] | None  # [B], only when the backend batches prefix groups
    pending: list[tuple[int, str]]  # (token index, request id): ids sampled by the step in
    # flight (async scheduling), filled in on the device from that step's sampled tokens

    @classmethod
    def build(cls, sched: SchedulerOutput, block_size: int, prefix_lens: bool) -> _HostStep:
        """Each scheduled request b computes positions [start_b, end_b):

            |-- computed (start_b) --|-- this step: q_len_b tokens --|-- later --|

        Per-request work is a few list slices; per-token work is vectorized (numpy)."""
        bs = block_size
        scheduled = sched.scheduled
        num_seqs = len(scheduled)
        ids: list[int] = []
        blocks: list[int] = []  # per request, the blocks its new tokens fall in, concatenated
        starts = [s.num_computed_tokens for s in scheduled]
        q_lens = [s.num_tokens for s in scheduled]
        tables = [s.block_ids for s in scheduled]
        pending: list[tuple[int, str]] = []
        for s, start, q_len, table in zip(scheduled, starts, q_lens, tables):
            end = start + q_len
            request = s.request
            ids += request.token_ids(start, end)
            if end > request.num_known_tokens:  # the last one is pending (one step in flight)
                pending.append((len(ids), request.request_id))
                ids.append(0)
            blocks += table[start // bs : (end - 1) // bs + 1]
        seq_lens = [a + n for a, n in zip(starts, q_lens)]
        qsl = [0, *itertools.accumulate(q_lens)]
        sampled = [i for i, s in enumerate(scheduled) if s.sample]
        # Per token t of sequence b: position start_b + (t - qsl_b); its block is entry
        # position // bs - start_b // bs of b's run in `blocks`.
        start_a = np.array(starts, dtype=np.int64)
        q_len_a = np.array(q_lens, dtype=np.int64)
        seq_of = np.repeat(np.arange(num_seqs), q_len_a)
        positions = np.arange(qsl[-1], dtype=np.int64) + np.repeat(
            start_a - np.array(qsl[:-1], dtype=np.int64), q_len_a
        )
        first_block = start_a // bs
        run_len = (start_a + q_len_a - 1) // bs - first_block + 1
        run_off = np.cumsum(run_len) - run_len
        block_of = np.array(blocks, dtype=np.int64)[
            (run_off - first_block)[seq_of] + positions // bs
        ]
        return cls(
            input_ids=np.array(ids, dtype=np.int64),
            positions=positions,
            slots=block_of * bs + positions % bs,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            logits_indices=[qsl[i + 1] - 1 for i in sampled],
            sampled=sampled,
            prefix_lens=[shared_prefix_len(s) for s in scheduled] if prefix_lens else None,
            pending=pending,
        )


@dataclass
class StepInputs:
    """The tensors of one step. T tokens, B sequences, S of them sampled."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S], token index of each sampled sequence's last token
    sampled: list[int]  # [S], index into scheduler_output.scheduled


class ModelRunner:
    """Runs one model over a paged KV cache.

    Args:
        model: a phloem model (`forward(input_ids, positions)`, `compute_logits(hidden)`, and
            `num_layers`, `num_kv_heads`, `head_dim` attributes).
        num_blocks: KV blocks per layer the scheduler may hand out [blocks]; one more block is
            allocated as the scratch block that padding rows of CUDA-graph steps write to.
        block_size: tokens per block.
        kv_dtype: dtype of the KV cache; device: where everything lives.
        kv_layout: "NHD" or "HND" (`CacheConfig.kv_layout`, `kv_store.allocate_kv_cache`).
        backend: the attention backend; seed: the sampler's seed for unseeded requests.
        eos_token_id: banned while a request has fewer than `min_tokens` outputs.
    """

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
        seed: int = 0,
        eos_token_id: int | None = None,
        kv_layout: str = "NHD",
    ) -> None:
        self.model = model
        self.kv_layout = kv_layout
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.kv_dtype = kv_dtype
        self.kv_caches: list[torch.Tensor] = []
        self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler(seed=seed, device=device)
        self._shared_generator = self.sampler.generator  # also behind a wrapped sampler
        self._generators: dict[str, torch.Generator] = {}
        # request id -> (request, its row): rows that never change (no min_tokens bans) are
        # built once per request, not once per step (~1,000 rows a step at BatchLLM scale)
        self._rows: dict[str, tuple[object, SamplingRow]] = {}
        self.graph_runner: CUDAGraphRunner | None = None
        # the last launched step's sampled tokens (device int64 [S]) and request id -> row
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the per-layer caches: num_blocks usable blocks plus the scratch block
        (id num_blocks). Drops any captured CUDA graphs (they point at the old caches)."""
        self.graph_runner = None
        self.kv_caches = []
        geometry = (num_blocks + 1, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [
            allocate_kv_cache(*geometry, self.kv_dtype, self.device, self.kv_layout)
            for _ in range(self.model.num_layers)
        ]
        self.num_blocks = num_blocks

    def warmup_attention(self, num_heads: int) -> None:
        """Compile the attention backend's kernels for common shapes now (`warmup`: e.g. the
        shared-prefix Triton kernels; a no-op for most backends), reading only the scratch block."""
        if not self.kv_caches:
            return
        with torch.inference_mode():
            dtype = next(self.model.parameters()).dtype
            scale = self.model.head_dim**-0.5
            self.backend.warmup(self.kv_caches[0], num_heads, self.num_blocks, scale, dtype)

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """Capture decode graphs for batch sizes up to max_num_seqs (CUDA only)."""
        runner = CUDAGraphRunner(
            self.model,
            self.kv_caches,
            self.backend,
            self.block_size,
            scratch_block=self.num_blocks,
            max_num_seqs=max_num_seqs,
            device=self.device,
        )
        runner.capture()
        self.graph_runner = runner

    # -- inputs ---------------------------------------------------------------------------------

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """Build the step's tensors from the scheduler output (host arrays, then one copy each
        to the device). The 0-padded device block table is built only for backends that read
        it (`needs_block_tables`)."""
        backend = self.backend
        host = _HostStep.build(sched, self.block_size, backend.reads_prefix_lens)
        dev = self.device
        max_seq_len = max(host.seq_lens)
        qsl = host.query_start_loc
        if backend.needs_block_tables:
            width = max(len(t) for t in host.block_tables)
            padded = np.zeros((len(host.block_tables), width), dtype=np.int32)
            for row, table in zip(padded, host.block_tables):
                row[: len(table)] = table
            block_tables = to_device(padded, dev)
        else:
            block_tables = torch.empty(0, 0, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=to_device(host.slots, dev),
            query_start_loc=to_device(np.array(qsl, dtype=np.int32), dev),
            seq_lens=to_device(np.array(host.seq_lens, dtype=np.int32), dev),
            block_tables=block_tables,
            block_size=self.block_size,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=host.seq_lens,
            block_tables_cpu=host.block_tables,
            prefix_lens_cpu=host.prefix_lens,
        )
        input_ids = to_device(host.input_ids, dev)
        if host.pending:
            self._fill_pending(input_ids, host.pending)
        return StepInputs(
            input_ids=input_ids,
            positions=to_device(host.positions, dev),
            attn_metadata=meta,
            logits_indices=to_device(np.array(host.logits_indices, dtype=np.int64), dev),
            sampled=host.sampled,
        )

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample a token for every request whose known tokens are all computed.

        Mutates the KV cache (writes the step's K/V) and the seeded requests' generators.
        Decode-only steps replay a CUDA graph when graphs were captured and one fits.
        """
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep | None:
        """Enqueue one step (forward, sampling, the copy of the tokens to the host) and return
        without waiting for the device; `collect` gets the result. Input tokens that are still
        pending (sampled by the previous launched step, async scheduling) are taken from that
        step's device tensor. None for an empty step."""
        for request_id in sched.finished_request_ids:
            self._generators.pop(request_id, None)
            self._rows.pop(request_id, None)
        if sched.is_empty:
            return None
        hidden, sampled = self._run_graph(sched)
        if hidden is None:
            inputs = self.prepare_inputs(sched)
            sampled = inputs.sampled
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            if not sampled:
                return None
            hidden = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(hidden)
        requests = [sched.scheduled[i].request for i in sampled]
        rows, failed = self._sampling_rows(requests)
        handle = self._launch_sampler(logits, rows, requests, failed)
        request_ids = [r.request_id for r in requests]
        self._last_sampled = (handle.tokens, {rid: k for k, rid in enumerate(request_ids)})
        return LaunchedStep(request_ids, handle, failed)

    @staticmethod
    def collect(launched: LaunchedStep | None) -> ModelRunnerOutput:
        """Wait for a launched step's tokens (only that step's) and return them by request."""
        out = ModelRunnerOutput()
        if launched is None:
            return out
        result = launched.sampled.result()
        out.failed = launched.failed
        for k, request_id in enumerate(launched.request_ids):
            out.sampled_token_ids[request_id] = result.token_ids[k]
            out.logprobs[request_id] = result.logprobs[k]
            out.top_logprobs[request_id] = result.top_logprobs[k]
            if result.num_nonfinite[k]:
                out.num_nans_in_logits[request_id] = result.num_nonfinite[k]
                out.failed.setdefault(request_id, NON_FINITE_MESSAGE)
        return out

    @staticmethod
    def needs_token_history(sched: SchedulerOutput) -> bool:
        """True if sampling this step reads earlier output tokens (penalties), so a step in
        flight must be collected (its tokens appended) before this one is launched."""
        return any(s.request.sampling_params.has_penalties for s in sched.scheduled)

    def _fill_pending(self, input_ids: torch.Tensor, pending: list[tuple[int, str]]) -> None:
        """input_ids[index] = the token the last launched step sampled for the request."""
        if self._last_sampled is None:
            raise RuntimeError("a step has pending input tokens but no step was launched")
        tokens, rows = self._last_sampled
        try:
            src = [rows[request_id] for _, request_id in pending]
        except KeyError as e:
            msg = f"request {e} has a pending token the last step did not sample"
            raise RuntimeError(msg) from None
        index = np.array([[i for i, _ in pending], src], dtype=np.int64)
        index_t = to_device(index, input_ids.device)
        input_ids.index_copy_(0, index_t[0], tokens[index_t[1]])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One eager forward pass: plan the attention step once, then run every layer."""
        self.backend.begin_step(meta)
        ctx = ForwardContext(meta, self.kv_caches, self.backend, valid_slots=True)
        with forward_context(ctx):  # the runner's steps carry no -1 slots: sync-free KV writes
            return self.model(input_ids, positions)

    def _run_graph(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[int]]:
        """(hidden of every sequence, sampled indices) from a graph replay when the step is
        decode-only and a bucket fits it; (None, []) otherwise."""
        runner = self.graph_runner
        scheduled = sched.scheduled
        if runner is None or len(scheduled) > runner.max_batch_size:
            return None, []
        if any(s.num_tokens != 1 or not s.sample for s in scheduled):
            return None, []
        bs = self.block_size
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        pending: list[tuple[int, str]] = []
        for s in scheduled:
            pos = s.num_computed_tokens
            if pos < s.request.num_known_tokens:
                ids.append(s.request.token_ids(pos, pos + 1)[0])
            else:  # sampled by the step in flight: filled in on the device
                pending.append((len(ids), s.request.request_id))
                ids.append(0)
            positions.append(pos)
            slots.append(s.block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            tables.append(s.block_ids)
        path, groups = DecodePath.GRAPH, None
        if self.backend.reads_prefix_lens:
            prefix_lens = [shared_prefix_len(s) for s in scheduled]
            if any(prefix_lens):
                in_graph = runner.has_graph(len(scheduled), "shared_prefix")
                path, groups = self.backend.plan_decode(seq_lens, tables, prefix_lens, bs, in_graph)
                if path is DecodePath.EAGER:
                    return None, []  # prefix sharing pays this step: the cascade path, eagerly
        fill = None
        if pending:
            fill = lambda input_ids: self._fill_pending(input_ids, pending)  # noqa: E731
        variant = "shared_prefix" if path is DecodePath.SHARED_GRAPH else "plain"
        hidden = runner.run(
            ids, positions, slots, seq_lens, tables, fill_inputs=fill, variant=variant,
            groups=groups,
        )  # fmt: skip
        return hidden, list(range(len(scheduled)))

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A dummy step as large as any the scheduler can form: one prompt chunk of num_tokens
        tokens, then logits and log-softmax for num_seqs rows. Needs ceil(num_tokens / block_size)
        blocks in the current cache; writes garbage into them."""
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        if num_blocks > self.num_blocks:
            raise ValueError(f"profile step needs {num_blocks} blocks, cache has {self.num_blocks}")
        table = list(range(num_blocks))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            block_tables=torch.tensor([table], dtype=torch.int32, device=dev),
            block_size=bs,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc_cpu=[0, num_tokens],
            seq_lens_cpu=[num_tokens],
            block_tables_cpu=[table],
        )
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", 1000)
        ids = torch.randint(0, vocab, (num_tokens,), device=dev)
        positions = torch.arange(num_tokens, device=dev)
        hidden = self.forward(ids, positions, meta)
        rows = hidden[: min(num_seqs, num_tokens)]
        logits = self.model.compute_logits(rows)
        torch.log_softmax(logits.float(), dim=-1).argmax(dim=-1)

    def _launch_sampler(
        self, logits: torch.Tensor, rows: list[SamplingRow], requests: list, failed: dict
    ) -> SampledTokens:
        """`sampler.launch(logits, rows)`, failing alone each row whose sampling raises.

        When the batch raises, each row is tried alone (the others replaced by greedy
        placeholders, every generator's state restored after each trial, so the rows that go on
        draw what they would have, less anything the failed batch attempt drew); the rows that
        raise on their own are failed (added to `failed`) and replaced by placeholders for the
        real launch. A fault no single row causes, or one that survives the replacement, is the
        step's own: it propagates. Mutates `rows` and `failed` only on that path."""
        try:
            return self.sampler.launch(logits, rows)
        except Exception:  # noqa: BLE001 - find out whether one request causes it
            placeholders = [_placeholder_row(r) for r in requests]
            generators = {id(g): g for g in [self._shared_generator] + [r.generator for r in rows]}
            states = [(g, g.get_state()) for g in generators.values() if g is not None]
            culprits: dict[int, str] = {}
            for i in range(len(rows)):
                trial = [*placeholders[:i], rows[i], *placeholders[i + 1 :]]
                try:
                    self.sampler.launch(logits, trial)
                except Exception as e:  # noqa: BLE001 - row i's own fault
                    culprits[i] = f"sampling failed: {type(e).__name__}: {e}"
                for generator, state in states:
                    generator.set_state(state)
            if not culprits:
                raise
        for i, message in culprits.items():
            failed[requests[i].request_id] = message
            rows[i] = placeholders[i]
        return self.sampler.launch(logits, rows)

    def _sampling_rows(self, requests: list) -> tuple[list[SamplingRow], dict[str, str]]:
        """The sampling rows of a step's sampled requests, and {request id: reason} for those
        whose row could not be built: they get a greedy placeholder row (the batch goes on)
        and are failed by the engine after the step."""
        rows: list[SamplingRow] = []
        failed: dict[str, str] = {}
        for request in requests:
            try:
                rows.append(self._sampling_row(request))
            except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone
                failed[request.request_id] = f"sampling setup failed: {type(e).__name__}: {e}"
                rows.append(_placeholder_row(request))
        return rows, failed

    def _sampling_row(self, request) -> SamplingRow:
        cached = self._rows.get(request.request_id)
        if cached is not None and cached[0] is request:
            return cached[1]
        params = request.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = seeded_generator(params.generator_seed(), self.device)
                self._generators[request.request_id] = generator
        banned: list[int] = []
        # outputs before this sample: appended ones plus those pending from earlier steps (the
        # async scheduler counts this step's own sample as pending already)
        num_before = request.num_output_tokens + max(0, request.num_pending_tokens - 1)
        if num_before < params.min_tokens:
            banned = list(params.stop_token_ids)
            if self.eos_token_id is not None:
                banned.append(self.eos_token_id)
        row = SamplingRow(
            params=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,  # the request's list, appended in place
            generator=generator,
            banned_token_ids=banned,
        )
        if params.min_tokens == 0:  # nothing in the row depends on the step
            self._rows[request.request_id] = (request, row)
        return row
