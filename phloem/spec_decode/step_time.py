"""The cost rule's step time model corrected online by the running device's step times: the
prior model (`drafter.step_time_model`: constants scaled by the model's shape, not measured on
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
t_verify' = max(0, t_verify + r_verify - r_plain): the verify step's extra cost beyond a plain
step's residual (on CUDA: a verify step runs the piecewise graphs with eager attention where a
decode step replays one whole graph; the drafter's own host time). Keeping r_verify against the
prior model, not against r_plain, makes the two estimates independent of the order their samples
come in; until a plain step is measured all of the excess is charged to verify steps.

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
from phloem.spec_decode.cost_rule import StepTimeModel


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
    """

    ema_weight: float = 0.1
    prior_samples: float = 4.0
    clip_factor: float = 3.0
    warmup_samples: int = 4
    warmup_probe_every: int = 8
    probe_every: int = 64
    probe_steps: int = 2
    forget_weight: float = 0.001

    def validate(self) -> None:
        """Raise ValueError naming the field out of range."""
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must lie in (0, 1], got {self.ema_weight}")
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

    def _correct(self) -> StepTimeModel:
        prior = self.prior
        # no verify sample yet: the prior's t_verify (its residual stays that of plain steps)
        verify_extra = self.verify_residual_s - self.plain_residual_s if self.num_verify else 0.0
        return dataclasses.replace(
            prior,
            t_host_s=max(0.0, prior.t_host_s + self.plain_residual_s),
            t_verify_s=max(0.0, prior.t_verify_s + verify_extra),
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
        }
