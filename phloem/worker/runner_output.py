"""What one model-runner step hands around: its input tensors (`StepInputs`), the step launched
on the device and not yet collected (`LaunchedStep`), and its result by sequence
(`ModelRunnerOutput`, plain data that crosses processes). `phloem.worker.model_runner` makes
and re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from phloem.layers.sampler import PreparedSampling, SampledTokens, SamplingRow
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.spec_decode.verifier import VerifyStep
from phloem.worker.input_batch import SequenceState

if TYPE_CHECKING:
    from phloem.worker.stacked_rows import StackChecks


@dataclass
class ModelRunnerOutput:
    """Per sampled sequence (by seq id): the new token, its log-prob under the model's raw
    distribution, and the top-k log-probs when the request asked for them; `failed` maps the
    sequences that failed alone this step to the reason (their token is a placeholder);
    `num_nans_in_logits` is 1 for each sampled row whose logits hold a NaN/inf (vLLM's name; the
    sampler flags rows, it does not count values; those sequences are in `failed` with
    `NON_FINITE_MESSAGE`). Plain data (picklable)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float | None] = field(default_factory=dict)
    top_logprobs: dict[str, dict[int, float] | None] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    num_nans_in_logits: dict[str, int] = field(default_factory=dict)
    # speculative decoding: drafts accepted per sequence that verified any (its
    # `sampled_token_ids` entry is the token after them)
    num_accepted_drafts: dict[str, int] = field(default_factory=dict)
    # the sequences whose drafts followed a guess of their pending token that failed
    # (`worker/stacked_rows.py`): they verified nothing, so they are not in
    # `num_accepted_drafts` (whose absence the update reads as 0 accepted); their
    # `sampled_token_ids` entry is the target's token at their first position
    missed_guess_seq_ids: list[str] = field(default_factory=list)


@dataclass
class LaunchedStep:
    """A step whose sampling is enqueued on the device (see `ModelRunner.launch`)."""

    seq_ids: list[str]  # the sampled sequences, in row order
    states: list[SequenceState]  # their states when launched (the tokens are appended there)
    sampled: SampledTokens | VerifyStep | None  # None until `ModelRunner.sample` (a
    # constrained step); VerifyStep for a verify step (speculative decoding)
    failed: dict[str, str] = field(default_factory=dict)  # seq id -> why it failed
    # a constrained step's logits [S, V] and sampling rows, until its grammar bitmask comes
    deferred: tuple[torch.Tensor, list[SamplingRow]] | None = None
    noise: torch.Tensor | None = None  # its random rows' noise, drawn by `ModelRunner.presample`
    presampled: PreparedSampling | None = None  # its sampling up to the mask (`presample`)
    drafts: list[tuple[int, ...]] | None = None  # a verify step's drafts per sampled row
    checks: StackChecks | None = None  # its rows' void flags and guesses (`stacked_rows`)


@dataclass
class StepInputs:
    """The tensors of one step. T tokens, B sequences, S of them sampled."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S], token index of each sampled sequence's last token
