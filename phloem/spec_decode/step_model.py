"""The step time model of the speculative decoding cost rule (`cost_rule.choose_num_drafts`):
a step's time from its shape, with what its rows and drafts cost beyond their tokens. Pure
Python.

The model of docs/DESIGN.md "Steady inter-token latency" (`benchmarks/itl_sim.py`), plus what
rows and drafts cost beyond their tokens:

    t = t_host + max(t_weights, c_token x T) + c_kv x K + c_row x R + c_draft x D
        + t_verify x [D > 0]

T = tokens the step computes (scheduled tokens plus D drafts), K = KV tokens read, R = rows
that sample, D = drafts. Below the knee (c_token x T < t_weights: the step is bound by reading
the weights) a draft costs only c_draft; past it, a full token of compute too. c_row is the
host's work per row (scheduling, sampling, update, output): paid with or without drafts, it
weighs a draft's cost against the step's, and on a host-bound GPU step it is most of the
step's growth with the batch (H200, SmolLM2-135M, copy batch 32: ~25-60 us a row beside
~17-38 us a draft, benchmarks/results/2026-11-27d-cpu-spec-row-cost).
Where the device pads verify steps to a graph width (`StepTimeModel.verify_widths`: CUDA verify
graphs, `worker/verify_graph.py`), a decode-only verify step computes T = R x (1 + w) tokens, w
the narrowest width >= its longest row's drafts, whatever its drafts: the rule then prices each
width in turn, every row capped at it (`StepTimeModel.scan_widths`).
The engine's model is a prior whose t_host, t_verify, c_row and c_draft are corrected online by
the device's measured step times (`step_time.StepTimeLearner`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class StepTimeModel:
    """t(T, K, D, R) [s]; see the module docstring.

    Attributes:
        t_host_s: host time per step [s].
        t_weights_s: reading the weights once [s].
        c_token_s: compute per token [s / token].
        c_kv_s: reading one token's KV (all layers) [s / token].
        c_draft_s: proposing and verifying one draft on top of its token [s / token].
        t_verify_s: fixed cost of a step that verifies any drafts (the rejection sampler) [s].
        c_row_s: per sampled row, beyond its token (its scheduling, sampling, update and
            output on the host) [s / row]. 0 in the priors; the learner fits it
            (`step_time.StepTimeLearner`; H200 copy batch 32 on SmolLM2-135M: ~25-60 us,
            benchmarks/results/2026-11-27d-cpu-spec-row-cost).
        verify_widths: the draft widths w, ascending, whose verify graphs the device replays
            (`SpeculativeConfig.verify_widths()`): a decode-only verify step of at most
            `verify_max_rows` rows whose longest row has at most the widest w drafts computes
            rows x (1 + w) tokens, w the narrowest >= that row's drafts [tokens]; () none.
        verify_max_rows: the most rows a padded verify step has (the graphs' largest bucket,
            `SpeculativeConfig.verify_graph_max_batch`) [rows], >= 0; 0: none is padded.
    """

    t_host_s: float
    t_weights_s: float
    c_token_s: float
    c_kv_s: float
    c_draft_s: float = 2e-6
    t_verify_s: float = 1e-4
    c_row_s: float = 0.0
    verify_widths: tuple[int, ...] = ()
    verify_max_rows: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range (a negative time or count,
        widths not ascending integers >= 1)."""
        widths = self.verify_widths
        for name, value in asdict(self).items():
            if name != "verify_widths" and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if any(w < 1 for w in widths) or list(widths) != sorted(set(widths)):
            raise ValueError(f"verify_widths must be ascending integers >= 1, got {widths}")

    def padded_width(
        self, num_rows: int, num_tokens: int, num_drafts: int, longest: int | None = None
    ) -> int | None:
        """The draft width w the device pads a step's rows to (`verify_widths`), None where it
        runs unpadded: no drafts, a prompt chunk (`num_tokens` > rows + drafts), more rows than
        `verify_max_rows`, or a longest row past the widest w. `longest`: the most drafts one
        row verifies; None: the drafts spread evenly, ceil(num_drafts / num_rows)."""
        if not num_drafts or num_tokens != num_rows + num_drafts:
            return None
        if not 0 < num_rows <= self.verify_max_rows:
            return None
        if longest is None:
            longest = -(-num_drafts // num_rows)
        for width in self.verify_widths:
            if width >= longest:
                return width
        return None

    def step_time_s(
        self,
        num_tokens: int,
        num_kv_tokens: int,
        num_drafts: int = 0,
        num_rows: int | None = None,
        longest: int | None = None,
    ) -> float:
        """The step's time [s]: `num_tokens` computed (drafts included), `num_kv_tokens` read,
        `num_rows` sampled (None: num_tokens - num_drafts, a decode-only step's rows), the
        longest row verifying `longest` drafts (`padded_width`; where the step is padded it
        computes rows x (1 + w) tokens)."""
        rows = num_tokens - num_drafts if num_rows is None else num_rows
        width = (
            self.padded_width(rows, num_tokens, num_drafts, longest) if self.verify_widths else None
        )
        computed = num_tokens if width is None else rows * (1 + width)
        compute = max(self.t_weights_s, self.c_token_s * computed)
        verify = self.c_draft_s * num_drafts + (self.t_verify_s if num_drafts else 0.0)
        return self.t_host_s + compute + self.c_kv_s * num_kv_tokens + self.c_row_s * rows + verify

    def padded(self, num_rows: int, width: int) -> StepTimeModel:
        """This model for the verify steps of `num_rows` rows padded to `width` drafts: their
        compute is a constant, max(t_weights, c_token x rows x (1 + width)), whatever the drafts
        (`t_weights_s` holds it, `c_token_s` is 0, no widths left to pad to)."""
        compute = max(self.t_weights_s, self.c_token_s * num_rows * (1 + width))
        return replace(self, t_weights_s=compute, c_token_s=0.0, verify_widths=())

    def scan_widths(self, num_rows: int, num_tokens: int, max_drafts: int) -> list[int | None]:
        """The draft widths whose padded steps the cost rule prices in turn (`padded`), each
        its rows capped at the width, and None for the unpadded step (every row at its cap
        of at most `max_drafts`): [None] where the device pads no verify step of `num_rows`
        rows and `num_tokens` tokens without drafts (no widths, a prompt chunk, more rows
        than `verify_max_rows`); else the widths up to the first >= `max_drafts`, less each
        whose padded step costs what the next one's does (below the weights' knee: the wider
        caps can only do better), and None after them where `max_drafts` is past the widest
        (such a step may run unpadded). That
        last scan prices every count unpadded and is used only where its best has a row past
        the widest width: an approximation (a random search found ~1 step in 400 off the
        exhaustive best, none where the widest width reaches the cap, as the default widths
        [k] do)."""
        if not self.verify_widths or self.padded_width(num_rows, num_tokens + 1, 1) is None:
            return [None]
        widths: list[int | None] = []
        compute = -1.0  # of the last width kept
        for width in self.verify_widths:
            width_compute = max(self.t_weights_s, self.c_token_s * num_rows * (1 + width))
            if width_compute == compute:  # below the knee: the wider one costs the same
                widths.pop()
            widths.append(width)
            compute = width_compute
            if width >= max_drafts:
                return widths
        return [*widths, None]


# Llama-3.1-8B, bf16, one H100 (benchmarks/itl_sim.py): 16.06 GB of weights at 85 % of 3.35 TB/s,
# 2 x 8.03e9 FLOP per token at 60 % of 989 TFLOP/s, 128 KiB of KV per token at 85 % of 3.35 TB/s.
LLAMA_8B_H100 = StepTimeModel(
    t_host_s=1.0e-3,
    t_weights_s=16.06e9 / (0.85 * 3.35e12),
    c_token_s=2 * 8.03e9 / (0.60 * 989e12),
    c_kv_s=131072 / (0.85 * 3.35e12),
)
