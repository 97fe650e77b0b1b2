"""Turns the scheduler's integer decisions into tensors, runs the model and samples.

This is the only place a step's tensors are built: input ids, positions, the slot mapping, block
tables and the positions whose logits are sampled. The model sees packed tokens (no batch dim)
and reads its attention metadata from the forward context. Each step calls the backend's
`begin_step` once (planning backends such as FlashInfer); decode-only steps replay a captured
CUDA graph when `capture_cuda_graphs` ran (see cuda_graph.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from phloem.core.scheduler import SchedulerOutput
from phloem.forward_context import ForwardContext, forward_context
from phloem.layers.sampler import Sampler, SamplingRow
from phloem.ops.attention.interface import AttentionBackend, AttentionMetadata
from phloem.worker.cuda_graph import CUDAGraphRunner, sync_free_kv_writes


@dataclass
class ModelRunnerOutput:
    """Per sampled request (by id): the new token, its log-prob under the model's raw
    distribution, and the top-k log-probs when the request asked for them."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float | None] = field(default_factory=dict)
    top_logprobs: dict[str, dict[int, float] | None] = field(default_factory=dict)


def shared_prefix_len(s) -> int:
    """Tokens at the start of the request's block table that are its prefix group's shared
    blocks (0 when it has none, or they are not held yet)."""
    group = s.request.shared_prefix
    if group is None or group.block_ids is None:
        return 0
    n = len(group.block_ids)
    return group.prefix_len if s.block_ids[:n] == group.block_ids else 0


@dataclass
class _HostStep:
    """A step's inputs as host lists (T tokens, B sequences, S sampled)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    sampled: list[int]
    prefix_lens: list[int]  # filled only when the backend batches prefix groups

    @classmethod
    def build(cls, sched: SchedulerOutput, block_size: int, prefix_lens: bool) -> _HostStep:
        """Each scheduled request computes positions [start, end):
        |-- computed (start) --|-- this step: end - start --|-- later --|"""
        bs = block_size
        step = cls([], [], [], [0], [], [], [], [], [])
        for i, s in enumerate(sched.scheduled):
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_tokens
            step.input_ids.extend(s.request.token_ids(start, end))
            step.positions.extend(range(start, end))
            table = s.block_ids
            step.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            step.query_start_loc.append(len(step.input_ids))
            step.seq_lens.append(end)
            step.block_tables.append(table)
            if prefix_lens:  # only a backend that batches prefix groups reads them
                step.prefix_lens.append(shared_prefix_len(s))
            if s.sample:
                step.logits_indices.append(len(step.input_ids) - 1)
                step.sampled.append(i)
        return step


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
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.kv_dtype = kv_dtype
        self.kv_caches: list[torch.Tensor] = []
        self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler(seed=seed, device=device)
        self._generators: dict[str, torch.Generator] = {}
        self.graph_runner: CUDAGraphRunner | None = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the per-layer caches: num_blocks usable blocks plus the scratch block
        (id num_blocks). Drops any captured CUDA graphs (they point at the old caches)."""
        self.graph_runner = None
        self.kv_caches = []
        shape = (num_blocks + 1, 2, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.model.num_layers)
        ]
        self.num_blocks = num_blocks

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
        """Build the step's tensors from the scheduler output (host lists, one copy to device)."""
        uses_groups = hasattr(self.backend, "plan_decode")
        host = _HostStep.build(sched, self.block_size, prefix_lens=uses_groups)
        dev = self.device
        q_lens = [b - a for a, b in zip(host.query_start_loc, host.query_start_loc[1:])]
        max_blocks = max(len(t) for t in host.block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in host.block_tables]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(host.slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(host.query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(host.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            block_size=self.block_size,
            max_query_len=max(q_lens),
            max_seq_len=max(host.seq_lens),
            query_start_loc_cpu=host.query_start_loc,
            seq_lens_cpu=host.seq_lens,
            block_tables_cpu=host.block_tables,
            prefix_lens_cpu=host.prefix_lens if uses_groups else None,
        )
        return StepInputs(
            input_ids=torch.tensor(host.input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(host.positions, dtype=torch.int64, device=dev),
            attn_metadata=meta,
            logits_indices=torch.tensor(host.logits_indices, dtype=torch.int64, device=dev),
            sampled=host.sampled,
        )

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample a token for every request whose known tokens are all computed.

        Mutates the KV cache (writes the step's K/V) and the seeded requests' generators.
        Decode-only steps replay a CUDA graph when graphs were captured and one fits.
        """
        for request_id in sched.finished_request_ids:
            self._generators.pop(request_id, None)
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out
        hidden, sampled = self._run_graph(sched)
        if hidden is None:
            inputs = self.prepare_inputs(sched)
            sampled = inputs.sampled
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            if not sampled:
                return out
            hidden = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(hidden)
        rows = [self._sampling_row(sched.scheduled[i].request) for i in sampled]
        result = self.sampler(logits, rows)
        for k, i in enumerate(sampled):
            request_id = sched.scheduled[i].request.request_id
            out.sampled_token_ids[request_id] = result.token_ids[k]
            out.logprobs[request_id] = result.logprobs[k]
            out.top_logprobs[request_id] = result.top_logprobs[k]
        return out

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """One eager forward pass: plan the attention step once, then run every layer."""
        begin_step = getattr(self.backend, "begin_step", None)
        if begin_step is not None:
            begin_step(meta)
        writes = sync_free_kv_writes() if self.device.type == "cuda" else contextlib.nullcontext()
        with forward_context(ForwardContext(meta, self.kv_caches, self.backend)), writes:
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
        for s in scheduled:
            pos = s.num_computed_tokens
            ids.append(s.request.token_ids(pos, pos + 1)[0])
            positions.append(pos)
            slots.append(s.block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            tables.append(s.block_ids)
        plan_decode = getattr(self.backend, "plan_decode", None)
        if plan_decode is not None:
            prefix_lens = [shared_prefix_len(s) for s in scheduled]
            if any(prefix_lens) and plan_decode(seq_lens, tables, prefix_lens, bs) is not None:
                return None, []  # prefix sharing pays this step: run the cascade path eagerly
        hidden = runner.run(ids, positions, slots, seq_lens, tables)
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

    def _sampling_row(self, request) -> SamplingRow:
        params = request.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self._generators[request.request_id] = generator
        banned: list[int] = []
        if request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if self.eos_token_id is not None:
                banned.append(self.eos_token_id)
        return SamplingRow(
            params=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=generator,
            banned_token_ids=banned,
        )
