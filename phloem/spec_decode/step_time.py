"""The cost rule's step time model corrected online by the running device's step times: the
prior model (`step_time_model`, below: constants scaled by the model's shape, not measured on
this device) plus two residuals learned from the engine's steps. Pure Python.

What is measured: the engine reports every step it launches and collects, with its shape
(`StepShape`: sampled sequences, tokens computed, KV tokens read, drafts verified) and its cost:
the host work of its step() call up to its launch (proposing drafts, scheduling, launching; on
the CPU the forward pass runs inside the launch), plus the wait for its results and its update
and outputs (`Drafter.launched`, `Drafter.step_done`). Each moment of a step() call is charged to
one step; device time that overlapped host work (async scheduling) is charged to none, so a step
that kept the overlap costs less than one that gave it up, which is what a verify step does. Not
the period between collections: under async scheduling on the CPU a step's forward pass runs
before the previous step is collected, so periods alternate between ~0 and two steps. Only
decode-only steps are samples (every row samples, none computes a prompt chunk): a chunk's time is
charged to the chunk by the cost rule, and the prior model's prefill cost is the least trusted
part of it.

What is learned, with t_model(T, K, D) the prior model's time (`StepTimeModel.step_time_s`):

    r_plain  = EMA over steps without drafts of (measured - t_model(T, K, 0))
    r_verify = EMA over steps with drafts of (measured - t_model(T, K, D))

The corrected model has t_host' = max(0, t_host + r_plain) and
t_verify' = max(0, t_verify + r_verify - b * D_mean - r_plain), c_draft' = max(0, c_draft + b):
the verify step's extra cost beyond a plain step's residual (the drafter's own host time; on
CUDA, verify steps off their full graphs ran the piecewise graphs with eager attention), split
into a fixed part and a part per draft. b is the least-squares slope of the verify residual
against the step's drafts D (EMAs of D, r, D^2 and D r over verify samples, no prior), used once
`slope_min_samples` verify samples spread over a variance of at least `slope_min_var` drafts^2
(else 0: all of the excess is fixed, as it is where every verify step has the same drafts);
D_mean is their EMA with r_verify's weights, so at the recent mean draft count the model predicts
r_verify either way. The moments remember longer (`slope_ema_weight`, 0.01: ~100 samples) than
the residuals: a batch's tail verifies few drafts a step whose cost moves with its rows, not its
drafts, and with the residuals' ~10 samples the slope was the tail's alone (H200 copy batch 32:
c_draft fell from ~30 us to ~3 us against a fitted ~32-38 us,
benchmarks/results/2026-11-27c-cpu-spec-learner). On the
CPU the excess grows per draft (~6 ms a draft at batch 32 against the prior's 3.2 ms,
benchmarks/results/2026-11-26e-cpu-spec-cost): charged as fixed, it weighed on a few drafts as
much as on many, and the rule chose fewer. A verify graph's cost hardly moves with the drafts
(every row is padded to 1 + k): b then cancels the prior's per-draft charge. Keeping r_verify
against the prior model, not against r_plain, makes the two estimates independent of the order
their samples come in; until a plain step is measured all of the excess is charged to verify
steps.

The EMAs weigh the n-th sample 1/(n + n0) until that falls to `ema_weight` (0.1), then
`ema_weight`: n0 = 0 for plain steps (the mean of the first samples), n0 = `prior_samples` = 4
for verify steps (the prior counts as 4 samples of residual 0: plain samples keep coming and
correct an outlier, verify samples stop once the rule turns drafts off). A sample is first
clipped to [1/c, c] times the corrected model's time for its shape (c = `clip_factor`, 3). So
one outlier (the first proposal indexing every prompt of a batch, a collection, another process
on the core) moves an estimate by at most 2/5 of the model's time, and cannot alone turn drafts
off, while a real error of 5x is learned within about 6 samples (the model's time grows by up
to 1.4x a sample).

Probing: the plain residual needs steps without drafts. Where the rule drafts every step, the
drafter skips drafting for `probe_steps` (2: async scheduling decides the next step before the
probe step is collected) steps after `warmup_probe_every` (8) verify steps while fewer than
`warmup_samples` (4) plain samples exist, then after every `probe_every` (64) verify steps: at
most 2/64 of the steps of a run that drafts throughout. The verify residual needs verify steps:
where the rule has turned drafting off, each plain sample moves r_verify towards r_plain by
`forget_weight` (0.001), so an estimate that a transient raised is tried again within a few
hundred steps, while a verify cost that is real comes back with the first verify step after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from phloem.core.scheduler_output import ScheduledSequence
from phloem.spec_decode.cost_rule import LLAMA_8B_H100, StepTimeModel


@dataclass(frozen=True)
class StepTimeConfig:
    """Settings of the online correction (see the module docstring).

    Attributes:
        ema_weight: the residuals' EMA weight once 1/(n + n0) falls to it, in (0, 1].
        prior_samples: the samples the prior counts as in the verify residual [samples], >= 0.
        clip_factor: a sample is clipped to [1/c, c] times the corrected model's time, > 1.
        warmup_samples: plain samples below which the shorter probe interval holds, >= 0.
        warmup_probe_every: verify steps between probes while warming up [steps], >= 1.
        probe_every: verify steps between probes after warming up [steps], >= 1.
        probe_steps: steps without drafts a probe asks for [steps], >= 1.
        forget_weight: per plain sample, the share of the way r_verify moves towards r_plain,
            in [0, 1].
        slope_min_samples: verify samples before the per-draft slope is used [samples], >= 2.
        slope_min_var: the least variance of their draft counts for it [drafts^2], > 0.
        slope_ema_weight: the slope's moments' EMA weight once 1/n falls to it, in (0, 1]
            (longer memory than `ema_weight`: the slope needs the spread of many steps).
    """

    ema_weight: float = 0.1
    prior_samples: float = 4.0
    clip_factor: float = 3.0
    warmup_samples: int = 4
    warmup_probe_every: int = 8
    probe_every: int = 64
    probe_steps: int = 2
    forget_weight: float = 0.001
    slope_min_samples: int = 8
    slope_min_var: float = 1.0
    slope_ema_weight: float = 0.01

    def validate(self) -> None:
        """Raise ValueError naming the field out of range."""
        for name in ("ema_weight", "slope_ema_weight"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1], got {getattr(self, name)}")
        if self.prior_samples < 0:
            raise ValueError(f"prior_samples must be >= 0, got {self.prior_samples}")
        if self.clip_factor <= 1.0:
            raise ValueError(f"clip_factor must be > 1, got {self.clip_factor}")
        counts = (self.warmup_probe_every, self.probe_every, self.probe_steps)
        for name, value in zip(("warmup_probe_every", "probe_every", "probe_steps"), counts):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.warmup_samples < 0:
            raise ValueError(f"warmup_samples must be >= 0, got {self.warmup_samples}")
        if not 0.0 <= self.forget_weight <= 1.0:
            raise ValueError(f"forget_weight must lie in [0, 1], got {self.forget_weight}")
        if self.slope_min_samples < 2:
            raise ValueError(f"slope_min_samples must be >= 2, got {self.slope_min_samples}")
        if not self.slope_min_var > 0:
            raise ValueError(f"slope_min_var must be > 0, got {self.slope_min_var}")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computed, in the step time model's terms.

    Attributes:
        num_sampled: rows that sampled a token [sequences].
        num_tokens: tokens computed, drafts included [tokens].
        num_kv_tokens: KV tokens read before the step's own [tokens].
        num_drafts: drafts verified [tokens].
    """

    num_sampled: int
    num_tokens: int
    num_kv_tokens: int
    num_drafts: int

    @property
    def decode_only(self) -> bool:
        """Every row samples and computes only its last token and drafts (no prompt chunk)."""
        return self.num_sampled > 0 and self.num_tokens == self.num_sampled + self.num_drafts

    @classmethod
    def of(cls, scheduled: Sequence[ScheduledSequence]) -> StepShape:
        """The shape of a scheduler output's `scheduled` rows."""
        sampled = tokens = kv = drafts = 0
        for s in scheduled:
            sampled += s.sample
            tokens += s.num_tokens
            kv += s.num_computed_tokens
            drafts += len(s.draft_token_ids)
        return cls(sampled, tokens, kv, drafts)


class StepTimeLearner:
    """The prior step time model and its two learned residuals (module docstring).

    Args:
        prior: the model before any measurement.
        config: the settings; None: the defaults.
    """

    def __init__(self, prior: StepTimeModel, config: StepTimeConfig | None = None) -> None:
        self.config = config or StepTimeConfig()
        self.config.validate()
        prior.validate()
        self.prior = prior
        self.model = prior  # the corrected model (`_correct`)
        self.plain_residual_s = 0.0
        self.verify_residual_s = 0.0
        self.draft_slope_s = 0.0  # b: the verify residual per draft [s / draft]
        self._moments = [0.0, 0.0, 0.0, 0.0]  # verify samples' long EMAs of D, r, D^2, D r
        self._mean_drafts = 0.0  # D_mean: their EMA of D with r_verify's memory
        self.num_plain = 0  # samples of each kind so far
        self.num_verify = 0
        self._since_plain = 0  # verify samples since the last plain one
        self._probing = 0  # steps of the current probe handed out

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Learn from one collected step that took `seconds` [s] (>= 0; raises ValueError
        otherwise); steps that are not decode-only are ignored."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if not shape.decode_only:
            return
        t, k, d = shape.num_tokens, shape.num_kv_tokens, shape.num_drafts
        c = self.config.clip_factor
        predicted = self.model.step_time_s(t, k, d)
        seconds = min(max(seconds, predicted / c), predicted * c)
        residual = seconds - self.prior.step_time_s(t, k, d)
        if d:
            self.num_verify += 1
            self.verify_residual_s += self._weight(self.num_verify + self.config.prior_samples) * (
                residual - self.verify_residual_s
            )
            self._learn_slope(d, residual)
            self._since_plain += 1
        else:
            self.num_plain += 1
            self.plain_residual_s += self._weight(self.num_plain) * (
                residual - self.plain_residual_s
            )
            if self.num_verify:
                gap = self.plain_residual_s - self.verify_residual_s
                self.verify_residual_s += self.config.forget_weight * gap
            self._since_plain = self._probing = 0
        self.model = self._correct()

    def probe_due(self) -> bool:
        """Whether the next step should run without drafts to measure a plain step (called once
        per step by the drafter's pre-check; a probe answers yes `probe_steps` times)."""
        config = self.config
        warm = self.num_plain >= config.warmup_samples
        every = config.probe_every if warm else config.warmup_probe_every
        if self._since_plain < every:
            return False
        self._probing += 1
        if self._probing >= config.probe_steps:  # its steps are handed out: wait again
            self._since_plain = self._probing = 0
        return True

    def _weight(self, num_samples: float) -> float:
        return max(self.config.ema_weight, 1.0 / num_samples)

    def _learn_slope(self, num_drafts: int, residual: float) -> None:
        """Update the moments with one verify sample and the slope b from them (module
        docstring): cov(D, r) / var(D) once there are enough samples spread enough, at least
        -c_draft (a draft never makes a step cheaper); else 0."""
        self._mean_drafts += self._weight(self.num_verify) * (num_drafts - self._mean_drafts)
        m = self._moments
        w = max(self.config.slope_ema_weight, 1.0 / self.num_verify)
        values = (num_drafts, residual, num_drafts * num_drafts, num_drafts * residual)
        for i, value in enumerate(values):
            m[i] += w * (value - m[i])
        var = m[2] - m[0] * m[0]
        config = self.config
        if self.num_verify >= config.slope_min_samples and var >= config.slope_min_var:
            self.draft_slope_s = max(-self.prior.c_draft_s, (m[3] - m[0] * m[1]) / var)
        else:
            self.draft_slope_s = 0.0

    def _correct(self) -> StepTimeModel:
        prior = self.prior
        # no verify sample yet: the prior's t_verify (its residual stays that of plain steps)
        slope = self.draft_slope_s
        verify_extra = 0.0
        if self.num_verify:
            fixed = self.verify_residual_s - slope * self._mean_drafts
            verify_extra = fixed - self.plain_residual_s
        return dataclasses.replace(
            prior,
            t_host_s=max(0.0, prior.t_host_s + self.plain_residual_s),
            t_verify_s=max(0.0, prior.t_verify_s + verify_extra),
            c_draft_s=max(0.0, prior.c_draft_s + slope),
        )

    def as_dict(self) -> dict[str, float]:
        """The learned state, for `--json` reports: residuals [s], samples, corrected times [s]."""
        return {
            "plain_residual_s": self.plain_residual_s,
            "verify_residual_s": self.verify_residual_s,
            "num_plain_samples": self.num_plain,
            "num_verify_samples": self.num_verify,
            "t_host_s": self.model.t_host_s,
            "t_verify_s": self.model.t_verify_s,
            "draft_slope_s": self.draft_slope_s,
            "c_draft_s": self.model.c_draft_s,
        }


LLAMA_8B_PARAMS = 8.03e9  # the prior's reference model (`LLAMA_8B_H100`)


def _shape(hf_config) -> tuple[int, int, int, int]:
    """(hidden size, layers, KV heads, head dim) of a transformers config."""
    h = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or h // heads)
    return h, int(hf_config.num_hidden_layers), kv_heads, head_dim


def count_parameters(hf_config) -> int:
    """Parameters of a dense decoder of `hf_config`'s shape (attention, gated MLP, one
    embedding matrix; norms and biases left out)."""
    h, layers, kv_heads, head_dim = _shape(hf_config)
    attn = h * head_dim * (2 * int(hf_config.num_attention_heads) + 2 * kv_heads)
    return layers * (attn + 3 * h * int(hf_config.intermediate_size)) + (
        int(hf_config.vocab_size) * h
    )


def step_time_model(hf_config, device_type: str) -> StepTimeModel:
    """The cost rule's step time model for a model of `hf_config`'s shape on `device_type`
    ("cuda" or "cpu"); parameters and KV bytes per token counted from the config.

    CUDA: `LLAMA_8B_H100` scaled by the parameters and KV bytes. CPU: constants fitted by least
    squares (`benchmarks/spec_decode_steps.py --fit`) to the embedded model's decode and verify
    steps (bf16, the reference attention, two cores, batch 1 and 8): the model's time
    t_host + c_token x T + c_kv x K, and the host time each draft adds (c_draft). They are
    written as rates so that another shape scales: t_host as the bf16 weights read at 6.9 GB/s,
    c_token as 2 x params FLOP at 84 GFLOP/s, c_kv as a token's KV bytes at 1.7 GB/s (the fit:
    39 ms, 3.2 ms, 0.0135 ms for 134.5 M parameters and 23,040 bytes). No fixed verify cost:
    the fitted one was below zero (a verify step costs its tokens). To recalibrate, run the
    benchmark at batch 1 and 8 and fit (results/2026-11-26d-cpu-spec-decode/README.md).
    """
    _, layers, kv_heads, head_dim = _shape(hf_config)
    params = count_parameters(hf_config)
    kv_bytes = 2 * layers * kv_heads * head_dim * 2
    scale = params / LLAMA_8B_PARAMS
    if device_type == "cuda":
        base = LLAMA_8B_H100
        return StepTimeModel(
            t_host_s=base.t_host_s,
            t_weights_s=base.t_weights_s * scale,
            c_token_s=base.c_token_s * scale,
            c_kv_s=base.c_kv_s * kv_bytes / 131072,
        )
    return StepTimeModel(
        t_host_s=params * 2 / 6.9e9,
        t_weights_s=0.0,
        c_token_s=2 * params / 8.4e10,
        c_kv_s=kv_bytes / 1.7e9,
        c_draft_s=2e-5,
        t_verify_s=0.0,
    )
