"""Turns the scheduler's integer decisions into tensors, runs the model and samples.

This is the only place a step's tensors are built: input ids, positions, the slot mapping, block
tables and the positions whose logits are sampled. The model sees packed tokens (no batch dim)
and reads its attention metadata from the forward context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from phloem.core.scheduler import SchedulerOutput
from phloem.forward_context import ForwardContext, forward_context
from phloem.layers.sampler import Sampler, SamplingRow
from phloem.ops.attention.interface import AttentionBackend, AttentionMetadata


@dataclass
class ModelRunnerOutput:
    """Per sampled request (by id): the new token, its log-prob under the model's raw
    distribution, and the top-k log-probs when the request asked for them."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, dict[int, float] | None] = field(default_factory=dict)


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
        num_blocks: KV blocks per layer [blocks]; block_size: tokens per block.
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
        shape = (num_blocks, 2, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(model.num_layers)
        ]
        self.sampler = Sampler(seed=seed, device=device)
        self._generators: dict[str, torch.Generator] = {}

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """Build the step's tensors from the scheduler output (host lists, one copy to device)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[int] = []
        max_blocks = max(len(s.block_ids) for s in sched.scheduled)
        block_tables: list[list[int]] = []
        for i, s in enumerate(sched.scheduled):
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_tokens
            input_ids.extend(s.request.token_ids(start, end))
            positions.extend(range(start, end))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            block_tables.append(table + [0] * (max_blocks - len(table)))
            if s.sample:
                logits_indices.append(len(input_ids) - 1)
                sampled.append(i)
        dev = self.device
        q_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev),
            block_size=bs,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            attn_metadata=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sampled=sampled,
        )

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample a token for every request whose known tokens are all computed.

        Mutates the KV cache (writes the step's K/V) and the seeded requests' generators.
        """
        for request_id in sched.finished_request_ids:
            self._generators.pop(request_id, None)
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out
        inputs = self.prepare_inputs(sched)
        ctx = ForwardContext(inputs.attn_metadata, self.kv_caches, self.backend)
        with forward_context(ctx):
            hidden = self.model(inputs.input_ids, inputs.positions)
        if not inputs.sampled:
            return out
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        rows = [self._sampling_row(sched.scheduled[i].request) for i in inputs.sampled]
        result = self.sampler(logits, rows)
        for k, i in enumerate(inputs.sampled):
            request_id = sched.scheduled[i].request.request_id
            out.sampled_token_ids[request_id] = result.token_ids[k]
            out.logprobs[request_id] = result.logprobs[k]
            out.top_logprobs[request_id] = result.top_logprobs[k]
        return out

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
