"""The drafter's host cost where drafts do not pay (issue 20, results/2026-11-26f-cpu-spec-overhead):
the n-gram index's bulk extend (a prompt at once) answers as the per-token one does, the
engine's counters of syncs for drafting and proposals stay consistent, and empty proposals back
off (a pause in matching costs a few steps, a batch with nothing to match rarely syncs)."""

from __future__ import annotations

import random

from phloem import SamplingParams
from phloem.config import SpeculativeConfig
from phloem.spec_decode.cost_rule import (
    CostRuleConfig,
    DraftCandidate,
    StepTimeModel,
    choose_num_drafts,
    uniform_drafts_pay,
    uniform_num_drafts,
)
from phloem.spec_decode.drafter import RETRY_MAX_STEPS, RETRY_SAMPLE, Drafter
from phloem.spec_decode.ngram_proposer import NgramIndex, NgramProposer, brute_force_lookup
from tests.spec_decode.test_spec_drafter import MODEL, decoding
from tests.spec_decode.test_spec_engine import prompts, run, tiny_llama  # noqa: F401


def test_bulk_and_per_token_extends_agree_with_the_oracle():
    rng = random.Random(3)
    for _ in range(200):
        history = [rng.randrange(4) for _ in range(rng.randrange(1, 120))]
        index, i = NgramIndex(2, 5), 0
        while i < len(history):
            j = i + rng.choice((1, 2, 15, 16, 17, 40))  # both sides of the bulk threshold
            index.extend(history[i:j])
            i = min(j, len(history))
            seen = history[:i]
            assert index.token_ids == seen
            for k in (1, 4):
                assert index.lookup(k) == brute_force_lookup(seen, 2, 5, k)


def test_no_sync_for_drafting_without_a_proposal(tiny_llama):  # noqa: F811
    """A large batch whose drafts cannot pay: no drafts verified, and every step the engine
    collected early for drafting was followed by a proposal (no sync without one)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = prompts(2, 48)
    want, _ = run(tiny_llama, None, params, batch)
    got, stats, counters = _run_with_counters(tiny_llama, spec, params, batch)
    assert got == want
    assert stats.num_draft_tokens == 0
    assert counters["num_syncs"] <= counters["num_proposals"]
    assert counters["may_draft_s"] >= 0 and counters["propose_s"] >= 0


def _run_with_counters(path, spec, params, batch):
    from phloem import LLM

    llm = LLM(str(path), speculative_config=spec, block_size=4, max_num_batched_tokens=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    drafter = llm.llm_engine.drafter
    result = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    llm.close()
    return result, drafter.stats, drafter.counters()


def test_a_pause_in_matching_costs_a_few_steps_of_drafting_not_probe_after():
    """At batch 1 one empty proposal (a paraphrase) used to round the offered share to no
    sequence, and proposing waited `probe_after` steps; now it is retried after 2^(empty
    proposals in a row) steps."""
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), MODEL, 64)
    running = [decoding("a", SamplingParams(temperature=0), range(40))]  # nothing repeats
    assert drafter.may_draft(running) and drafter.propose(running) == 0
    assert [drafter.may_draft(running) for _ in range(2)] == [False, False]  # 2^1 steps
    assert drafter.may_draft(running) and drafter.propose(running) == 0
    answers = [drafter.may_draft(running) for _ in range(4)]
    assert answers == [False] * 4  # 2^2 steps since the last proposal: due next
    assert drafter.may_draft(running)


def test_a_batch_with_nothing_to_match_proposes_rarely():
    """Retries of the offer rate back off to one proposal (and one sync) per
    `RETRY_MAX_STEPS` steps; the acceptance probe (one request at the prior rate, which pays
    on this bandwidth-bound model) adds one per `probe_after`."""
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), MODEL, 4096)
    running = [
        decoding(f"r{i}", SamplingParams(temperature=0), range(i, i + 50)) for i in range(32)
    ]
    num_proposals, steps = 0, 400
    for _ in range(steps):
        if drafter.may_draft(running):
            assert drafter.propose(running) == 0
            num_proposals += 1
    assert drafter.counters()["num_proposals"] == num_proposals
    probe_after = drafter.tracker.config.probe_after
    assert 3 <= num_proposals <= steps // RETRY_MAX_STEPS + steps // probe_after + 9


def test_a_retry_at_a_large_batch_proposes_for_a_sample():
    """A retry of the offer rate asks `RETRY_SAMPLE` requests, the same ones each time (at a
    large batch indexing every prompt for it would cost more than the retry can find)."""
    asked: list[list[str]] = []

    class Recording(NgramProposer):
        def propose(self, requests):
            asked.append([r.request_id for r in requests])
            return super().propose(requests)

    config = SpeculativeConfig(num_speculative_tokens=3)
    drafter = Drafter(config, MODEL, 4096, proposer=Recording(config.proposer_config()))
    running = [
        decoding(f"r{i}", SamplingParams(temperature=0), range(i, i + 50)) for i in range(32)
    ]
    for _ in range(300):
        if drafter.may_draft(running):
            assert drafter.propose(running) == 0
    assert len(asked[0]) == RETRY_SAMPLE  # the offer rate starts unestablished: a sample
    sizes = [len(ids) for ids in asked]
    assert len(sizes) >= 4 and max(sizes[-3:]) <= RETRY_SAMPLE
    assert asked[-1] == asked[-2]  # the same sample: its indexes only catch up


def test_uniform_drafts_pay_answers_as_the_rule_does():
    """The pre-check's list-free form of `any(choose_num_drafts([c] * n, ...))`."""
    rng = random.Random(1)
    answers = set()
    for _ in range(3000):
        model = StepTimeModel(
            t_host_s=rng.uniform(0, 5e-3),
            t_weights_s=rng.choice([0.0, rng.uniform(0, 20e-3)]),
            c_token_s=rng.uniform(0, 1e-4),
            c_kv_s=rng.uniform(0, 1e-8),
            c_draft_s=rng.uniform(0, 1e-4),
            t_verify_s=rng.uniform(0, 1e-3),
        )
        rate = rng.choice([0.0, 1.0, rng.random()])
        candidate = DraftCandidate(rate, rng.randint(0, 20), rng.choice([None, 1.0, rng.random()]))
        n = rng.randint(0, 40)
        num_sampled = max(n + rng.randint(0, 40), 1)
        tokens, kv = num_sampled + rng.choice([0, rng.randint(0, 3000)]), rng.randint(0, 10**5)
        cost = CostRuleConfig(rng.randint(1, 16), rng.choice([1.0, 1.02, 1.2]))
        want = n > 0 and any(
            choose_num_drafts([candidate] * n, num_sampled, tokens, kv, model, cost)
        )
        got = uniform_drafts_pay(candidate, n, num_sampled, tokens, kv, model, cost)
        assert got == want
        answers.add(got)
    assert answers == {True, False}


def test_uniform_num_drafts_counts_as_the_rule_does():
    """The probe's (sum, max) of `choose_num_drafts([c] * n, ...)`, ties included: where a
    round's gain is a fixed point (c = 1, a = 1 i.i.d., or a gain that reached 0) the heap hands
    candidate 0 the rest of its cap before candidate 1 gets any."""
    rng = random.Random(2)
    for _ in range(1000):
        model = StepTimeModel(
            t_host_s=rng.uniform(0, 5e-3),
            t_weights_s=rng.choice([0.0, rng.uniform(0, 20e-3)]),
            c_token_s=rng.uniform(0, 1e-4),
            c_kv_s=rng.uniform(0, 1e-8),
            c_draft_s=rng.choice([0.0, rng.uniform(0, 1e-4)]),
            t_verify_s=rng.choice([0.0, rng.uniform(0, 1e-3)]),
        )
        rate = rng.choice([1.0, rng.random()])
        candidate = DraftCandidate(rate, rng.randint(1, 20), rng.choice([None, 1.0, 0.0, 1e-200]))
        n = rng.randint(1, 40)
        num_sampled = n + rng.randint(0, 40)
        tokens, kv = num_sampled + rng.choice([0, rng.randint(0, 3000)]), rng.randint(0, 10**5)
        cost = CostRuleConfig(rng.randint(1, 16), rng.choice([1.0, 1.02]))
        chosen = choose_num_drafts([candidate] * n, num_sampled, tokens, kv, model, cost)
        got = uniform_num_drafts(candidate, n, num_sampled, tokens, kv, model, cost)
        assert got == (sum(chosen), max(chosen))
