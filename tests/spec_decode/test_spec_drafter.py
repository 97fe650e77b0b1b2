"""The drafter's rules without a model: who may draft, the history view the proposers read, the
cost rule's pre-check that keeps drafts (and the engine's sync) off while acceptance is low,
with a probe every `probe_after` steps, and counts every sampled sequence at a large batch."""

from __future__ import annotations

from phloem.config import SpeculativeConfig
from phloem.core.request import Request
from phloem.sampling_params import SamplingParams
from phloem.spec_decode.cost_rule import DraftCandidate, StepTimeModel, choose_num_drafts
from phloem.spec_decode.drafter import RETRY_SAMPLE, Drafter, _History

# bandwidth-bound steps: a draft costs almost nothing beside the weights' pass
MODEL = StepTimeModel(t_host_s=1e-3, t_weights_s=20e-3, c_token_s=1e-5, c_kv_s=0.0)


def decoding(request_id: str, params: SamplingParams, prompt=(5, 6, 7, 5, 6)) -> Request:
    r = Request(request_id, list(prompt), params)
    r.output_token_ids = [7]
    r.num_computed_tokens = r.num_tokens - 1  # its last token is all that is left
    return r


def test_history_view_reads_prompt_and_outputs_without_copying():
    r = Request("a", [1, 2, 3], SamplingParams())
    r.output_token_ids = [4, 5]
    h = _History(r)
    assert len(h) == 5 and list(h) == [1, 2, 3, 4, 5]
    assert h[1:4] == [2, 3, 4] and h[3:] == [4, 5] and h[-1] == 5 and h[::2] == [1, 3, 5]


def test_only_rows_the_verifier_reproduces_draft():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), MODEL, 64)
    rows = [
        decoding("plain", SamplingParams(temperature=0)),
        decoding("logprobs", SamplingParams(temperature=0, logprobs=1)),
        decoding("penalty", SamplingParams(temperature=1, repetition_penalty=1.2)),
        decoding("min_tokens", SamplingParams(temperature=0, min_tokens=5)),
    ]
    prefilling = Request("prefill", [5, 6, 7, 5, 6, 7], SamplingParams(temperature=0))
    assert drafter.propose([*rows, prefilling]) > 0
    assert rows[0].draft_token_ids == [5, 6, 7][: len(rows[0].draft_token_ids)]
    assert rows[0].draft_token_ids
    assert all(not r.draft_token_ids for r in [*rows[1:], prefilling])
    assert drafter.propose(rows, blocked=True) == 0 and not rows[0].draft_token_ids


def test_low_acceptance_turns_the_pre_check_off_with_a_probe_now_and_then():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), MODEL, 64)
    running = [decoding("a", SamplingParams(temperature=0))]
    assert drafter.may_draft(running)  # the prior rate pays
    drafter.tracker.global_rate = 0.0  # drafts never accepted
    probe_after = drafter.tracker.config.probe_after
    answers = [drafter.may_draft(running) for _ in range(probe_after + 1)]
    assert answers == [False] * probe_after + [True]  # the probe at the prior rate
    assert not drafter.may_draft(running)


def test_the_pre_check_counts_every_sampled_sequence_at_a_large_batch():
    """CPU-like costs (a draft costs a token of compute beside a long step): at a batch of 32 one
    request's draft cannot lift the step's rate by `min_gain`, all 32 drafting together do, so
    the pre-check must let the rule see them all."""
    model = StepTimeModel(t_host_s=0.039, t_weights_s=0.0, c_token_s=3.2e-3, c_kv_s=1.35e-5,
                          c_draft_s=2e-5, t_verify_s=0.0)  # fmt: skip
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=16), model, 4096)
    prompt = list(range(1000))
    running = [decoding(f"r{i}", SamplingParams(temperature=0), prompt) for i in range(32)]
    drafter.tracker.global_rate = 0.5
    alone = choose_num_drafts([DraftCandidate(0.5, 16)], 32, 32, 32 * 1000, model, drafter.cost)
    together = choose_num_drafts([DraftCandidate(0.5, 16)] * 32, 32, 32, 32 * 1000, model,
                                 drafter.cost)  # fmt: skip
    assert alone == [0] and sum(together) > 0
    assert drafter.may_draft(running)


def test_a_fallen_rate_is_probed_at_a_large_batch_on_a_sample_with_back_off():
    """At a batch of 32 on CPU-like costs one request's drafts never pay, so a probe of one
    request never passed and a rate that fell stayed off for the run. The probe counts every
    sequence at the prior rate, drafts for a sample only, and waits twice as long after each
    probe that did not bring the rate back."""
    model = StepTimeModel(t_host_s=0.039, t_weights_s=0.0, c_token_s=3.2e-3, c_kv_s=1.35e-5,
                          c_draft_s=2e-5, t_verify_s=0.0)  # fmt: skip
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=16), model, 4096)
    prompt = [5, 6, 7] * 300 + [5, 6]  # with the output 7: every request has drafts to offer
    running = [decoding(f"r{i}", SamplingParams(temperature=0), prompt) for i in range(32)]
    drafter.tracker.global_rate = 0.0  # one bad verify step took it down
    probe_after = drafter.tracker.config.probe_after
    answers = [drafter.may_draft(running) for _ in range(probe_after + 1)]
    assert answers == [False] * probe_after + [True]
    assert drafter.propose(running) > 0
    assert 0 < sum(bool(r.draft_token_ids) for r in running) <= RETRY_SAMPLE
    answers = [drafter.may_draft(running) for _ in range(2 * probe_after + 1)]
    assert answers == [False] * (2 * probe_after) + [True]  # the rate stayed down: back off


def test_proposals_that_offer_nothing_turn_the_pre_check_off():
    """A batch whose histories never repeat an n-gram gets no drafts, so no acceptance is ever
    measured: the share of requests offered drafts must turn the pre-check off (each proposal
    costs the engine a sync). The first proposal asks a sample only (the offer rate starts
    unestablished), so a large batch with nothing to match never indexes every prompt."""
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), MODEL, 4096)
    running = [
        decoding(f"r{i}", SamplingParams(temperature=0), range(i, i + 50)) for i in range(64)
    ]
    answers = []
    for _ in range(12):
        answers.append(drafter.may_draft(running))
        if answers[-1]:
            assert drafter.propose(running) == 0  # nothing to match
    assert answers[0] and not any(answers[-3:])
    assert len(drafter.proposer._indexes) == RETRY_SAMPLE  # the same sample at each retry
    repeating = [decoding("a", SamplingParams(temperature=0))]
    drafter.offer_rate = 1.0
    assert drafter.may_draft(repeating) and drafter.propose(repeating) > 0
    assert drafter.offer_rate == 1.0 and drafter.may_draft(repeating)


def test_stats_leave_out_void_rows_drafts():
    """The `--json` counters: a void row (no accepted count: stacked on a row that rejected a
    draft) verified nothing, so its drafts count neither as verified nor as a verify row."""
    from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput

    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), MODEL, 64)
    sched = SchedulerOutput(
        [ScheduledSequence("a", 5, 4, True, draft_token_ids=(1, 2, 3)),
         ScheduledSequence("v", 5, 5, True, draft_token_ids=(4, 5, 6, 7))]
    )  # fmt: skip
    drafter.observe(sched, {"a": 3})
    stats = drafter.stats.as_dict()
    assert stats["num_drafts"] == 1 and stats["num_draft_tokens"] == 3
    assert stats["acceptance_rate"] == 1.0 and stats["mean_accepted_length"] == 4.0


def test_a_failed_guess_row_is_no_trial_but_breaks_the_chain():
    """A row whose guess of its pending token failed verified nothing: neither its drafts nor
    a verify count in the stats or the request's rate (counted, they read the rate low), but
    its request's next drafts are rated as first drafts after a rejection."""
    from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput

    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), MODEL, 64)
    tracker = drafter.tracker
    first = SchedulerOutput([ScheduledSequence("g", 5, 4, True, draft_token_ids=(1, 2, 3))])
    drafter.observe(first, {"g": 3})  # all accepted: the chain goes on
    rate, hot = tracker.rate("g"), tracker.chain("g")
    assert hot[0] == hot[1]
    missed = SchedulerOutput([ScheduledSequence("g", 9, 5, True, draft_token_ids=(4, 5, 6, 7))])
    drafter.observe(missed, {}, ["g"])
    stats = drafter.stats.as_dict()
    assert stats["num_drafts"] == 1 and stats["num_draft_tokens"] == 3
    assert stats["acceptance_rate"] == 1.0 and stats["num_spec_steps"] == 1
    assert tracker.rate("g") == rate  # no trial
    assert tracker.chain("g")[0] < hot[0]  # the first draft is rated after a rejection
