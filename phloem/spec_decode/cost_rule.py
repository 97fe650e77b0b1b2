"""The cost rule of speculative decoding: how many drafts each request verifies this step (0 =
off), chosen to maximize the step's expected output tokens per second. Pure Python.

Step time: `step_model.StepTimeModel`, t = t_host + max(t_weights, c_token x T) + c_kv x K +
c_row x R + c_draft x D + t_verify x [D > 0] (T tokens computed, drafts included; K KV tokens
read; R rows sampled; D drafts), a verify step padded to a graph width computing R x (1 + w)
tokens; a prior corrected online by the device's step times (`step_time.StepTimeLearner`).

Expected tokens (Leviathan et al. 2023, arXiv 2211.17192, §3.1, with an i.i.d. per-token
acceptance rate a): a request verifying k drafts emits 1 + a + a^2 + ... + a^k tokens, so its
(j+1)-th draft adds a^(j+1). Acceptance is not i.i.d. where a request copies text: a draft that
follows an accepted one is accepted far more often than one that follows a rejection (a run of
copied text goes on until the model paraphrases). A candidate may thus carry a second rate c, the
acceptance of each draft after its first: its (j+1)-th draft adds a x c^j, a and c set by the
request's state (`AcceptanceTracker.chain`: after a verify that accepted all its drafts, both the
rate of drafts that followed an accepted one; else the first draft's rate after a rejection and
the lower of the overall rate and that after accepted drafts). With c = a this is the i.i.d.
formula. Measured in benchmarks/results/2026-11-26c-cpu-spec-decode/.

The rule hands out drafts one at a time to the request whose next draft adds the most (a request's
gains fall: c <= 1), while the ratio (sampled sequences + sum of those gains) / (t - t_prefill)
grows, where t_prefill = t(T) - t(sampled sequences) is what the step's prompt chunks add to it
without drafts: their time is spent anyway, and charging it to the drafts would make any draft look
cheap beside a long chunk. Gains fall and, after the first draft (which also pays t_verify), time
increments do not fall, so the ratio rises then falls along that order: stopping at its first fall
finds its best prefix. Padded to a width, the compute does not move with the drafts (the
increments are c_draft + c_kv): each width's scan finds its best prefix, and the rule takes the
best of them.

Acceptance rates: `acceptance.AcceptanceTracker`.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, islice, repeat
from math import inf
from operator import mul, sub

from phloem.spec_decode.step_model import LLAMA_8B_H100 as LLAMA_8B_H100
from phloem.spec_decode.step_model import StepTimeModel


@dataclass(frozen=True)
class CostRuleConfig:
    """Settings of the cost rule.

    Attributes:
        max_draft_tokens: the most drafts one request verifies per step (the user's
            `num_speculative_tokens`) [tokens], >= 1.
        min_gain: speculate only where the expected tokens per second beat no drafts by this
            factor (a margin for the model's error), >= 1.
    """

    max_draft_tokens: int = 5
    min_gain: float = 1.02

    def validate(self) -> None:
        """Raise ValueError naming the field out of range."""
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if self.min_gain < 1.0:
            raise ValueError(f"min_gain must be >= 1, got {self.min_gain}")


@dataclass(frozen=True, slots=True)
class DraftCandidate:
    """One sampled sequence of the step that could verify drafts.

    Attributes:
        acceptance_rate: its estimated per-draft acceptance rate, in [0, 1].
        max_draft_tokens: drafts available (proposed already, or a draft model's budget)
            [tokens].
        continue_rate: acceptance rate of a draft after an accepted one (the chain's c), in
            [0, 1]; None: the same as `acceptance_rate` (i.i.d.).
    """

    acceptance_rate: float
    max_draft_tokens: int
    continue_rate: float | None = None

    @property
    def next_rate(self) -> float:
        """The factor from one draft's gain to the next's (c, or a when i.i.d.)."""
        return self.acceptance_rate if self.continue_rate is None else self.continue_rate


def expected_tokens(acceptance_rate: float, num_drafts: int) -> float:
    """Tokens one verify of `num_drafts` drafts emits on average: sum of a^j, j = 0..k
    (Leviathan et al. 2023 §3.1, i.i.d. acceptance)."""
    return sum(acceptance_rate**j for j in range(num_drafts + 1))


# The most drafts on offer that `choose_num_drafts` merges by one sort (past the heap's first two):
# sorting them all costs ~0.03 us a draft on offer, the heap ~0.3 us a draft handed out, so where
# many are offered and few pay (batch 256, low rates) the sort cost more than the heap saved
MERGE_MAX_DRAFTS = 1024


def choose_num_drafts(
    candidates: Sequence[DraftCandidate],
    num_sampled: int,
    num_scheduled_tokens: int,
    num_kv_tokens: int,
    model: StepTimeModel,
    config: CostRuleConfig,
) -> list[int]:
    """Drafts per candidate (0 = no speculation), maximizing expected tokens per second.

    The drafts go out in the order of a heap of each candidate's next gain, (minus gain,
    index) smallest first (module docstring). The first 2 x (candidates) come off such a heap:
    where drafts do not pay the ratio mostly falls within them, and nothing else is built
    (building and sorting all drafts on offer costs about as much as ~70 pops at batch 32 x
    k = 16). The rest are each candidate's remaining gains (falling: c <= 1), merged by one
    stable sort of them laid out candidate by candidate, draft by draft (at most
    `MERGE_MAX_DRAFTS` on offer; more go through the heap to the end), which is the heap's
    order: a heap holding one entry per candidate pops equal gains by index, and a candidate's
    equal gains one after the other (its next entry ties with the one just popped and keeps
    its index). Gains are the same
    floats as the heap's (each the previous one times c), so the ratios and the stop are too.
    At batch 32 x k = 16 (~360 drafts handed out) ~170 us with the heap to the end, ~95 us
    merged (results/2026-11-27c-cpu-spec-drafting). Where the model pads verify steps, this
    runs once per width of `StepTimeModel.scan_widths`, each candidate capped at the width and
    the compute that of rows x (1 + width) tokens; the best rate of them is taken.

    Args:
        candidates: the step's sampled sequences that have drafts to offer, in any order.
        num_sampled: sequences the step samples (candidates or not; each emits one token
            without drafts) [sequences], >= len(candidates).
        num_scheduled_tokens: tokens the step computes without drafts (decode tokens and
            prompt chunks) [tokens].
        num_kv_tokens: KV tokens the step reads without drafts [tokens].
        model, config: the step time model and the rule's settings.

    Returns one k per candidate, 0 <= k <= min(its max_draft_tokens, config.max_draft_tokens);
    all 0 unless the best choice beats no drafts by `config.min_gain`. Raises ValueError on an
    acceptance rate outside [0, 1] or num_sampled < len(candidates).
    """
    _check_candidates(candidates, num_sampled)
    caps = [min(c.max_draft_tokens, config.max_draft_tokens) for c in candidates]
    best: tuple[_RatioScan, list[int]] | None = None
    widths = model.scan_widths(num_sampled, num_scheduled_tokens, max(caps, default=0))
    for width in widths:
        padded = None if width is None else model.padded(num_sampled, width)
        scan = _RatioScan(num_sampled, num_scheduled_tokens, num_kv_tokens, model, padded)
        capped = caps if width is None else [min(c, width) for c in caps]
        drafts = _allocate(candidates, capped, scan)
        if width is None and len(widths) > 1 and max(drafts) <= model.verify_widths[-1]:
            continue  # the device pads it: priced by that width's scan
        if best is None or scan.best_rate > best[0].best_rate:
            best = scan, drafts
    if best is None or not best[0].pays(config.min_gain):
        return [0] * len(candidates)
    return best[1]


def _allocate(candidates: Sequence[DraftCandidate], caps: list[int], scan: _RatioScan) -> list[int]:
    """The drafts per candidate (each at most its cap) of the best prefix of the heap's order
    that `scan` finds (`choose_num_drafts`: the heap, then the merge), before the `min_gain`
    check."""
    drafts = [0] * len(candidates)
    order: list[int] = []  # the candidate of each draft handed out off the heap, in order
    heap = [(-c.acceptance_rate, i) for i, c in enumerate(candidates) if caps[i] > 0]
    heapq.heapify(heap)
    popped = _heap_order(heap, candidates, caps, drafts, order)
    if sum(caps) > MERGE_MAX_DRAFTS:
        scan.add(popped, sum(caps))
    elif not scan.add(islice(popped, 2 * len(heap)), sum(caps)):
        rest = _remaining_gains(heap, candidates, caps, drafts)
        merged = sorted(chain.from_iterable(rest))
        scan.add(merged, sum(caps))
        num_merged = scan.best_num_drafts - len(order)
        if num_merged > 0:
            _allot(drafts, rest, merged[num_merged - 1], num_merged)
            return drafts
    chosen = [0] * len(candidates)
    for i in order[: scan.best_num_drafts]:
        chosen[i] += 1
    return chosen


def _remaining_gains(
    heap: list[tuple[float, int]],
    candidates: Sequence[DraftCandidate],
    caps: list[int],
    drafts: list[int],
) -> list[list[float]]:
    """Minus the remaining gains of each candidate (`choose_num_drafts`' merge), rising (gains
    fall) from its heap entry; [] for a candidate with no entry left."""
    rest: list[list[float]] = [[] for _ in candidates]
    for neg_gain, i in heap:
        rate = candidates[i].next_rate
        rest[i] = list(accumulate(repeat(rate, caps[i] - drafts[i] - 1), mul, initial=neg_gain))
    return rest


def _heap_order(
    heap: list[tuple[float, int]],
    candidates: Sequence[DraftCandidate],
    caps: list[int],
    drafts: list[int],
    order: list[int],
) -> Iterator[float]:
    """Minus the gain of each draft off `heap` ((minus gain, candidate) entries, one per
    candidate), in order: the top is replaced by its candidate's next draft (one sift a draft,
    not two: entries are unique by candidate, so the pops come in the same order) or popped at
    its cap. Counts each in `drafts` and `order` as it goes; the heap is updated before the
    gain is yielded, so a consumer that stops finds the heap of the drafts not handed out."""
    replace, pop = heapq.heapreplace, heapq.heappop
    while heap:
        neg_gain, i = heap[0]
        drafts[i] += 1
        order.append(i)
        if drafts[i] < caps[i]:
            replace(heap, (neg_gain * candidates[i].next_rate, i))
        else:
            pop(heap)
        yield neg_gain


def _allot(drafts: list[int], rest: list[list[float]], last: float, num: int) -> None:
    """Add to `drafts` the first `num` entries of the stable sort of `rest` (per candidate,
    minus its remaining gains, rising), whose last is `last`: per candidate its entries below
    `last`, then those equal to it, candidate by candidate while they last (the sort's order)."""
    ties = []
    for i, negs in enumerate(rest):
        below = bisect_left(negs, last)
        drafts[i] += below
        num -= below
        ties.append(bisect_right(negs, last, below) - below)
    for i, tied in enumerate(ties):
        if num <= 0:
            break
        take = min(tied, num)
        drafts[i] += take
        num -= take


class _RatioScan:
    """The rule's scan over drafts handed out in order (`choose_num_drafts`): the ratio
    (sampled + gains) / (t - t_prefill) after each, the best count so far, and the stop at its
    first fall past the first draft (module docstring).

    `model.step_time_s(num_scheduled_tokens + n, num_kv_tokens + n, n, num_sampled)` is spelled
    out (the same floats): this runs once per draft, ~500 times a step at batch 32 x k = 16.
    Below the knee (n <= `knee`: c_token x tokens <= t_weights, which `max` then returns) the
    compute term is t_weights and t_host + c_row x rows + t_weights is added once. `padded`:
    the model of the step's verify steps where the device pads them to a width
    (`StepTimeModel.padded`: every n below the knee); the base rate is `model`'s plain step.
    """

    def __init__(
        self,
        num_sampled: int,
        num_scheduled_tokens: int,
        num_kv_tokens: int,
        model: StepTimeModel,
        padded: StepTimeModel | None = None,
    ) -> None:
        self.prefill_s, self.base_rate = _base_rate(
            num_sampled, num_scheduled_tokens, num_kv_tokens, model
        )
        self.best_rate, self.best_num_drafts = self.base_rate, 0
        self.previous, self.tokens, self.num_drafts = self.base_rate, float(num_sampled), 0
        self.stopped = False
        self.num_sampled, self.num_scheduled_tokens, self.num_kv_tokens = (
            num_sampled, num_scheduled_tokens, num_kv_tokens)  # fmt: skip
        self.model = model if padded is None else padded
        self.knee = -1  # not known yet

    def add(self, neg_gains: Iterable[float], max_drafts: int) -> bool:
        """Hand out drafts of these minus gains, in order, until the ratio falls; returns
        whether it fell (the scan stopped). `max_drafts`: the most drafts the step can get."""
        model, prefill_s = self.model, self.prefill_s
        num_tokens, num_kv = self.num_scheduled_tokens, self.num_kv_tokens
        t_host, c_token, c_kv = model.t_host_s, model.c_token_s, model.c_kv_s
        c_draft, t_verify = model.c_draft_s, model.t_verify_s
        t_host += model.c_row_s * self.num_sampled  # (+ 0.0 without a row term: the same floats)
        if self.knee < 0:  # the c_token x tokens rise with n: the last n at most t_weights
            key = lambda n: c_token * (num_tokens + n)  # noqa: E731
            self.knee = bisect_right(range(1, max_drafts + 1), model.t_weights_s, key=key)
        knee, fixed = self.knee, t_host + model.t_weights_s
        best_rate, best_num, previous = self.best_rate, self.best_num_drafts, self.previous
        n, tokens = self.num_drafts, self.tokens
        sums = accumulate(neg_gains, sub, initial=tokens)  # tokens -= neg_gain, draft by draft
        next(sums)
        for tokens in sums:
            n += 1
            if n <= knee:
                step_s = fixed + c_kv * (num_kv + n) + (c_draft * n + t_verify)
            else:
                step_s = t_host + c_token * (num_tokens + n) + c_kv * (num_kv + n) + (
                    c_draft * n + t_verify)  # fmt: skip
            rate = tokens / (step_s - prefill_s)
            if rate > best_rate:
                best_rate, best_num = rate, n
            elif n > 1 and rate < previous:  # (best_rate >= previous: never both)
                self.stopped = True
                break  # past the first draft the ratio only falls from here
            previous = rate
        self.best_rate, self.best_num_drafts, self.previous = best_rate, best_num, previous
        self.num_drafts, self.tokens = n, tokens
        return self.stopped

    def pays(self, min_gain: float) -> bool:
        """Whether the best count beats no drafts by `min_gain` (and hands out any)."""
        return self.best_num_drafts > 0 and self.best_rate >= min_gain * self.base_rate


def uniform_drafts_pay(
    candidate: DraftCandidate,
    num_candidates: int,
    num_sampled: int,
    num_scheduled_tokens: int,
    num_kv_tokens: int,
    model: StepTimeModel,
    config: CostRuleConfig,
) -> bool:
    """`any(choose_num_drafts([candidate] * num_candidates, ...))` without the list: whether
    `uniform_num_drafts` hands out any draft. The scan stops at the first count of drafts that
    pays (its rate beats no drafts by `min_gain`): the best count's rate is at least that one's.
    At batch 32 x k = 16 where drafts pay, the full scan to the best count was ~500 rate
    evaluations a step (~0.15 ms of the drafter's pre-check on a 1.5 ms step of a small model,
    results/2026-11-27b-h200). Raises ValueError as `choose_num_drafts` does."""
    num_drafts, _ = _uniform_scan(
        candidate,
        num_candidates,
        num_sampled,
        num_scheduled_tokens,
        num_kv_tokens,
        model,
        config,
        first_paying=True,
    )
    return num_drafts > 0


def uniform_num_drafts(
    candidate: DraftCandidate,
    num_candidates: int,
    num_sampled: int,
    num_scheduled_tokens: int,
    num_kv_tokens: int,
    model: StepTimeModel,
    config: CostRuleConfig,
) -> tuple[int, int]:
    """(sum, max) of `choose_num_drafts([candidate] * num_candidates, ...)`: the drafts handed
    out in all and the most one candidate gets, (0, 0) when none pays; one scan without the
    list: the drafter's pre-check asks it every step, at a large batch for hundreds of equal
    candidates. Equal candidates' gains come in rounds (every candidate's j-th draft adds
    a x c^(j-1)), so the same gains are added in the order `choose_num_drafts`' heap adds them,
    the same ratios are computed and the loop stops at the same first fall. Raises ValueError
    as `choose_num_drafts` does."""
    best_num_drafts, cap = _uniform_scan(
        candidate, num_candidates, num_sampled, num_scheduled_tokens, num_kv_tokens, model, config
    )
    if best_num_drafts == 0:
        return 0, 0
    return best_num_drafts, _first_candidate_drafts(candidate, cap, num_candidates, best_num_drafts)


def _uniform_scan(
    candidate: DraftCandidate,
    num_candidates: int,
    num_sampled: int,
    num_scheduled_tokens: int,
    num_kv_tokens: int,
    model: StepTimeModel,
    config: CostRuleConfig,
    first_paying: bool = False,
) -> tuple[int, int]:
    """(drafts `uniform_num_drafts` hands out, 0 when none pays; the per-candidate cap of the
    scan that found them: the padded width's where the device pads, `choose_num_drafts`'
    widths); `first_paying`: stop at the first count that pays instead (a count > 0 iff one
    pays)."""
    _check_candidates([candidate], max(num_sampled, 1))
    if num_sampled < num_candidates:
        raise ValueError(f"num_sampled must be >= len(candidates) = {num_candidates}")
    cap = min(candidate.max_draft_tokens, config.max_draft_tokens)
    if num_candidates <= 0 or cap <= 0:
        return 0, cap
    prefill_s, base_rate = _base_rate(num_sampled, num_scheduled_tokens, num_kv_tokens, model)
    pays_at = config.min_gain * base_rate
    best_rate, best_num_drafts, best_cap = base_rate, 0, cap
    widths = model.scan_widths(num_sampled, num_scheduled_tokens, cap)
    for width in widths:
        capped = cap if width is None else min(cap, width)
        step_model = model if width is None else model.padded(num_sampled, width)
        # the unpadded scan of a step the device may pad: only its counts past the widest width
        mixed = width is None and len(widths) > 1
        stop_at = pays_at if first_paying and not mixed else inf
        step = (num_sampled, num_scheduled_tokens, num_kv_tokens, prefill_s, base_rate)
        rate, num_drafts = _uniform_loop(
            candidate, num_candidates, capped, step, step_model, stop_at
        )
        if (
            mixed
            and _first_candidate_drafts(candidate, capped, num_candidates, num_drafts)
            <= model.verify_widths[-1]
        ):
            continue  # the device pads it: priced by that width's scan
        if rate >= stop_at and num_drafts:
            return num_drafts, capped
        if rate > best_rate:
            best_rate, best_num_drafts, best_cap = rate, num_drafts, capped
    if best_num_drafts == 0 or best_rate < pays_at:
        return 0, cap
    return best_num_drafts, best_cap


def _uniform_loop(
    candidate: DraftCandidate,
    num_candidates: int,
    cap: int,
    step: tuple[int, int, int, float, float],
    model: StepTimeModel,
    stop_at: float,
) -> tuple[float, int]:
    """(best rate, its drafts) of `num_candidates` copies of `candidate`, each capped at `cap`,
    drafts handed out in rounds (`uniform_num_drafts`); `step`: (sampled rows, scheduled
    tokens, KV tokens, the chunks' share [s], the base rate); returns at the first count whose
    rate is the best so far and >= `stop_at`."""
    num_sampled, num_scheduled_tokens, num_kv_tokens, prefill_s, base_rate = step
    best_rate, best_num_drafts = base_rate, 0
    previous, tokens, gain, num_drafts = base_rate, float(num_sampled), candidate.acceptance_rate, 0
    # `model.step_time_s` spelled out (the same floats), as in `choose_num_drafts`
    t_host, t_weights, c_token = model.t_host_s, model.t_weights_s, model.c_token_s
    c_kv, c_draft, t_verify = model.c_kv_s, model.c_draft_s, model.t_verify_s
    t_host += model.c_row_s * num_sampled  # (+ 0.0 without a row term: the same floats)
    for _ in range(cap):
        for _ in range(num_candidates):
            tokens += gain
            num_drafts += 1
            compute = max(t_weights, c_token * (num_scheduled_tokens + num_drafts))
            verify = c_draft * num_drafts + t_verify
            rate = tokens / (t_host + compute + c_kv * (num_kv_tokens + num_drafts) + verify
                             - prefill_s)  # fmt: skip
            if rate > best_rate:
                best_rate, best_num_drafts = rate, num_drafts
                if rate >= stop_at:
                    return rate, num_drafts
            if num_drafts > 1 and rate < previous:
                break  # past the first draft the ratio only falls from here
            previous = rate
        else:
            gain *= candidate.next_rate
            continue
        break  # the inner loop saw the fall
    return best_rate, best_num_drafts


def _first_candidate_drafts(
    candidate: DraftCandidate, cap: int, num_candidates: int, num_drafts: int
) -> int:
    """The drafts candidate 0 (the one with the most) holds among the first `num_drafts` that
    `choose_num_drafts`' heap hands out to `num_candidates` copies of `candidate`, each capped
    at `cap`. The heap pops by (gain, index): while gains fall (a x c^j > a x c^(j+1)) drafts go
    in rounds, one per candidate; from the round whose gain is a fixed point (c = 1, or a gain
    that reached 0) all later rounds tie, so candidate 0 takes the rest of its cap before
    candidate 1 takes any:

        |-- round 0: cand 0, 1, .. --|-- round 1: ... --|-- tied rounds: cand 0 x m, cand 1 x m, ..
    """
    held, gain = 0, candidate.acceptance_rate
    for num_rounds in range(cap):
        if num_drafts <= 0:
            break
        if gain * candidate.next_rate == gain:  # every later round ties with this one
            return held + min(cap - num_rounds, num_drafts)
        held += 1
        num_drafts -= num_candidates
        gain *= candidate.next_rate
    return held


def _base_rate(
    num_sampled: int, num_scheduled_tokens: int, num_kv_tokens: int, model: StepTimeModel
) -> tuple[float, float]:
    """(the prompt chunks' own share of the step [s], which is charged to them and not to the
    drafts; the step's tokens per second without drafts, that share left out). The rows are
    the sampled ones in both steps, so their cost (`c_row_s`) is not the chunks'."""
    step_s = model.step_time_s(num_scheduled_tokens, num_kv_tokens, 0, num_sampled)
    prefill_s = step_s - model.step_time_s(
        min(num_sampled, num_scheduled_tokens), num_kv_tokens, 0, num_sampled
    )
    return prefill_s, num_sampled / (step_s - prefill_s)


def _check_candidates(candidates: Sequence[DraftCandidate], num_sampled: int) -> None:
    """Raise ValueError naming the field of `choose_num_drafts`'s input that is out of range."""
    if num_sampled < len(candidates):
        raise ValueError(f"num_sampled must be >= len(candidates) = {len(candidates)}")
    for c in candidates:
        if not 0.0 <= c.acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must lie in [0, 1], got {c.acceptance_rate}")
        if not 0.0 <= c.next_rate <= 1.0:
            raise ValueError(f"continue_rate must lie in [0, 1], got {c.continue_rate}")
