"""Turns the scheduler's integer decisions into tensors, runs the model and samples.

This is the only place a step's tensors are built: input ids, positions, the slot mapping, block
tables and the positions whose logits are sampled. The model sees packed tokens (no batch dim)
and reads its attention metadata from the forward context. Each step calls the backend's
`begin_step` once (planning backends such as FlashInfer). Once graphs are captured, a decode-only
step replays its batch bucket's graph (cuda_graph.py), a verify step of at most k drafts a row
its bucket's verify graph (verify_graph.py), another step of at most the largest token bucket
the piecewise graphs, attention eager between them (piecewise_graph.py); larger steps run
eagerly.

Structured outputs: a step with constrained samples (`SchedulerOutput.structured_seq_ids`) is
launched in parts: `launch` enqueues the forward pass and keeps the logits, `presample` the part
of the sampling that needs no bitmask (while the engine fills it), `sample` gets the step's
grammar bitmask (data: `GrammarBitmask`, filled by the engine once the previous step's tokens
advanced the grammars) and enqueues its copy, the mask and the rest of the sampling. Under async scheduling the forward pass
of step N+1 still overlaps the host's wait for step N; only the constrained step's sampling waits
for the host.

A request whose own sampling setup (its generator, its row) or sampling raises, or whose logits
row holds NaN or inf (counted on the device by the sampler, copied behind the step's tokens),
fails alone (`worker/sampling_rows.py`): its row is sampled as a placeholder so the batch goes
on, and its id lands in `ModelRunnerOutput.failed` for the engine to fail it (see
`phloem.engine.llm_engine`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from phloem.core.scheduler_output import SchedulerOutput
from phloem.forward_context import ForwardContext, forward_context
from phloem.layers.sampler import (
    NON_FINITE_MESSAGE,
    SampledTokens,
    Sampler,
    SamplingRow,
)
from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.kv_store import allocate_kv_cache
from phloem.ops.staging import to_device
from phloem.ops.token_bitmask import bitmask_to_device
from phloem.spec_decode.verifier import VerifyStep, launch_verify
from phloem.structured_output.manager import GrammarBitmask
from phloem.worker.cuda_graph import CUDAGraphRunner, decode_graph_max_batch
from phloem.worker.input_batch import HostStep, InputBatch, SequenceState
from phloem.worker.piecewise_graph import CUDAPieceGraphs, PieceGraphs, PiecewiseGraphRunner
from phloem.worker.runner_output import LaunchedStep, ModelRunnerOutput, StepInputs
from phloem.worker.sampling_rows import SeededRandomness, launch_sampler, sampling_rows
from phloem.worker.stacked_rows import PreviousStep, append_tokens, stack_checks, verify_counts
from phloem.worker.verify_graph import VerifyGraphRunner

__all__ = ["NON_FINITE_MESSAGE", "LaunchedStep", "ModelRunner", "ModelRunnerOutput", "StepInputs"]


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
        self._generators: dict[str, SeededRandomness] = {}  # seeded sequences' (made on first use)
        # the sequences' state between steps (rows that never change are cached there)
        self.input_batch = InputBatch()
        self.graph_runner: CUDAGraphRunner | None = None
        self.piecewise_runner: PiecewiseGraphRunner | None = None
        self.verify_runner: VerifyGraphRunner | None = None
        # the last launched step's sampled tokens, seq id -> row, full rows (`stacked_rows`)
        self._last_sampled: PreviousStep | None = None
        # the step `prepare` built and `launch` has not taken yet: (its output, states, host)
        self._prepared: tuple[SchedulerOutput, list[SequenceState], HostStep | None] | None = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the per-layer caches: num_blocks usable blocks plus the scratch block
        (id num_blocks). Drops any captured CUDA graphs (they point at the old caches)."""
        self.graph_runner = self.piecewise_runner = self.verify_runner = None
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
        """Capture decode graphs for batch sizes up to max_num_seqs, or the lower
        PHLOEM_DECODE_GRAPH_MAX_BATCH (`decode_graph_max_batch`; CUDA only)."""
        runner = CUDAGraphRunner(
            self.model,
            self.kv_caches,
            self.backend,
            self.block_size,
            scratch_block=self.num_blocks,
            max_num_seqs=decode_graph_max_batch(max_num_seqs),
            device=self.device,
        )
        runner.capture()
        self.graph_runner = runner

    def capture_piecewise_graphs(
        self, token_sizes: list[int], graphs: PieceGraphs | None = None
    ) -> None:
        """Capture the pieces of the steps of these token buckets (`piecewise_graph`); `graphs`:
        how (default CUDA graphs; CPU tests pass `RerunPieceGraphs`). Writes the scratch block."""
        runner = PiecewiseGraphRunner(
            self.model, self.kv_caches, self.backend, self.block_size, self.num_blocks,
            token_sizes, self.device, graphs or CUDAPieceGraphs(self.device),
        )  # fmt: skip
        runner.capture()
        self.piecewise_runner = runner

    def capture_verify_graphs(
        self, shapes: dict[int, list[int]], graphs: PieceGraphs | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:  # fmt: skip
        """Capture the verify graphs of `shapes`: query length 1 + w a sequence (a width w)
        -> its buckets (`verify_graph`); `graphs`: how (default CUDA graphs); `backend`: whose
        `prepare_verify_replay` plans them (default the runner's; CPU tests pass a re-planning
        one). Writes the scratch block."""
        runner = VerifyGraphRunner(
            self.model, self.kv_caches, backend or self.backend, self.block_size,
            self.num_blocks, shapes, self.device, graphs or CUDAPieceGraphs(self.device),
        )  # fmt: skip
        runner.capture()
        self.verify_runner = runner

    # -- inputs ---------------------------------------------------------------------------------

    def prepare_inputs(self, host: HostStep) -> StepInputs:
        """The step's tensors from its host arrays (one staged copy each to the device). The
        0-padded device block table is built only for backends that read it
        (`needs_block_tables`). Pending input ids are filled in from the last launched step."""
        dev = self.device
        meta = AttentionMetadata.from_host(
            host.query_lens,
            host.seq_lens,
            host.block_tables,
            self.block_size,
            dev,
            slot_mapping=to_device(host.slots, dev),
            padded_tables=self.backend.needs_block_tables,
            prefix_lens=host.prefix_lens,
        )
        input_ids = to_device(host.input_ids, dev)
        if host.pending:
            self._fill_pending(input_ids, host.pending)
        return StepInputs(
            input_ids=input_ids,
            positions=to_device(host.positions, dev),
            attn_metadata=meta,
            logits_indices=to_device(np.array(host.logits_indices, dtype=np.int64), dev),
        )

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample a token for every sequence whose known tokens are all
        computed (`launch`, then `collect`)."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> LaunchedStep | None:
        """Enqueue one step (forward, sampling, the copy of the tokens to the host) and return
        without waiting for the device; `collect` gets the result. Every scheduler output must
        be launched, once and in order (the worker's sequence state follows them). Input tokens
        still pending (sampled by the previous launched step, async scheduling) are taken from
        that step's device tensor. Mutates the KV cache and the seeded sequences' randomness.
        Steps replay CUDA graphs where captured ones take them (`_run_graph`). None for a step
        that samples nothing. Its host arrays come from `prepare` (run here unless the engine
        ran it ahead)."""
        self.prepare(sched)
        assert self._prepared is not None
        _, states, host = self._prepared
        self._prepared = None
        if host is None:
            return None
        hidden, logits = self._run_graph(host)
        if hidden is None:
            inputs = self.prepare_inputs(host)
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            hidden = hidden[inputs.logits_indices]
        if not host.sampled:
            return None
        if logits is None:
            logits = self.model.compute_logits(hidden)
        elif sched.structured_seq_ids:  # sampled later (`sample`): off the graph's buffer
            logits = logits.clone()
        scheduled = sched.scheduled
        seq_ids = [scheduled[i].seq_id for i in host.sampled]
        sampled_states = [states[i] for i in host.sampled]
        rows, failed = sampling_rows(
            sched, host.sampled, states, self._generators, self.device, self.eos_token_id
        )
        checks = stack_checks(host, sched, states, self._last_sampled, self.device)
        if sched.structured_seq_ids:  # sampled by `sample`, with the grammar bitmask
            return LaunchedStep(seq_ids, sampled_states, None, failed, deferred=(logits, rows),
                                checks=checks)  # fmt: skip
        drafts, full = None, None
        if host.draft_counts:  # a verify step: the rows' 1 + k_b positions, packed
            drafts = [scheduled[i].draft_token_ids for i in host.sampled]
            handle: SampledTokens | VerifyStep = self._launch_verify(
                logits, rows, drafts, seq_ids, sampled_states, failed, checks.valid
            )
            full = handle.full
        else:
            handle = launch_sampler(
                self.sampler, self._shared_generator, logits, rows, seq_ids, sampled_states, failed
            )
        index = {seq_id: k for k, seq_id in enumerate(seq_ids)}
        self._last_sampled = PreviousStep(handle.tokens, index, checks.full(full))
        return LaunchedStep(seq_ids, sampled_states, handle, failed, drafts=drafts, checks=checks)

    def prepare(self, sched: SchedulerOutput) -> None:
        """The host-only part of `launch`: the sequences' states updated by `sched` and the
        step's host arrays (`HostStep`), kept for its `launch`. Enqueues nothing and reads no
        sampled token, so the engine runs it while a constrained step before it still waits
        for its bitmask (`LLMEngine.step`); a no-op when `sched` is already prepared. A step
        prepared and never launched (an exception in between, `LLMEngine.abort_all`) is dropped."""
        if self._prepared is not None and self._prepared[0] is sched:
            return
        for seq_id in sched.finished_seq_ids:
            self._generators.pop(seq_id, None)  # a row of a step in flight keeps its own
        states = self.input_batch.update(sched)
        host = None
        if not sched.is_empty:
            host = HostStep.build(sched, states, self.block_size, self.backend.reads_prefix_lens)
        self._prepared = (sched, states, host)

    @torch.inference_mode()
    def presample(self, launched: LaunchedStep | None) -> None:
        """Enqueue all of a launched constrained step's sampling that needs no bitmask
        (`Sampler.prepare`: its random rows' noise, the non-finite flags, the float32 copy,
        bans, penalties, temperature, every per-row tensor) while the engine's threads fill
        the bitmask, so that `sample` only copies the bitmask, masks and samples. A
        preparation that raises is left to `sample`, which samples the step whole (its rows
        fail alone there; noise drawn before it stays drawn, as `sample` would draw it). No-op
        otherwise."""
        if launched is None or launched.deferred is None or launched.presampled is not None:
            return
        logits, rows = launched.deferred
        try:
            if launched.noise is None:
                launched.noise = self.sampler.draw_noise(rows, logits.shape[1], logits.device)
            launched.presampled = self.sampler.prepare(logits, rows, launched.noise)
        except Exception:  # noqa: BLE001 - `sample` finds the row that raises
            launched.presampled = None

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep | None, grammar: GrammarBitmask, wait=None) -> None:
        """Enqueue the sampling of a launched constrained step with its grammar bitmask (rows
        `grammar.seq_ids`; the others are unconstrained): after `presample`, the bitmask's copy
        and `PreparedSampling.finish` (no Python a row but the row indices of a grammar that
        leaves rows out); else the whole sampling. Must come before the next `launch` (whose
        pending input ids are this step's tokens). `wait`: called before the bitmask's copy
        (`bitmask_to_device(before_copy=)`: the bitmask may still be filled meanwhile).

        Raises:
            ValueError: the step is not waiting for a bitmask, or names a row it did not sample.
        """
        if launched is None or launched.deferred is None:
            raise ValueError("sample() needs a launched step waiting for its grammar bitmask")
        logits, rows = launched.deferred
        prepared, noise = launched.presampled, launched.noise
        launched.deferred = launched.presampled = launched.noise = None
        seq_ids, index = launched.seq_ids, None
        if grammar.seq_ids == seq_ids:  # every row constrained, in order (no Python a row)
            row_indices = np.arange(len(seq_ids), dtype=np.int64)
        else:
            index = {seq_id: k for k, seq_id in enumerate(seq_ids)}
            try:
                row_indices = np.array([index[s] for s in grammar.seq_ids], dtype=np.int64)
            except KeyError as e:
                raise ValueError(
                    f"grammar bitmask names {e}, which this step does not sample"
                ) from None
        mask = bitmask_to_device(grammar.bitmask, row_indices, self.device, wait)  # copy stream
        handle = None
        if prepared is not None:
            try:
                handle = prepared.finish(mask)
            except Exception:  # noqa: BLE001 - sampled whole below, where rows fail alone
                handle = None
        if handle is None:
            handle = launch_sampler(self.sampler, self._shared_generator, logits, rows, seq_ids,
                                    launched.states, launched.failed, mask, noise)  # fmt: skip
        launched.sampled = handle
        if index is None:  # built once the sampling is enqueued: off the step's critical chain
            index = {seq_id: k for k, seq_id in enumerate(seq_ids)}
        full = None if launched.checks is None else launched.checks.full(None)
        self._last_sampled = PreviousStep(handle.tokens, index, full)

    def collect(self, launched: LaunchedStep | None) -> ModelRunnerOutput:
        """Wait for a launched step's tokens (only that step's), append them to the sequences'
        states, and return them by seq id; non-finite rows are failed (`NON_FINITE_MESSAGE`).
        A verify step's rows get their accepted drafts first (`num_accepted_drafts`; a row
        whose guess of its pending token failed verified none: `missed_guess_seq_ids`)."""
        out = ModelRunnerOutput()
        if launched is None:
            return out
        if launched.sampled is None:
            raise RuntimeError("a constrained step was collected before `sample` was called")
        result = launched.sampled.result()
        out.failed = launched.failed
        seq_ids, drafts, sampled = launched.seq_ids, launched.drafts, launched.sampled
        accepted = sampled.num_accepted if isinstance(sampled, VerifyStep) else []
        void = launched.checks.void_host if launched.checks is not None else None
        kept, token_ids = append_tokens(launched.states, seq_ids, result.token_ids, drafts,
                                        accepted, void, self.block_size)  # fmt: skip
        if isinstance(sampled, VerifyStep) and drafts is not None:  # (void rows: no count)
            out.num_accepted_drafts, out.missed_guess_seq_ids = verify_counts(
                seq_ids, drafts, accepted, sampled.verified, kept
            )
        out.sampled_token_ids = dict(zip(kept, token_ids))
        out.logprobs = dict(zip(seq_ids, result.logprobs))
        out.top_logprobs = dict(zip(seq_ids, result.top_logprobs))
        if any(result.num_nonfinite):
            for seq_id, count in zip(seq_ids, result.num_nonfinite):
                if count:
                    out.num_nans_in_logits[seq_id] = count
                    out.failed.setdefault(seq_id, NON_FINITE_MESSAGE)
        return out

    def _launch_verify(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[tuple[int, ...]],
        seq_ids: list[str],
        states: list[SequenceState],
        failed: dict[str, str],
        valid: torch.Tensor | None,
    ) -> VerifyStep:
        """`verifier.launch_verify`: the rows without drafts through `sampling_rows.launch_sampler`;
        `valid`: the rows whose guess held (`stacked_rows`)."""

        def sample_plain(plain_logits: torch.Tensor, plain: list[int]) -> SampledTokens:
            return launch_sampler(
                self.sampler, self._shared_generator, plain_logits, [rows[b] for b in plain], [seq_ids[b] for b in plain],
                [states[b] for b in plain], failed,
            )  # fmt: skip

        return launch_verify(logits, rows, drafts, self._shared_generator, sample_plain, valid)

    def needs_token_history(self, sched: SchedulerOutput) -> bool:
        """`InputBatch.needs_token_history`: the step's sampling reads earlier output tokens."""
        return self.input_batch.needs_token_history(sched)

    def _fill_pending(self, input_ids: torch.Tensor, pending: list[tuple[int, str]]) -> None:
        """input_ids[index] = the token the last launched step sampled for the sequence."""
        if self._last_sampled is None:
            raise RuntimeError("a step has pending input tokens but no step was launched")
        tokens, rows = self._last_sampled.tokens, self._last_sampled.rows
        try:
            src = [rows[seq_id] for _, seq_id in pending]
        except KeyError as e:
            msg = f"sequence {e} has a pending token the last step did not sample"
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

    def _run_graph(self, host: HostStep) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden states [N, hidden] of the step's `logits_indices`, their logits [N, vocab]
        where the replayed graph computed them) from graph replays: the decode graph of a
        decode-only step (`CUDAGraphRunner.run_decode`; logits for small buckets), the verify
        graph of a verify step that fits one (`VerifyGraphRunner.run`), else the piecewise
        graphs when a token bucket holds the step; (None, None) when it runs eagerly."""
        fill = None
        if host.pending:
            fill = lambda input_ids: self._fill_pending(input_ids, host.pending)  # noqa: E731
        hidden = None
        if self.graph_runner is not None and host.is_decode:
            hidden = self.graph_runner.run_decode(host, fill)
            if hidden is not None:
                return hidden, self.graph_runner.logits(len(host.seq_lens))
        if hidden is None and self.verify_runner is not None and host.draft_counts:
            hidden = self.verify_runner.run(host, self._fill_pending)
        pieces = self.piecewise_runner
        if hidden is None and pieces is not None and pieces.bucket(len(host.input_ids)):
            hidden = pieces.run(host, fill)
        return hidden, None

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A dummy step as large as any the scheduler can form: one prompt chunk of num_tokens
        tokens, then logits and log-softmax for num_seqs rows. Needs ceil(num_tokens / block_size)
        blocks in the current cache; writes garbage into them.

        Raises:
            ValueError: if the cache holds fewer blocks than the step needs.
        """
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > self.num_blocks:
            raise ValueError(f"profile step needs {num_blocks} blocks, cache has {self.num_blocks}")
        host = HostStep.dummy(
            num_tokens, min(num_seqs, num_tokens), self.block_size, self.model.config.vocab_size
        )
        inputs = self.prepare_inputs(host)
        hidden = self.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        torch.log_softmax(logits.float(), dim=-1).argmax(dim=-1)
