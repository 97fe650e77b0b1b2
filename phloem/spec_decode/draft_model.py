"""Draft-model proposals: a small model with the target's vocabulary, run in the engine's process
by a `ModelRunner` of its own over its own paged KV cache, drafts k tokens greedily per request
(Leviathan et al. 2023, arXiv 2211.17192, §2.3, with Mp the draft model; vLLM's and SGLang's
"draft_model" method).

Per `propose` call, for the requests that may draft (k_b > 0, history of L_b tokens):

1. `DraftKV.sync` cuts the draft cache back to what still agrees with the history (rejected
   drafts are rolled back there as in the target's cache), and blocks for L_b + k_b - 1 positions
   are reserved (when the pool is short, the least recently used requests that do not draft now
   are evicted; a request that still does not fit gets no drafts).
2. Catch-up passes feed the history tokens the draft has not seen (the prompt on first use, then
   the accepted drafts and the target's token), packed over requests in passes of at most
   `max_pass_tokens` tokens; the last position's argmax is d_1.
3. k - 1 decode passes feed d_j at position L_b + j - 1 and take d_{j+1} = argmax:

       position:  0 ... L_b - 1 | L_b ... L_b + k_b - 2 | (L_b + k_b - 1)
       input:     |-- history --|-- d_1 .. d_{k_b - 1} --|
       output:                d_1   d_2 ...          d_{k_b}  (not fed: no KV)

The drafts are deterministic (greedy), so their q is one-hot and the verifier's
`draft_probs=None` path is exact for sampled requests too. Passes run eagerly (no CUDA graphs).

Draft KV size (`draft_kv_blocks`): room for `max_num_seqs` sequences of `max_model_len + k`
tokens, capped at `DRAFT_KV_CPU_BYTES` on the CPU or `DRAFT_KV_GPU_SHARE` of the device's memory
on CUDA, and never below one such sequence. The draft is loaded before the target's KV pool is
sized, so on CUDA the target's profile counts the draft's weights and cache as used memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from phloem.config import EMBEDDED_DRAFT, EngineConfig, SchedulerConfig, SpeculativeConfig
from phloem.spec_decode.cost_rule import StepTimeModel
from phloem.spec_decode.draft_kv import DraftKV
from phloem.spec_decode.proposer import DraftRequest, Proposer, check_draft_request
from phloem.spec_decode.step_time import count_parameters, step_time_model

DRAFT_KV_CPU_BYTES = 256 << 20  # the draft cache's cap on the CPU [bytes]
DRAFT_KV_GPU_SHARE = 0.04  # the draft cache's cap on CUDA, a share of the device's memory


@dataclass(frozen=True, slots=True)
class _Row:
    """One request's share of a draft pass: `token_ids` fed at positions start, start + 1, ..."""

    index: int  # the request's index in the `propose` call
    start: int
    token_ids: list[int]


class DraftModelProposer(Proposer):
    """Greedy drafts from a draft model (see the module docstring).

    Args:
        runner: a `ModelRunner` of the draft model whose KV pool has `kv.allocator.num_blocks`
            blocks of `kv.block_size` tokens; only its `prepare_inputs`, `forward` and model
            are used (its sequence state and sampler stay idle).
        kv: the draft cache's bookkeeping.
        max_len: the most positions a draft sequence may reach [tokens].
        max_pass_tokens: the most tokens one catch-up pass computes [tokens], >= 1.
        hf_config: the draft model's transformers config (for the cost rule's time model).
    """

    costly = True  # a pass of the draft model per draft

    def __init__(self, runner, kv: DraftKV, max_len: int, max_pass_tokens: int, hf_config):
        if max_pass_tokens < 1:
            raise ValueError(f"max_pass_tokens must be >= 1, got {max_pass_tokens}")
        self.runner, self.kv = runner, kv
        self.max_len, self.max_pass_tokens = max_len, max_pass_tokens
        self.hf_config = hf_config
        self.num_passes = 0  # forward passes of the draft model run so far

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts per request (see `Proposer.propose`): up to `max_draft_tokens` greedy draft
        tokens each; none where the request is too close to `max_len` or its KV does not fit.
        Mutates the draft cache (rollback, catch-up and draft tokens' KV)."""
        for request in requests:
            check_draft_request(request)
        plans = self._plan(requests)
        drafts: list[list[int]] = [[] for _ in requests]
        if not plans:
            return drafts
        with torch.inference_mode():
            for index, token_id in self._catch_up(requests, plans).items():
                drafts[index].append(token_id)
            for j in range(1, max(plans.values())):
                rows = [
                    _Row(i, len(requests[i].token_ids) + j - 1, [drafts[i][-1]])
                    for i, k in plans.items()
                    if k > j
                ]
                for row, token_id in zip(rows, self._forward(requests, rows)):
                    self.kv.append(requests[row.index].request_id, row.token_ids, verified=False)
                    drafts[row.index].append(token_id)
        return drafts

    def finish(self, request_id: str) -> None:
        """Free the request's draft blocks."""
        self.kv.release(request_id)

    def preempted(self, request_id: str) -> None:
        """Free the request's draft blocks (it catches up again when it drafts next)."""
        self.kv.release(request_id)

    def _plan(self, requests: Sequence[DraftRequest]) -> dict[int, int]:
        """{request index: k} of the requests that draft: their caches synced with their
        histories and their blocks reserved (see the module docstring, step 1)."""
        drafting = {r.request_id for r in requests if r.max_draft_tokens > 0}
        plans: dict[int, int] = {}
        for i, request in enumerate(requests):
            length = len(request.token_ids)
            k = min(request.max_draft_tokens, self.max_len - length + 1)
            if k <= 0:
                continue
            self.kv.sync(request.request_id, request.token_ids)
            while not self.kv.reserve(request.request_id, length + k - 1):
                if not self.kv.evict_one(drafting):
                    self.kv.release(request.request_id)
                    break
            else:
                plans[i] = k
        return plans

    def _catch_up(self, requests: Sequence[DraftRequest], plans: dict[int, int]) -> dict[int, int]:
        """Feed each planned request's unseen history tokens, in passes of at most
        `max_pass_tokens` tokens; returns {request index: d_1}."""
        seqs = self.kv.sequences
        todo = {i: len(seqs[requests[i].request_id].token_ids) for i in plans}
        first: dict[int, int] = {}
        while todo:
            rows, budget = [], self.max_pass_tokens
            for i, start in todo.items():
                num = min(len(requests[i].token_ids) - start, budget)
                if num > 0:
                    rows.append(_Row(i, start, list(requests[i].token_ids[start : start + num])))
                    budget -= num
            for row, token_id in zip(rows, self._forward(requests, rows)):
                request = requests[row.index]
                self.kv.append(request.request_id, row.token_ids, verified=True)
                end = row.start + len(row.token_ids)
                if end == len(request.token_ids):
                    first[row.index] = token_id
                    del todo[row.index]
                else:
                    todo[row.index] = end
        return first

    def _forward(self, requests: Sequence[DraftRequest], rows: list[_Row]) -> list[int]:
        """One packed pass of the draft model over `rows` (their KV written into their
        reserved slots); the argmax token after each row's last position."""
        from phloem.worker.input_batch import HostStep

        bs = self.kv.block_size
        tables = [self.kv.sequences[requests[r.index].request_id].block_ids for r in rows]
        positions = np.concatenate(
            [np.arange(r.start, r.start + len(r.token_ids), dtype=np.int64) for r in rows]
        )
        table_of = np.concatenate(
            [np.asarray(t, dtype=np.int64)[np.arange(r.start, r.start + len(r.token_ids)) // bs]
             for r, t in zip(rows, tables)]
        )  # fmt: skip
        q_lens = [len(r.token_ids) for r in rows]
        host = HostStep(
            input_ids=np.array([t for r in rows for t in r.token_ids], dtype=np.int64),
            positions=positions,
            slots=table_of * bs + positions % bs,
            query_lens=q_lens,
            seq_lens=[r.start + n for r, n in zip(rows, q_lens)],
            block_tables=tables,
            logits_indices=list(np.cumsum(q_lens) - 1),
            sampled=list(range(len(rows))),
            prefix_lens=[0] * len(rows) if self.runner.backend.reads_prefix_lens else None,
            pending=[],
        )
        inputs = self.runner.prepare_inputs(host)
        hidden = self.runner.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        logits = self.runner.model.compute_logits(hidden[inputs.logits_indices])
        self.num_passes += 1
        return logits.argmax(dim=-1).tolist()

    def charge(self, target: StepTimeModel, num_drafts: int, device_type: str) -> StepTimeModel:
        """The cost rule's time model with this draft model's work added: `num_drafts` passes
        per drafting step (their fixed part, `t_host_s + t_weights_s` of the draft's own model)
        go into `t_verify_s`, and the draft's compute per token into `c_draft_s`."""
        draft = step_time_model(self.hf_config, device_type)
        return dataclasses.replace(
            target,
            t_verify_s=target.t_verify_s + num_drafts * (draft.t_host_s + draft.t_weights_s),
            c_draft_s=target.c_draft_s + draft.c_token_s,
        )


def check_draft_config(draft_hf_config, target_hf_config) -> None:
    """Raise ValueError naming `speculative_config.model` when the draft's vocabulary differs
    from the target's or it has more parameters than the target (`count_parameters`)."""
    draft_vocab, target_vocab = int(draft_hf_config.vocab_size), int(target_hf_config.vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config.model has a vocabulary of {draft_vocab} tokens, the target "
            f"model {target_vocab}; the draft model must share the target's tokenizer"
        )
    draft_params, target_params = (
        count_parameters(draft_hf_config),
        count_parameters(target_hf_config),
    )
    if draft_params > target_params:
        raise ValueError(
            f"speculative_config.model is larger than the target model ({draft_params:.3g} vs "
            f"{target_params:.3g} parameters); a draft model must be the smaller one"
        )


def draft_kv_blocks(
    bytes_per_block: int, block_size: int, max_len: int, max_num_seqs: int, device
) -> int:
    """Blocks of the draft cache (the module docstring's rule): `max_num_seqs` sequences of
    `max_len` tokens, capped by bytes, at least one sequence's worth."""
    per_seq = -(-max_len // block_size)
    if device.type == "cuda":
        cap = int(torch.cuda.get_device_properties(device).total_memory * DRAFT_KV_GPU_SHARE)
    else:
        cap = DRAFT_KV_CPU_BYTES
    return max(per_seq, min(max_num_seqs * per_seq, cap // bytes_per_block))


def load_draft_proposer(
    config: EngineConfig, target_hf_config, scheduler: SchedulerConfig
) -> DraftModelProposer:
    """Load `config.speculative.model` with phloem's loader on the target's device and dtype,
    check it against the target, and build its runner and cache.

    Raises:
        ValueError: tensor parallelism above 1, a vocabulary that differs from the target's, a
            draft larger than the target, or a draft that fails to load (the reason attached).
    """
    from phloem.models.loader import load_hf_config, load_model, resolve_model, startup_source
    from phloem.worker.worker import kv_bytes_per_block, resolve_device, resolve_dtype

    spec = config.speculative
    assert spec is not None and spec.model is not None
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(
            "speculative_config.method 'draft_model' needs tensor_parallel_size 1, got "
            f"{config.parallel.tensor_parallel_size}"
        )
    model_config = dataclasses.replace(config.model, model=spec.model, quantization=None)
    try:
        source = resolve_model(None if spec.model == EMBEDDED_DRAFT else spec.model)
        source = startup_source(source, model_config)
        hf_config = load_hf_config(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r} cannot be loaded: {e}") from e
    check_draft_config(hf_config, target_hf_config)
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    try:
        model = load_model(source, hf_config, dtype, device, load_format=config.model.load_format)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r} cannot be loaded: {e}") from e
    return _build_proposer(
        spec, config, model, hf_config, scheduler, device, dtype, kv_bytes_per_block
    )


def _build_proposer(
    spec: SpeculativeConfig, config: EngineConfig, model, hf_config, scheduler, device, dtype,
    kv_bytes_per_block,
) -> DraftModelProposer:  # fmt: skip
    """The loaded draft model's attention backend, runner and cache."""
    from phloem.ops.attention import get_attention_backend
    from phloem.worker.model_runner import ModelRunner

    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_len = min(scheduler.max_model_len + spec.num_speculative_tokens, model_len)
    block_size = config.cache.block_size
    backend = get_attention_backend(
        config.model.attention_backend,
        num_heads=int(hf_config.num_attention_heads),
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=dtype,
        kv_dtype=dtype,
        device=device,
        max_num_blocks_per_seq=-(-max_len // block_size),
        max_num_seqs=scheduler.max_num_seqs,
        kv_layout=config.cache.kv_layout,
    )
    num_blocks = spec.draft_num_blocks or draft_kv_blocks(
        kv_bytes_per_block(model, block_size, dtype),
        block_size, max_len, scheduler.max_num_seqs, device,
    )  # fmt: skip
    runner = ModelRunner(
        model, num_blocks, block_size, dtype, device, backend, seed=config.seed,
        kv_layout=config.cache.kv_layout,
    )  # fmt: skip
    kv = DraftKV(num_blocks, block_size)
    return DraftModelProposer(runner, kv, max_len, scheduler.max_num_batched_tokens, hf_config)
