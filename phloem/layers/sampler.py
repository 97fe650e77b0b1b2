"""Turn one step's logits into next tokens (vLLM v1 semantics, batched, device-agnostic).
Owns the per-step sampling pipeline, applied to a private copy of the `[B, V]` logits:

    grammar bitmask (structured outputs: disallowed tokens -> -inf) -> banned ids -> repetition penalty -> frequency / presence penalties
      -> temperature == 0: argmax                      (greedy rows: no randomness consumed)
      -> else: / temperature -> min_p -> top_k -> top_p -> exponential-race draw

This is the order of vLLM v1's `Sampler` (min_p is its default argmax-invariant logits processor,
applied after temperature and before `apply_top_k_top_p`, which does top-k then top-p). min_p is
therefore measured on the full tempered distribution, and top_p on the distribution left after
min_p and top_k, renormalized. The grammar mask is applied where it changes no float: after
the bans, penalties and temperature, which map -inf to -inf entry by entry (`PreparedSampling`),
so a constrained step enqueues all of that (`Sampler.prepare`) while its bitmask is filled.

Returned log-probs are vLLM's default `raw_logprobs`: `log_softmax` of the caller's logits after the
grammar mask (as vLLM v1 masks before its sampler), before banning, penalties, temperature and
truncation.

Determinism: a seeded row (one with a `SeedStream`, as the engine builds every seeded request's)
draws one length-V noise vector per step that is a pure function of (seed, draws so far, token
id) (`ops.seeded_noise`: a counter-based hash, every seeded row of a step in one kernel), so its
tokens depend only on its seed and its own history, never on batch size, position or
neighbours. A row with a `torch.Generator` and no stream draws one `exponential_` vector from it
(one kernel a row; callers outside the engine). Rows with neither share a single batched draw
from the sampler's generator. Greedy rows draw nothing. Truncation uses value thresholds (ties at
a boundary are all kept), so no result depends on the order an unstable sort leaves equal values
in.

Assumes at least one token of every row survives banning (the engine bans only EOS and stop ids).

Non-finite logits: each row is flagged on the device by its max (NaN/inf exactly when it holds a
NaN or +inf, or is all -inf; a -inf entry alone is a mask); a plain greedy step's max is its argmax
pass (`ops/row_max.py`). The flags reach the host behind the step's tokens (no extra sync); a
flagged random row is sampled from zeros; its caller fails that row's request (`num_nonfinite`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from phloem.layers.logits_processors import (
    Truncation,
    apply_banned,
    apply_penalties,
)
from phloem.layers.logits_processors import device_tensor as _device_tensor
from phloem.ops.row_max import row_max
from phloem.ops.seeded_noise import SeedStream, seeded_exponentials_
from phloem.ops.staging import to_host
from phloem.ops.token_bitmask import apply_token_bitmask_
from phloem.sampling_params import SamplingParams

# vLLM's _SAMPLING_EPS: temperatures below it are greedy. Dividing by a smaller positive
# temperature would only overflow float32 on the way to the same argmax.
GREEDY_TEMPERATURE = 1e-5

# why a request whose logits row held NaN or inf fails (the row's token is a placeholder)
NON_FINITE_MESSAGE = "the model produced non-finite logits (NaN or inf) for this request"


def seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `seed` modulo 2^64 (any int is reduced into
    the range `manual_seed` takes, so no seed overflows; see `SamplingParams.generator_seed`)."""
    return torch.Generator(device=device).manual_seed(seed % 2**64)


@dataclass
class SamplingRow:
    """One row of the logits matrix: one sequence to sample a token for.

    Fields:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (repetition penalty looks at prompt and output).
        output_token_ids: tokens generated so far (all three penalties look at these).
        generator: the request's seeded generator, on the logits' device: the speculative
            verifier's randomness (`spec_decode.rejection_sampler`), and the sampler's for a row
            without a seed stream; None (and no stream) means the sampler's own generator
            (shared by all such rows in one batched draw).
        banned_token_ids: ids set to -inf before anything else (the engine passes EOS and
            stop_token_ids while fewer than min_tokens tokens exist). Ids >= V are ignored.
        seed_stream: the request's counter-based noise stream (`ops.seeded_noise`), which the
            sampler draws from (before the generator) and advances by one draw a random step.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    banned_token_ids: Sequence[int] = ()
    seed_stream: SeedStream | None = None


@dataclass
class SamplerOutput:
    """What one step produced, one entry per row, in row order.

    Fields:
        token_ids: [B] sampled token ids.
        logprobs: [B] log-prob of the sampled token under log_softmax(input logits); all None
            when no row asked for logprobs (the log-softmax over the vocabulary is then skipped).
        top_logprobs: [B] for rows with params.logprobs = k: {token_id: raw log-prob} for the k
            most likely tokens plus the sampled one (k or k + 1 entries); None for other rows.
        num_nonfinite: [B] 1 where the row of input logits holds a NaN or +inf, or is all -inf
            (see the module docstring), else 0; a flagged row is sampled from zeros (its token
            is a placeholder). A -inf entry alone is a mask, not a fault.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    num_nonfinite: list[int]


def non_finite(row_values: torch.Tensor) -> torch.Tensor:
    """int64 [B]: 1 where a row's max ([B]) is NaN or infinite, i.e. where the row holds a NaN
    or +inf (max propagates NaN) or is all -inf; -inf entries alone are masks, not faults."""
    return row_values.isfinite().logical_not_().long()


def _check_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [len(rows), V] = [{len(rows)}, V], got {tuple(logits.shape)}"
        )


def plain_greedy(rows: Sequence[SamplingRow]) -> bool:
    """Every row greedy with nothing that needs a float32 copy (no logprobs, bans, penalties)."""
    return all(
        r.params.temperature < GREEDY_TEMPERATURE
        and r.params.logprobs is None
        and not r.banned_token_ids
        and not r.params.has_penalties
        for r in rows
    )


def logprobs_k(rows: Sequence[SamplingRow], vocab_size: int) -> int | None:
    """The most top log-probs a row asks for, capped at V (0: only the sampled tokens'); None
    when no row asks (`SampledTokens.start` then skips the log-softmax)."""
    asked = [k for r in rows if (k := r.params.logprobs) is not None]
    return min(max(asked), vocab_size) if asked else None


def processed_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a random row is drawn from: temperature, min_p, top-k/top-p, softmax.

    x: [R, V] float32 (after bans and penalties), not modified; params: [R] (random rows).
    Returns float32 [R, V] rows summing to 1: what the sampler draws from, and what speculative
    decoding verifies drafts against (`phloem.spec_decode`)."""
    temperature = _device_tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
    truncation = Truncation.build(params, x.shape[1], x.dtype, x.device)
    return truncation.probs(x / temperature[:, None])


@dataclass(eq=False)
class PreparedSampling:
    """A step's sampling enqueued up to its grammar mask (`Sampler.prepare`); `finish` enqueues
    the mask, then what reads a row's distribution as a whole (min-p, top-k/top-p, softmax),
    the draw and the copy to the host, from device tensors only (no row's params read: a fixed
    number of launches at any batch size). The mask (disallowed tokens -> -inf) commutes bit
    for bit with what `prepare` did after the float32 copy: bans set -inf, the penalties and
    the division by a positive temperature are elementwise and map -inf to -inf, so each
    allowed entry holds the same float whether the mask came first or last.

    Fields:
        rows: the step's rows [B]; num_nonfinite: int64 [B] (of the logits); max_k: `logprobs_k`.
        raw: [B, V] the log-probs' source: float32, non-finite rows zeroed (plain greedy: a
            copy of the logits). x: raw after bans, penalties and the random rows' temperature
            (greedy rows divided by 1), what the tokens come from (None once finished).
        plain: ids by `row_max` of x (a plain greedy step).
        truncation: the random rows' `Truncation`; None when no row is random.
        split: (greedy rows, random rows) int64 indices when both kinds are present, else None.
        noise: the random rows' noise [random rows, V] (`Sampler.draw_noise`); None: drawn by
            `draw` after the truncation (as `launch` draws it: a batch whose truncation raises
            drew nothing, `worker.sampling_rows.launch_sampler`).
    """

    rows: list[SamplingRow]
    raw: torch.Tensor
    x: torch.Tensor | None
    num_nonfinite: torch.Tensor
    max_k: int | None = None
    plain: bool = False
    truncation: Truncation | None = None
    split: tuple[torch.Tensor, torch.Tensor] | None = None
    noise: torch.Tensor | None = None
    draw: Callable[[], torch.Tensor] | None = None

    def finish(self, grammar: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampledTokens:
        """Enqueue the rest of the sampling (see the class docstring) under `grammar` (bitmask
        int32 [R, ceil(V / 32)], row indices int64 [R] on the logits' device, as
        `Sampler.launch` takes it; None: no mask). Once only: raises RuntimeError after."""
        x, raw = self.x, self.raw
        if x is None:
            raise RuntimeError("this prepared sampling was finished already")
        self.x = None
        if grammar is not None:
            apply_token_bitmask_(x, *grammar)
            if raw is not x and self.max_k is not None:  # the log-probs are taken of it
                apply_token_bitmask_(raw, *grammar)
        if self.plain:
            tokens = row_max(x)[1]
        elif self.truncation is None:
            tokens = x.argmax(dim=-1)
        elif self.split is None:
            tokens = self._draw(x)
        else:
            greedy, random = self.split
            tokens = torch.empty(len(self.rows), dtype=torch.long, device=x.device)
            tokens[greedy] = x[greedy].argmax(dim=-1)
            tokens[random] = self._draw(x[random])
        return SampledTokens.start(raw, tokens, self.rows, self.num_nonfinite, self.max_k)

    def _draw(self, x: torch.Tensor) -> torch.Tensor:
        """The exponential race over the random rows' truncated distribution: [R, V] -> [R]."""
        assert self.truncation is not None
        probs = self.truncation.probs(x)
        noise = self.noise
        if noise is None:
            assert self.draw is not None
            noise = self.draw()
        return probs.div_(noise).argmax(dim=-1)


class Sampler:
    """Samples one token per row of a logits matrix; see the module docstring for the order.

    Holds one generator (seeded with `seed`, on `device`) for rows that bring none. Stateless
    otherwise; the caller's logits are never modified.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = seeded_generator(seed, self.device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row.

        logits: [B, V] in any float dtype (the model's; upcast to float32 here unless every row
            is plain greedy), B == len(rows); not modified.
        Advances each random row's seed stream (else its generator, else the sampler's) by one
        draw; greedy rows advance nothing. Raises ValueError on a shape mismatch. One
        device-to-host copy at the end.
        Rows with NaN/inf logits are flagged (`SamplerOutput.num_nonfinite`), not raised on.
        """
        return self.launch(logits, rows).result()

    def launch(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
        noise: torch.Tensor | None = None,
    ) -> SampledTokens:
        """`__call__` without waiting: enqueues the sampling and the copy of its results to
        the host; `SampledTokens.tokens` (int64 [B], on the logits' device) can feed the next
        step's inputs on the device before the host has the ids. grammar: (bitmask int32
        [R, ceil(V / 32)], row indices int64 [R]) on logits' device:
        structured-output rows' allowed tokens, applied to the float32 copy the other steps
        work on (`ops.token_bitmask.apply_token_bitmask_`; a plain greedy step masks a copy of
        `logits`); the non-finite flags are taken before it: its -inf is no model fault.
        noise: `draw_noise(rows, V, device)`, drawn earlier, or None: drawn here; the same
        tokens either way. `prepare(...).finish(grammar)` but for a plain greedy free step."""
        _check_logits(logits, rows)
        if grammar is None and plain_greedy(rows):
            # Plain greedy step (the offline batch's usual case): one max over the logits in their
            # own dtype (`row_max`) gives the ids and the flags. Upcasting is exact and monotone,
            # so the ids (first index among ties) equal argmax of a float32 copy, which would cost
            # a [B, V] float32 write and read (1 GiB each for 2,048 rows of a 128K vocabulary).
            # max propagates NaN, so a row's max is non-finite when it holds a NaN or +inf (or
            # is all -inf); its id is still an id: nothing to replace.
            values, tokens = row_max(logits)
            return SampledTokens.start(logits, tokens, rows, non_finite(values), None)
        return self.prepare(logits, rows, noise).finish(grammar)

    def prepare(
        self, logits: torch.Tensor, rows: list[SamplingRow], noise: torch.Tensor | None = None
    ) -> PreparedSampling:
        """Enqueue the part of `launch` that needs no grammar bitmask (a constrained step's,
        while its bitmask is filled: `ModelRunner.presample`): the non-finite flags, the
        float32 copy, bans, penalties, the random rows' temperature and every per-row tensor;
        `finish(grammar)` enqueues the rest: `launch`'s tokens (`PreparedSampling`). logits,
        noise: as `launch` takes them (noise None: `finish` draws it). Raises ValueError on a
        shape mismatch."""
        _check_logits(logits, rows)
        num_nonfinite = non_finite(logits.amax(dim=-1))
        if plain_greedy(rows):  # masked on a copy (the caller's logits stay)
            x = logits.clone()
            return PreparedSampling(rows, x, x, num_nonfinite, plain=True)
        vocab_size, device = logits.shape[1], logits.device
        # a non-finite row is sampled from zeros, so no kernel below sees NaN (a new tensor: the
        # caller's logits stay as they were; the grammar masks it in place, a flagged row too)
        raw = logits.float().masked_fill((num_nonfinite != 0)[:, None], 0.0)
        needs_copy = any(r.banned_token_ids or r.params.has_penalties for r in rows)
        x = raw.clone() if needs_copy else raw  # bans and penalties write in place; raw is
        # what the log-probs are taken of
        apply_banned(x, [r.banned_token_ids for r in rows])
        x = self._penalize(x, rows)
        out = PreparedSampling(rows, raw, x, num_nonfinite, logprobs_k(rows, vocab_size))
        random = [i for i, r in enumerate(rows) if r.params.temperature >= GREEDY_TEMPERATURE]
        if noise is not None and tuple(noise.shape) != (len(random), vocab_size):
            raise ValueError(f"noise must be [random rows, V], got {tuple(noise.shape)}")
        if not random:
            return out
        random_rows = [rows[i] for i in random]
        # greedy rows (of a mixed step) are divided by 1: exact
        temperature = [
            t if (t := r.params.temperature) >= GREEDY_TEMPERATURE else 1.0 for r in rows
        ]
        if len(random) < len(rows):
            greedy = [i for i, r in enumerate(rows) if r.params.temperature < GREEDY_TEMPERATURE]
            out.split = tuple(_device_tensor(idx, dtype=torch.long, device=device)
                              for idx in (greedy, random))  # fmt: skip
        t = _device_tensor(temperature, dtype=x.dtype, device=device)[:, None]
        out.x = x.div_(t) if x is not raw or out.max_k is None else x / t  # raw kept as is
        params = [r.params for r in random_rows]
        out.truncation = Truncation.build(params, vocab_size, x.dtype, device)
        out.noise = noise
        out.draw = functools.partial(self._exponentials, random_rows, vocab_size, device)
        return out

    def _penalize(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Apply penalties to the rows that have any (others are untouched); returns x."""
        idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not idx:
            return x
        sub = [rows[i] for i in idx]

        def column(name: str) -> torch.Tensor:
            values = [float(getattr(r.params, name)) for r in sub]
            return _device_tensor(values, dtype=torch.float32, device=x.device)

        idx_t = _device_tensor(idx, dtype=torch.long, device=x.device)
        x[idx_t] = apply_penalties(
            x[idx_t],
            [r.prompt_token_ids for r in sub],
            [r.output_token_ids for r in sub],
            column("repetition_penalty"),
            column("frequency_penalty"),
            column("presence_penalty"),
        )
        return x

    def draw_noise(self, rows: list[SamplingRow], vocab_size: int, device) -> torch.Tensor | None:
        """The noise `launch` would draw for `rows`' random rows (float32 [random rows, V]; None
        if none), drawn now (no logits or bitmask needed), for `launch(noise=...)`."""
        random = [r for r in rows if r.params.temperature >= GREEDY_TEMPERATURE]
        return self._exponentials(random, vocab_size, device) if random else None

    def _exponentials(
        self, rows: list[SamplingRow], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        """float32 [R, V] i.i.d. Exp(1) noise. argmax(probs / q) is a draw from probs (the
        exponential race, equivalent to the Gumbel-max trick: -log q is Gumbel).

        Rows with a seed stream: one counter-based draw each, all in one kernel on CUDA
        (`ops.seeded_noise.seeded_exponentials_`, which advances the streams; already in
        (0, 17)). Rows with only a generator: one length-V `exponential_` draw from it, in place
        into the row (one kernel a row). The others share one [n, V] draw from the sampler's
        generator. The generator draws are clamped away from 0 so 0 / 0 never appears.
        """
        q = torch.empty(len(rows), vocab_size, device=device)
        streams = [s for r in rows if (s := r.seed_stream) is not None]
        streamed = [i for i, r in enumerate(rows) if r.seed_stream is not None]
        own = [i for i, r in enumerate(rows) if r.seed_stream is None and r.generator is not None]
        shared = [i for i, r in enumerate(rows) if r.seed_stream is None and r.generator is None]
        if shared:
            noise = torch.empty(len(shared), vocab_size, device=device)
            noise.exponential_(generator=self.generator)
            if len(shared) == len(rows):
                q = noise
            else:
                q[_device_tensor(shared, dtype=torch.long, device=device)] = noise
        for i in own:
            q[i].exponential_(generator=rows[i].generator)
        if streamed:
            seeded_exponentials_(q, streamed, streams)
            if len(streamed) == len(rows):
                return q
        return q.clamp_min_(torch.finfo(q.dtype).tiny)


class SampledTokens:
    """One step's sampled tokens on their way to the host (see `Sampler.launch`).

    On CUDA the results are copied into pinned host memory with `non_blocking` copies and an
    event is recorded behind them, so `result()` waits for this step's sampling only, not for
    work enqueued after it (the next step, under async scheduling).
    """

    def __init__(self, tokens: torch.Tensor, parts: list[torch.Tensor], rows, max_k: int):
        self.tokens = tokens
        self._rows = rows
        self._max_k = max_k
        self._event = None
        self._parts = [to_host(t) for t in parts]
        if tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @classmethod
    def start(
        cls,
        raw: torch.Tensor,
        tokens: torch.Tensor,
        rows: list[SamplingRow],
        num_nonfinite: torch.Tensor,
        max_k: int | None,
    ) -> SampledTokens:
        """Enqueue what the host needs: the tokens with each row's non-finite flag (int64
        [2, B], one copy), and for logprob rows the raw log-probs of the sampled and of the
        top-k tokens (one log-softmax pass, only if a row asked). max_k: `logprobs_k(rows, V)`
        (None: no row asks)."""
        parts = [torch.stack((tokens, num_nonfinite))]
        if max_k is None:
            return cls(tokens, parts, rows, 0)
        lse = torch.logsumexp(raw, dim=-1)
        sampled_lp = raw.gather(1, tokens[:, None]).squeeze(1) - lse
        parts.append(sampled_lp)
        if max_k > 0:
            values, indices = raw.topk(max_k, dim=-1)
            parts += [values - lse[:, None], indices]
        return cls(tokens, parts, rows, max_k)

    def result(self) -> SamplerOutput:
        """The host lists (waits for this step's copies)."""
        if self._event is not None:
            self._event.synchronize()
        rows = self._rows
        token_list, num_nonfinite = self._parts[0].tolist()
        if len(self._parts) == 1:
            return SamplerOutput(token_list, [None] * len(rows), [None] * len(rows), num_nonfinite)
        lp_list = self._parts[1].tolist()
        top_vals: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if self._max_k > 0:
            top_vals, top_ids = self._parts[2].tolist(), self._parts[3].tolist()
        top_logprobs: list[dict[int, float] | None] = []
        for i, r in enumerate(rows):
            k = r.params.logprobs
            if k is None:
                top_logprobs.append(None)
                continue
            entry = dict(zip(top_ids[i][:k], top_vals[i][:k]))
            entry.setdefault(token_list[i], lp_list[i])
            top_logprobs.append(entry)
        return SamplerOutput(token_list, lp_list, top_logprobs, num_nonfinite)
