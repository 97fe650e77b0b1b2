"""The cost rule's step time model corrected online by the running device's step times: the
prior model (`step_time_model`, below: constants scaled by the model's shape, not measured on
this device) plus two residuals and two slopes (per row, per draft) learned from the engine's
steps. Pure Python.

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

What is learned, with t_model the prior model's time (`StepTimeModel.step_time_s`, of the
step's tokens T, KV tokens K, drafts D, rows R and, where the model pads verify steps to a graph
width, its longest row: `StepShape.longest_drafts`) and r = measured - t_model:

    r_plain  = EMA over steps without drafts of r,  R_plain its EMA of R
    r_verify = EMA over steps with drafts of r,     R_verify, D_mean its EMAs of R and D
    b_R, b_D = least squares of r on (R, D) within each kind (plain, verify; module-level
               moments below)

The corrected model has c_row' = max(0, c_row + b_R), c_draft' = max(0, c_draft + b_D),
t_host' = max(0, t_host + a_plain) and t_verify' = max(0, t_verify + a_verify - a_plain), with
the levels a_plain = r_plain - b_R x R_plain and a_verify = r_verify - b_R x R_verify -
b_D x D_mean: at the recent mean shape of each kind the model predicts its residual, and the
slopes carry it to other shapes. The verify step's extra cost beyond a plain step's (the
drafter's own host time; on CUDA, the verify graph's fixed cost) is thus split into a fixed part
and a part per draft, and both kinds share a part per row.

The slopes: EMAs of R, r, R^2, R r over plain samples and of R, D, r, R^2, D^2, R D, R r, D r
over verify samples (the n-th weighted max(`slope_ema_weight`, 1/n)) give each kind's
covariances; pooled, each kind weighted by its samples up to 1 / `slope_ema_weight`, they are
the 2 x 2 normal equations of (R, D) without the kinds' own intercepts, so t_verify does not
leak into the slopes. b_D needs `slope_min_samples` verify samples whose drafts vary by
`slope_min_var` drafts^2, b_R as many samples whose rows vary by `row_min_var` rows^2 (pooled),
else each is 0 (all of the excess is fixed, as where every verify step has the same drafts).
Where rows and drafts move together (squared correlation above `max_row_draft_r2`: the plain
steps' rows do not vary, the verify steps draft a fixed number a row) b_D comes from the verify
steps alone (it then carries their rows' cost) and b_R from the plain steps alone. Each slope is
at least minus the prior's term (a row or a draft never makes a step cheaper). The fit is ~13
float updates a step (3.1 -> 4.9 us an `observe` on the dev CPU,
benchmarks/results/2026-11-27d-cpu-spec-row-cost), no matrix solve beyond Cramer's rule.

Why rows: on the H200 (SmolLM2-135M, copy batch 32, k = 16) a step's host work grows ~25-60 us
a row beside ~17-38 us a draft (least squares of its traces); the prior's rows cost only their
token (c_token 0.45 us), so without b_R the residuals held the cost of the recent width's rows:
a batch's tail of few rows was over-predicted by up to 0.7 ms, and the rule weighed a draft
against a step that looked cheaper than it was at 32 rows (it drafted less there; the same
benchmark). Why the long memory of the moments (`slope_ema_weight`, 0.01: ~100 samples, where
the residuals keep ~10): a batch's tail verifies few drafts a step; with the residuals' memory
the slope was the tail's alone (H200 copy batch 32: c_draft fell from ~30 us to ~3 us against a
fitted ~32-38 us, benchmarks/results/2026-11-27c-cpu-spec-learner). On the CPU the excess grows
per draft (~6 ms a draft at batch 32 against the prior's 3.2 ms,
benchmarks/results/2026-11-26e-cpu-spec-cost): charged as fixed, it weighed on a few drafts as
much as on many, and the rule chose fewer. A verify graph's cost hardly moves with the drafts
(every row is padded to 1 + w): where the prior is told the widths it charges the padded
tokens itself; where it is not, b_D cancels its per-draft charge. Keeping r_verify against the
prior model, not against r_plain, makes the two estimates independent of the order their
samples come in; until a plain step is measured all of the excess is charged to verify steps.

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
where the rule has turned drafting off, each plain sample moves r_verify `forget_weight` (0.001)
of its gap to r_plain (both less b_R x their mean rows), so an estimate that a transient raised
is tried again within a few hundred steps, while a verify cost that is real comes back with the
first verify step after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from phloem.core.scheduler_output import ScheduledSequence
from phloem.spec_decode.step_model import LLAMA_8B_H100, StepTimeModel


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
        slope_ema_weight: the slopes' moments' EMA weight once 1/n falls to it, in (0, 1]
            (longer memory than `ema_weight`: the slopes need the spread of many steps).
        row_min_var: the least variance of the samples' rows (within plain and verify steps,
            pooled) for the per-row slope [rows^2], > 0. 16 (a spread of ~4 rows): over a
            narrower spread other causes pass for rows (H200 copy batch 32: plain steps of 32
            rows cost 2.65 ms, of 27-29 rows 1.75 ms, which read as ~225 us a row;
            benchmarks/results/2026-11-27d-cpu-spec-row-cost).
        max_row_draft_r2: rows and drafts are fitted jointly while the squared correlation of
            the verify steps' rows and drafts (the rows' spread pooled with the plain steps')
            stays below this, in (0, 1); above it they are collinear and the per-draft slope
            comes from the verify steps alone, the per-row one from the plain steps alone.
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
    row_min_var: float = 16.0
    max_row_draft_r2: float = 0.98

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
        for name in ("slope_min_var", "row_min_var"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 < self.max_row_draft_r2 < 1.0:
            raise ValueError(f"max_row_draft_r2 must lie in (0, 1), got {self.max_row_draft_r2}")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computed, in the step time model's terms.

    Attributes:
        num_sampled: rows that sampled a token [sequences].
        num_tokens: tokens computed, drafts included [tokens].
        num_kv_tokens: KV tokens read before the step's own [tokens].
        num_drafts: drafts verified [tokens].
        longest_drafts: the most drafts one row verifies [tokens] (the width a padded verify
            step needs, `StepTimeModel.padded_width`); None: not known (drafts spread evenly).
    """

    num_sampled: int
    num_tokens: int
    num_kv_tokens: int
    num_drafts: int
    longest_drafts: int | None = None

    @property
    def decode_only(self) -> bool:
        """Every row samples and computes only its last token and drafts (no prompt chunk)."""
        return self.num_sampled > 0 and self.num_tokens == self.num_sampled + self.num_drafts

    @classmethod
    def of(cls, scheduled: Sequence[ScheduledSequence]) -> StepShape:
        """The shape of a scheduler output's `scheduled` rows."""
        sampled = tokens = kv = drafts = longest = 0
        for s in scheduled:
            sampled += s.sample
            tokens += s.num_tokens
            kv += s.num_computed_tokens
            num = len(s.draft_token_ids)
            drafts += num
            longest = max(longest, num)
        return cls(sampled, tokens, kv, drafts, longest)


class StepTimeLearner:
    """The prior step time model, its two learned residuals and its per-row and per-draft
    slopes (module docstring).

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
        self.draft_slope_s = 0.0  # b_D: the residual per draft [s / draft]
        self.row_slope_s = 0.0  # b_R: the residual per sampled row [s / row]
        # long EMAs of plain samples' R, r, R^2, R r and of verify samples' R, D, r, R^2, D^2,
        # R D, R r, D r (R rows, D drafts, r residual)
        self._plain_moments = [0.0] * 4
        self._verify_moments = [0.0] * 8
        # short EMAs (the residuals' memory): plain samples' R, verify samples' R and D
        self._mean_plain_rows = self._mean_rows = self._mean_drafts = 0.0
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
        t, k, d, rows = shape.num_tokens, shape.num_kv_tokens, shape.num_drafts, shape.num_sampled
        c = self.config.clip_factor
        predicted = self.model.step_time_s(t, k, d, rows, shape.longest_drafts)
        seconds = min(max(seconds, predicted / c), predicted * c)
        residual = seconds - self.prior.step_time_s(t, k, d, rows, shape.longest_drafts)
        if d:
            self.num_verify += 1
            self.verify_residual_s += self._weight(self.num_verify + self.config.prior_samples) * (
                residual - self.verify_residual_s
            )
            w = self._weight(self.num_verify)
            self._mean_drafts += w * (d - self._mean_drafts)
            self._mean_rows += w * (rows - self._mean_rows)
            _verify_moments(self._verify_moments, self._long_weight(self.num_verify), rows, d,
                            residual)  # fmt: skip
            self._since_plain += 1
        else:
            self.num_plain += 1
            w = self._weight(self.num_plain)
            self.plain_residual_s += w * (residual - self.plain_residual_s)
            self._mean_plain_rows += w * (rows - self._mean_plain_rows)
            m, w = self._plain_moments, self._long_weight(self.num_plain)
            for i, value in enumerate((rows, residual, rows * rows, rows * residual)):
                m[i] += w * (value - m[i])
            if self.num_verify:  # forget the verify excess beyond the slopes' share
                b = self.row_slope_s
                gap = self.plain_residual_s - b * self._mean_plain_rows
                gap -= self.verify_residual_s - b * self._mean_rows
                self.verify_residual_s += self.config.forget_weight * gap
            self._since_plain = self._probing = 0
        self._fit_slopes()
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

    def _long_weight(self, num_samples: int) -> float:
        return max(self.config.slope_ema_weight, 1.0 / num_samples)

    def _fit_slopes(self) -> None:
        """b_R and b_D from the moments (module docstring): least squares of the residual on
        (rows, drafts) within each kind (plain, verify), the kinds weighted by their samples
        up to 1 / slope_ema_weight; a slope is 0 without the samples or the spread its
        regressor needs, b_D alone (verify steps) where rows and drafts move together, b_R
        alone where drafts do not vary; at least -c_row, -c_draft of the prior, and b_R at most
        what keeps t_host' >= 0 (the rows of the recent plain steps cost at most the step)."""
        config = self.config
        most = 1.0 / config.slope_ema_weight
        n_p, n_v = min(self.num_plain, most), min(self.num_verify, most)
        p, v = self._plain_moments, self._verify_moments
        var_rows_p, cov_rows_p = p[2] - p[0] * p[0], p[3] - p[0] * p[1]
        var_rows_v, var_drafts = v[3] - v[0] * v[0], v[4] - v[1] * v[1]
        cov_rd, cov_rows_v, cov_drafts = v[5] - v[0] * v[1], v[6] - v[0] * v[2], v[7] - v[1] * v[2]
        s_rr = n_p * var_rows_p + n_v * var_rows_v
        s_r = n_p * cov_rows_p + n_v * cov_rows_v
        enough = self.num_plain + self.num_verify >= config.slope_min_samples
        rows_ok = enough and s_rr >= config.row_min_var * (n_p + n_v)
        drafts_ok = (
            self.num_verify >= config.slope_min_samples and var_drafts >= config.slope_min_var
        )
        b_rows = b_drafts = 0.0
        if rows_ok and drafts_ok:
            s_dd, s_rd = n_v * var_drafts, n_v * cov_rd
            det = s_rr * s_dd - s_rd * s_rd
            if det > (1.0 - config.max_row_draft_r2) * s_rr * s_dd:
                b_rows = (s_r * s_dd - n_v * cov_drafts * s_rd) / det
                b_drafts = (s_rr * n_v * cov_drafts - s_rd * s_r) / det
            else:  # collinear in verify steps: drafts from them, rows from plain steps alone
                b_drafts = cov_drafts / var_drafts
                if n_p * var_rows_p >= config.row_min_var * n_p > 0:
                    b_rows = cov_rows_p / var_rows_p
        elif drafts_ok:
            b_drafts = cov_drafts / var_drafts
        elif rows_ok:
            b_rows = s_r / s_rr
        if self.num_plain and self._mean_plain_rows > 0:  # no negative t_host at the mean rows
            plain_s = self.prior.t_host_s + self.plain_residual_s
            b_rows = min(b_rows, plain_s / self._mean_plain_rows)
        self.row_slope_s = max(-self.prior.c_row_s, b_rows)
        self.draft_slope_s = max(-self.prior.c_draft_s, b_drafts)

    def _correct(self) -> StepTimeModel:
        prior = self.prior
        b_rows, b_drafts = self.row_slope_s, self.draft_slope_s
        # the plain and verify levels at R = 0 (D = 0): each residual less the slopes' share at
        # its recent mean shape; before any verify sample, the prior's t_verify
        plain = self.plain_residual_s - b_rows * self._mean_plain_rows
        verify_extra = 0.0
        if self.num_verify:
            verify = self.verify_residual_s - b_rows * self._mean_rows
            verify_extra = verify - b_drafts * self._mean_drafts - plain
        return dataclasses.replace(
            prior,
            t_host_s=max(0.0, prior.t_host_s + plain),
            t_verify_s=max(0.0, prior.t_verify_s + verify_extra),
            c_draft_s=max(0.0, prior.c_draft_s + b_drafts),
            c_row_s=max(0.0, prior.c_row_s + b_rows),
        )

    def as_dict(self) -> dict[str, float]:
        """The learned state, for `--json` reports: residuals [s], samples, slopes [s / draft,
        s / row], corrected times [s]."""
        return {
            "plain_residual_s": self.plain_residual_s,
            "verify_residual_s": self.verify_residual_s,
            "num_plain_samples": self.num_plain,
            "num_verify_samples": self.num_verify,
            "t_host_s": self.model.t_host_s,
            "t_verify_s": self.model.t_verify_s,
            "draft_slope_s": self.draft_slope_s,
            "c_draft_s": self.model.c_draft_s,
            "row_slope_s": self.row_slope_s,
            "c_row_s": self.model.c_row_s,
        }


def _verify_moments(m: list[float], w: float, rows: int, drafts: int, residual: float) -> None:
    """Move the verify moments (R, D, r, R^2, D^2, R D, R r, D r) a share `w` towards one
    sample's (spelled out: the learner runs once a step)."""
    m[0] += w * (rows - m[0])
    m[1] += w * (drafts - m[1])
    m[2] += w * (residual - m[2])
    m[3] += w * (rows * rows - m[3])
    m[4] += w * (drafts * drafts - m[4])
    m[5] += w * (rows * drafts - m[5])
    m[6] += w * (rows * residual - m[6])
    m[7] += w * (drafts * residual - m[7])


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
