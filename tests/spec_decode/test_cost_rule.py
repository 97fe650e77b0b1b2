"""The speculation cost rule: on at batch 1 with a good acceptance rate, off at large
compute-bound batches and at low acceptance, k growing with acceptance, the greedy choice equal
to exhaustive search and to the plain heap loop that it merges by one sort; acceptance-rate
tracking (EMA, global prior, probes)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random

import pytest

from phloem.spec_decode.acceptance import AcceptanceConfig, AcceptanceTracker
from phloem.spec_decode.cost_rule import (
    LLAMA_8B_H100,
    CostRuleConfig,
    DraftCandidate,
    StepTimeModel,
    choose_num_drafts,
    expected_tokens,
    uniform_drafts_pay,
    uniform_num_drafts,
)

CONTEXT = 600  # KV tokens per sequence


def _decode_step(rates, k_available=8, config=None, context=CONTEXT):
    """k per sequence for a pure decode step of len(rates) sequences of `context` tokens."""
    candidates = [DraftCandidate(a, k_available) for a in rates]
    n = len(rates)
    return choose_num_drafts(
        candidates, n, n, n * context, LLAMA_8B_H100, config or CostRuleConfig(max_draft_tokens=8)
    )


def test_on_at_batch_one_with_good_acceptance() -> None:
    assert _decode_step([0.8]) == [8]
    assert _decode_step([0.8], k_available=3) == [3]  # never more than were proposed


def test_off_at_low_acceptance_even_at_batch_one() -> None:
    assert _decode_step([0.01]) == [0]


def test_off_at_large_compute_bound_batches() -> None:
    # 1,024 short sequences: the step's time is its tokens' compute, a draft costs a full token
    assert _decode_step([0.6] * 1024, context=128) == [0] * 1024
    assert _decode_step([0.0] * 1600) == [0] * 1600  # batchllm-like: drafts never accepted
    # the same acceptance pays at a small batch
    assert all(k > 0 for k in _decode_step([0.6] * 8, context=128))
    # and at a large batch of long contexts, where reading the KV dominates the step (each
    # draft reads the KV its sequence reads anyway)
    assert sum(_decode_step([0.6] * 1024, context=2048)) > 0


def test_k_grows_with_acceptance() -> None:
    for batch in (1, 64, 192):
        totals = [sum(_decode_step([a] * batch)) for a in (0.2, 0.4, 0.6, 0.8, 0.95)]
        assert totals == sorted(totals), (batch, totals)
    mixed = _decode_step([0.3, 0.9, 0.6] * 64)
    assert mixed[1] >= mixed[2] >= mixed[0]


def test_prefill_tokens_in_the_step_make_drafts_cost_compute() -> None:
    """Beside a long prompt chunk the step is compute-bound: each draft costs a full token, so a
    low acceptance rate that pays in a decode-only step does not pay there."""
    candidates = [DraftCandidate(0.15, 8)] * 64
    quiet = choose_num_drafts(candidates, 64, 64, 64 * CONTEXT, LLAMA_8B_H100, CostRuleConfig(8))
    busy = choose_num_drafts(  # a 4,000-token prompt chunk shares the step
        candidates, 65, 4064, 64 * CONTEXT, LLAMA_8B_H100, CostRuleConfig(8)
    )
    assert sum(quiet) > 0 and sum(busy) == 0
    # a high acceptance rate still pays beside the chunk
    good = [DraftCandidate(0.9, 8)] * 4
    assert sum(choose_num_drafts(good, 5, 4004, 4 * CONTEXT, LLAMA_8B_H100, CostRuleConfig(8))) > 0


def _chain_tokens(c: DraftCandidate, k: int) -> float:
    """1 + a + a c + ... + a c^(k-1): the expected tokens of a verify of k drafts."""
    return 1 + sum(c.acceptance_rate * c.next_rate**j for j in range(k))


def _rate(candidates, ks, num_sampled, tokens, kv, model):
    emitted = num_sampled - len(candidates)
    emitted += sum(_chain_tokens(c, k) for c, k in zip(candidates, ks))
    d = sum(ks)
    prefill = model.step_time_s(tokens, kv) - model.step_time_s(min(num_sampled, tokens), kv)
    return emitted / (model.step_time_s(tokens + d, kv + d, d) - prefill)


def test_greedy_choice_equals_exhaustive_search() -> None:
    rng = random.Random(0)
    for _ in range(300):
        model = StepTimeModel(
            t_host_s=rng.uniform(0, 2e-3), t_weights_s=rng.uniform(1e-4, 6e-3),
            c_token_s=rng.uniform(1e-6, 5e-5), c_kv_s=rng.uniform(0, 1e-7),
            c_draft_s=rng.uniform(0, 2e-4), t_verify_s=rng.uniform(0, 1e-3),
        )  # fmt: skip
        candidates = [  # i.i.d. or a chain whose later drafts are accepted more often
            DraftCandidate(rng.random(), rng.randint(0, 3), rng.choice([None, rng.random()]))
            for _ in range(3)
        ]
        num_sampled, tokens = 3 + rng.randint(0, 50), rng.randint(3, 600)
        kv = rng.randint(0, 20000)
        chosen = choose_num_drafts(
            candidates, num_sampled, tokens, kv, model, CostRuleConfig(3, 1.0)
        )
        ranges = [range(c.max_draft_tokens + 1) for c in candidates]
        best = max(
            _rate(candidates, ks, num_sampled, tokens, kv, model)
            for ks in itertools.product(*ranges)
        )
        got = _rate(candidates, chosen, num_sampled, tokens, kv, model)
        assert got == pytest.approx(best, rel=1e-9)


def _heap_choose(candidates, num_sampled, tokens, kv, model, config):
    """`choose_num_drafts` written plainly: a heap of (minus gain, index), one draft a pop,
    the ratio after each from `model.step_time_s`, stopping at its first fall."""
    caps = [min(c.max_draft_tokens, config.max_draft_tokens) for c in candidates]
    prefill = model.step_time_s(tokens, kv) - model.step_time_s(min(num_sampled, tokens), kv)
    base = num_sampled / (model.step_time_s(tokens, kv) - prefill)
    heap = [(-c.acceptance_rate, i) for i, c in enumerate(candidates) if caps[i] > 0]
    heapq.heapify(heap)
    order, emitted, best, best_n, previous = [], float(num_sampled), base, 0, base
    while heap:
        neg_gain, i = heapq.heappop(heap)
        order.append(i)
        emitted -= neg_gain
        n = len(order)
        rate = emitted / (model.step_time_s(tokens + n, kv + n, n) - prefill)
        if rate > best:
            best, best_n = rate, n
        if n > 1 and rate < previous:
            break
        previous = rate
        if order.count(i) < caps[i]:
            heapq.heappush(heap, (neg_gain * candidates[i].next_rate, i))
    chosen = [0] * len(candidates)
    if best >= config.min_gain * base:
        for i in order[:best_n]:
            chosen[i] += 1
    return chosen


def test_choice_equals_the_plain_heap_loop() -> None:
    """Random steps, many candidates with tied rates (a few shared values, c = 0 or 1), below
    and past the knee, and more drafts on offer than `MERGE_MAX_DRAFTS` (heap to the end):
    the same drafts as `_heap_choose`, candidate by candidate."""
    rng = random.Random(1)
    for trial in range(1500):
        model = StepTimeModel(
            t_host_s=rng.uniform(0, 2e-3), t_weights_s=rng.choice([0.0, rng.uniform(1e-5, 6e-3)]),
            c_token_s=rng.choice([0.0, rng.uniform(1e-7, 5e-5)]),
            c_kv_s=rng.choice([0.0, rng.uniform(0, 1e-7)]),
            c_draft_s=rng.choice([0.0, rng.uniform(0, 2e-4)]), t_verify_s=rng.uniform(0, 1e-3),
        )  # fmt: skip
        shared = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(3)]
        num = rng.randint(0, 40) if trial % 10 else rng.randint(70, 90)
        candidates = [
            DraftCandidate(
                rng.choice([*shared, rng.random()]),
                rng.randint(0, 20),
                rng.choice([None, 0.0, 1.0, rng.choice(shared), rng.random()]),
            )
            for _ in range(num)
        ]
        num_sampled = num + rng.randint(0, 30)
        tokens, kv = max(num_sampled, 1) + rng.randint(0, 300), rng.randint(0, 50000)
        config = CostRuleConfig(rng.randint(1, 16), rng.choice([1.0, 1.02]))
        args = (candidates, num_sampled, tokens, kv, model, config)
        assert choose_num_drafts(*args) == _heap_choose(*args)


def test_min_gain_keeps_marginal_speculation_off() -> None:
    strict = CostRuleConfig(max_draft_tokens=8, min_gain=10.0)
    assert _decode_step([0.9], config=strict) == [0]


def test_acceptance_tracker_moves_from_the_prior_to_the_request() -> None:
    tracker = AcceptanceTracker(AcceptanceConfig(ema_weight=0.5, prior=0.5, prior_trials=2))
    assert tracker.rate("a") == 0.5
    tracker.observe("a", num_drafts=4, num_accepted=4)  # 4 successes, no rejection trial
    assert tracker.rate("a") > 0.8
    tracker.observe("b", num_drafts=3, num_accepted=0)  # one failed trial
    assert tracker.rate("b") < tracker.rate("a")
    for _ in range(20):
        tracker.observe("b", 3, 0)
    assert tracker.rate("b") < 0.1
    tracker.finish("b")
    assert 0.0 < tracker.global_rate < 1.0


def test_a_request_held_off_is_probed_again() -> None:
    tracker = AcceptanceTracker(AcceptanceConfig(prior=0.5, probe_after=3))
    for _ in range(50):
        tracker.observe("a", 5, 0)
    low = tracker.rate("a")
    assert low < 0.1
    for _ in range(3):
        tracker.skipped("a")
    assert tracker.rate("a") == 0.5
    tracker.observe("a", 1, 0)
    assert tracker.rate("a") < 0.1


def test_bad_input_raises_naming_the_field() -> None:
    with pytest.raises(ValueError, match="acceptance_rate"):
        choose_num_drafts([DraftCandidate(1.5, 2)], 1, 1, 0, LLAMA_8B_H100, CostRuleConfig())
    with pytest.raises(ValueError, match="num_sampled"):
        choose_num_drafts([DraftCandidate(0.5, 2)], 0, 1, 0, LLAMA_8B_H100, CostRuleConfig())
    with pytest.raises(ValueError, match="num_accepted"):
        AcceptanceTracker().observe("a", 2, 3)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        CostRuleConfig(max_draft_tokens=0).validate()
    with pytest.raises(ValueError, match="min_gain"):
        CostRuleConfig(min_gain=0.5).validate()
    with pytest.raises(ValueError, match="c_token_s"):
        StepTimeModel(1e-3, 1e-3, -1.0, 0.0).validate()
    with pytest.raises(ValueError, match="ema_weight"):
        AcceptanceConfig(ema_weight=0.0).validate()


def test_chain_formula_reduces_to_the_iid_one() -> None:
    for a, k in [(0.3, 4), (0.9, 8)]:
        assert _chain_tokens(DraftCandidate(a, k), k) == pytest.approx(expected_tokens(a, k))


# the CPU's step shape: a pass costs as much as many tokens, each draft a little compute
CPU_LIKE = StepTimeModel(t_host_s=75e-3, t_weights_s=0.0, c_token_s=2e-3, c_kv_s=0.0)


def test_a_hot_chain_drafts_more_than_its_first_rate_alone_pays() -> None:
    """A request whose later drafts are accepted far more often than its first (copied text)
    verifies more drafts than an i.i.d. request with the same first rate."""
    config = CostRuleConfig(max_draft_tokens=16)
    iid = choose_num_drafts([DraftCandidate(0.4, 16)], 1, 1, 800, CPU_LIKE, config)[0]
    chain = choose_num_drafts([DraftCandidate(0.4, 16, 0.97)], 1, 1, 800, CPU_LIKE, config)[0]
    assert 0 < iid < chain == 16
    with pytest.raises(ValueError, match="continue_rate"):
        choose_num_drafts([DraftCandidate(0.4, 4, 1.5)], 1, 1, 800, CPU_LIKE, config)


def test_tracker_chain_follows_full_acceptance() -> None:
    """After a verify that accepted every draft, a request's drafts are rated by the rate after
    accepted drafts (high while it copies); after a rejection, its first draft by the rate of
    first drafts after rejections (low), the rest by its overall rate at most: few drafts, then more
    once a verify is accepted in full."""
    tracker = AcceptanceTracker(AcceptanceConfig(ema_weight=0.3, prior=0.5, prior_trials=1))
    for _ in range(6):  # after a rejection, three cold starts fail, then a copy run
        for accepted in (0, 0, 0, 4):
            tracker.observe("a", 4, accepted)
        tracker.observe("a", 8, 8)
        tracker.observe("a", 8, 3)
    cold_first, cold_next = tracker.chain("a")
    assert cold_first < 0.4 and cold_next <= tracker.rate("a")
    tracker.observe("a", 2, 2)
    hot_first, hot_next = tracker.chain("a")
    assert hot_first == hot_next > 0.7
    tracker.skipped("a")  # a step without a verify breaks the chain
    cold_first, cold_next = tracker.chain("a")
    assert cold_first < hot_first and cold_next <= hot_next
    cold = choose_num_drafts(
        [DraftCandidate(cold_first, 16, cold_next)], 1, 1, 800, CPU_LIKE, CostRuleConfig(16)
    )
    hot = choose_num_drafts(
        [DraftCandidate(hot_first, 16, hot_next)], 1, 1, 800, CPU_LIKE, CostRuleConfig(16)
    )
    assert cold[0] < hot[0]


def _rate_rows(candidates, ks, num_sampled, tokens, kv, model):
    """`_rate` with the step's rows and its longest row passed (the row cost and the padding
    of `StepTimeModel.step_time_s`)."""
    emitted = num_sampled - len(candidates)
    emitted += sum(_chain_tokens(c, k) for c, k in zip(candidates, ks))
    d, rows = sum(ks), num_sampled
    plain = model.step_time_s(tokens, kv, 0, rows)
    prefill = plain - model.step_time_s(min(num_sampled, tokens), kv, 0, rows)
    return emitted / (model.step_time_s(tokens + d, kv + d, d, rows, max(ks)) - prefill)


def _random_model(rng: random.Random) -> StepTimeModel:
    """A model with a row cost (H200 copy batch: ~25-60 us a row) and, on some, verify steps
    padded to widths that reach the candidates' cap (3)."""
    return StepTimeModel(
        t_host_s=rng.uniform(0, 2e-3), t_weights_s=rng.choice([0.0, rng.uniform(1e-5, 6e-3)]),
        c_token_s=rng.choice([0.0, rng.uniform(1e-7, 5e-5)]), c_kv_s=rng.uniform(0, 1e-7),
        c_draft_s=rng.uniform(0, 2e-4), t_verify_s=rng.uniform(0, 1e-3),
        c_row_s=rng.uniform(0, 1e-4), verify_widths=rng.choice([(), (3,), (1, 3), (2, 3)]),
        verify_max_rows=rng.choice([0, 8, 64]),
    )  # fmt: skip


def test_choice_with_a_row_cost_and_padded_widths_equals_exhaustive_search() -> None:
    """The rule's drafts price the sampled rows (`c_row_s`) and, where the device pads a verify
    step to a width, its rows x (1 + width) tokens: its rate is the best of all allocations
    priced by `step_time_s` with the step's rows and longest row; the pre-check's list-free
    scans answer as the rule does."""
    rng = random.Random(3)
    for _ in range(600):
        model = _random_model(rng)
        candidates = [
            DraftCandidate(rng.random(), rng.randint(0, 3), rng.choice([None, rng.random()]))
            for _ in range(3)
        ]
        num_sampled = 3 + rng.randint(0, 50)
        tokens = num_sampled + rng.choice([0, 0, rng.randint(1, 600)])  # decode-only, or a chunk
        kv, config = rng.randint(0, 20000), CostRuleConfig(3, 1.0)
        chosen = choose_num_drafts(candidates, num_sampled, tokens, kv, model, config)
        ranges = [range(c.max_draft_tokens + 1) for c in candidates]
        best = max(
            _rate_rows(candidates, ks, num_sampled, tokens, kv, model)
            for ks in itertools.product(*ranges)
        )
        got = _rate_rows(candidates, chosen, num_sampled, tokens, kv, model)
        assert got == pytest.approx(best, rel=1e-9)
        uniform = [candidates[0]] * 3
        want = choose_num_drafts(uniform, num_sampled, tokens, kv, model, config)
        got_uniform = uniform_num_drafts(candidates[0], 3, num_sampled, tokens, kv, model, config)
        assert got_uniform == ((sum(want), max(want)) if any(want) else (0, 0))
        pays = uniform_drafts_pay(candidates[0], 3, num_sampled, tokens, kv, model, config)
        assert pays == any(want)


# H200, SmolLM2-135M, copy batch 32 (benchmarks/results/2026-11-27d-cpu-spec-row-cost): a
# host-bound step whose rows cost ~45 us each and drafts ~30 us each
H200_COPY = StepTimeModel(t_host_s=1.1e-3, t_weights_s=9e-5, c_token_s=4.5e-7, c_kv_s=8e-9,
                          c_draft_s=3e-5, t_verify_s=4e-4, c_row_s=4.5e-5)  # fmt: skip


def test_the_rows_cost_makes_a_wide_step_draft_more_than_a_narrow_one() -> None:
    """A step's rows are paid with or without drafts: at batch 32 their ~1.4 ms make a draft's
    ~30 us and the verify step's 0.4 ms a smaller share of the step than the model without
    the row term charges (dropped, the rule drafts nothing at batch 32 instead of 5 a row)."""
    hot = DraftCandidate(0.9, 16, 0.9)
    rowless = dataclasses.replace(H200_COPY, c_row_s=0.0)
    config = CostRuleConfig(16)
    wide = choose_num_drafts([hot] * 32, 32, 32, 32 * 700, H200_COPY, config)
    assert wide == [5] * 32
    assert choose_num_drafts([hot] * 32, 32, 32, 32 * 700, rowless, config) == [0] * 32
    assert H200_COPY.step_time_s(32, 32 * 700) - rowless.step_time_s(32, 32 * 700) == (
        pytest.approx(32 * 4.5e-5)
    )


def test_padded_verify_steps_cost_their_rows_times_the_width() -> None:
    """Llama-3.1-8B on an H100 at batch 32: unpadded, the rule verifies 6 drafts a row (32 x 7
    tokens, at the weights' knee); where every verify row is padded to 1 + 8 tokens (one
    width, 8) the first draft already pays 32 x 9 tokens of compute, so the rule fills the
    width; with widths 2, 4, 8 it stops at 4 (32 x 5 tokens, below the knee), as 6 would be
    padded to 8."""
    model = dataclasses.replace(LLAMA_8B_H100, verify_max_rows=64)
    candidates = [DraftCandidate(0.7, 8)] * 32
    args = (candidates, 32, 32, 32 * CONTEXT)
    assert model.padded_width(32, 32 + 64, 64, longest=3) is None  # no widths: unpadded
    wide = dataclasses.replace(model, verify_widths=(8,))
    assert wide.padded_width(32, 32 + 64, 64, longest=3) == 8
    assert wide.step_time_s(96, 0, 64, 32, 3) == pytest.approx(model.step_time_s(32 * 9, 0, 64))
    narrow = dataclasses.replace(model, verify_widths=(2, 4, 8))
    assert narrow.padded_width(32, 32 + 64, 64, longest=3) == 4
    got = [choose_num_drafts(*args, m, CostRuleConfig(8)) for m in (model, wide, narrow)]
    assert max(got[0]) == 6 and got[1] == [8] * 32 and got[2] == [4] * 32
    with pytest.raises(ValueError, match="verify_widths"):
        dataclasses.replace(model, verify_widths=(4, 2)).validate()
