"""The cost rule's step time model learned online (`spec_decode/step_time.py`): the residuals of
plain and verify steps, clipping, the probes without drafts; and the drafter on a simulated
device whose step times come from a fake clock: verify steps that cost 3x a decode step with
modest acceptance turn drafting off at batch 32, cheap verify steps with high acceptance keep
it on. No wall-clock timings: every time is synthetic."""

from __future__ import annotations

import dataclasses
import random

import pytest

from phloem.config import SpeculativeConfig
from phloem.core.request import Request
from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput
from phloem.sampling_params import SamplingParams
from phloem.spec_decode.cost_rule import StepTimeModel
from phloem.spec_decode.drafter import RETRY_SAMPLE, Drafter
from phloem.spec_decode.step_time import StepShape, StepTimeConfig, StepTimeLearner

# a GPU-like prior: the weights' pass dominates, a verify step costs almost nothing extra
PRIOR = StepTimeModel(t_host_s=1e-3, t_weights_s=5e-3, c_token_s=1e-6, c_kv_s=0.0)
PLAIN = StepShape(num_sampled=32, num_tokens=32, num_kv_tokens=3200, num_drafts=0)
VERIFY = StepShape(num_sampled=32, num_tokens=96, num_kv_tokens=3200, num_drafts=64)


def test_residuals_correct_host_and_verify_times() -> None:
    learner = StepTimeLearner(PRIOR, StepTimeConfig(clip_factor=10.0, prior_samples=0))
    plain_prior = PRIOR.step_time_s(32, 3200)
    for _ in range(30):
        learner.observe(PLAIN, 0.010)
    assert learner.model.t_host_s == pytest.approx(PRIOR.t_host_s + 0.010 - plain_prior)
    assert learner.model.step_time_s(32, 3200) == pytest.approx(0.010)
    assert learner.model.t_verify_s == PRIOR.t_verify_s  # no verify step measured yet
    for _ in range(30):
        learner.observe(VERIFY, 0.030)
    assert learner.model.step_time_s(96, 3200, 64) == pytest.approx(0.030, rel=0.01)
    assert learner.model.step_time_s(32, 3200) == pytest.approx(0.010)  # plain unchanged


def test_order_of_samples_does_not_matter() -> None:
    """Verify steps measured before any plain step charge the excess to verifying; once plain
    steps come, the verify extra is what lies beyond them."""
    early = StepTimeLearner(PRIOR, StepTimeConfig(clip_factor=10.0, prior_samples=0))
    for _ in range(10):
        early.observe(VERIFY, 0.030)
    assert early.model.step_time_s(96, 3200, 64) == pytest.approx(0.030)
    assert early.model.t_host_s == PRIOR.t_host_s
    for _ in range(10):
        early.observe(PLAIN, 0.010)
    late = StepTimeLearner(
        PRIOR, StepTimeConfig(clip_factor=10.0, prior_samples=0, forget_weight=0.0)
    )
    for shape, seconds in [(PLAIN, 0.010)] * 10 + [(VERIFY, 0.030)] * 10:
        late.observe(shape, seconds)
    for learner in (early, late):
        assert learner.model.step_time_s(32, 3200) == pytest.approx(0.010)
        assert learner.model.step_time_s(96, 3200, 64) == pytest.approx(0.030, rel=0.01)


def test_one_stall_moves_the_estimate_at_most_by_the_clip() -> None:
    learner = StepTimeLearner(PRIOR)
    for _ in range(20):
        learner.observe(PLAIN, 0.010)
    before = learner.model.step_time_s(32, 3200)
    learner.observe(PLAIN, 5.0)  # a collection, another process on the core
    assert learner.model.step_time_s(32, 3200) <= before * (1 + 0.1 * 2) + 1e-12


def test_one_outlier_alone_moves_a_fresh_estimate_by_at_most_two_fifths() -> None:
    """The prior counts as 4 samples: the first verify step (a proposer indexing every prompt of
    the batch) cannot alone make verifying look 3x as costly and turn drafts off."""
    learner = StepTimeLearner(PRIOR)
    before = learner.model.step_time_s(96, 3200, 64)
    learner.observe(VERIFY, 10.0)
    assert learner.model.step_time_s(96, 3200, 64) == pytest.approx(before * 1.4)


def test_steps_with_prompt_chunks_are_not_samples() -> None:
    learner = StepTimeLearner(PRIOR)
    chunk = StepShape(num_sampled=2, num_tokens=500, num_kv_tokens=0, num_drafts=0)
    learner.observe(chunk, 1.0)
    assert learner.num_plain == 0 and learner.model == PRIOR
    rows = [ScheduledSequence("a", 10, 3, True, draft_token_ids=(4, 5)),
            ScheduledSequence("b", 7, 1, True), ScheduledSequence("c", 0, 8, False)]  # fmt: skip
    assert StepShape.of(rows) == StepShape(2, 12, 17, 2, 2) and not StepShape.of(rows).decode_only
    assert StepShape.of(rows[:2]).decode_only


def test_probes_come_after_verify_steps_and_are_bounded() -> None:
    config = StepTimeConfig(warmup_samples=1, warmup_probe_every=3, probe_every=10)
    learner = StepTimeLearner(PRIOR, config)
    answers = []
    for _ in range(3):
        answers.append(learner.probe_due())
        learner.observe(VERIFY, 0.01)
    answers += [learner.probe_due() for _ in range(4)]  # two probe steps, then none
    assert answers == [False] * 3 + [True, True, False, False]
    learner.observe(PLAIN, 0.01)  # warmed up: the long interval
    for _ in range(9):
        learner.observe(VERIFY, 0.01)
        assert not learner.probe_due()
    learner.observe(VERIFY, 0.01)
    assert learner.probe_due()


def test_bad_settings_raise_naming_the_field() -> None:
    for field, value in [("ema_weight", 0.0), ("clip_factor", 1.0), ("prior_samples", -1), ("probe_every", 0),
                         ("warmup_samples", -1), ("forget_weight", 2.0),
                         ("slope_ema_weight", 0.0)]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            StepTimeConfig(**{field: value}).validate()
    with pytest.raises(ValueError, match="seconds"):
        StepTimeLearner(PRIOR).observe(PLAIN, -1.0)


def _verify_shape(num_drafts: int) -> StepShape:
    return StepShape(num_sampled=32, num_tokens=32 + num_drafts, num_kv_tokens=3200,
                     num_drafts=num_drafts)  # fmt: skip


def _learn_verify_costs(cost, config: StepTimeConfig, draft_counts=(8, 16, 32, 64)):
    """A learner fed plain steps at the prior's time and verify steps of varied drafts whose
    time is cost(drafts) [s], alternately."""
    learner = StepTimeLearner(PRIOR, config)
    for i in range(200):
        learner.observe(PLAIN, PRIOR.step_time_s(32, 3200))
        d = draft_counts[i % len(draft_counts)]
        learner.observe(_verify_shape(d), cost(d))
    return learner


def test_a_verify_cost_that_grows_per_draft_is_learned_per_draft() -> None:
    """On the CPU a verify step's excess over the prior grows with its drafts (~6 ms a draft):
    with the slope, the model predicts few and many drafts alike; charged as a fixed cost (the
    slope off), a step of 8 drafts would look about twice as costly as it is."""

    def cost(d: int) -> float:
        return PRIOR.step_time_s(32 + d, 3200, d) + 0.005 + 0.006 * d

    config = StepTimeConfig(clip_factor=100.0)
    learner = _learn_verify_costs(cost, config)
    assert learner.draft_slope_s == pytest.approx(0.006, rel=0.02)
    for d in (8, 20, 64):
        assert learner.model.step_time_s(32 + d, 3200, d) == pytest.approx(cost(d), rel=0.03)
    fixed = _learn_verify_costs(cost, StepTimeConfig(clip_factor=100.0, slope_min_var=1e9))
    assert fixed.draft_slope_s == 0.0
    assert fixed.model.step_time_s(40, 3200, 8) > 1.5 * cost(8)


def test_a_verify_cost_independent_of_the_drafts_cancels_the_per_draft_charge() -> None:
    """A verify graph pads every row to 1 + k tokens: its cost hardly moves with the drafts, so
    the learned slope cancels the prior's per-draft charge."""

    def cost(d: int) -> float:
        return PRIOR.step_time_s(96, 3200, 0) + 0.004

    learner = _learn_verify_costs(cost, StepTimeConfig(clip_factor=100.0))
    assert learner.model.c_draft_s == pytest.approx(0.0, abs=1e-9)
    for d in (8, 64):
        assert learner.model.step_time_s(96, 3200, d) == pytest.approx(cost(d), rel=0.01)


def test_a_tail_of_few_row_steps_keeps_the_per_draft_cost_of_the_batch() -> None:
    """H200 copy batch 32 (benchmarks/results/2026-11-27c-cpu-spec-learner): verify steps of 32
    rows and 64-256 drafts cost ~32 us a draft, then the batch's tail verifies ~14 drafts a step
    whose cost varies with its rows, not with its drafts. With the slope fitted over the last ~10
    samples the tail's alone set it (~0: c_draft fell to ~3 us); the long memory keeps it."""
    learner = StepTimeLearner(PRIOR, StepTimeConfig(clip_factor=100.0))
    for i in range(60):
        d = 64 * (1 + i % 4)
        learner.observe(_verify_shape(d), PRIOR.step_time_s(32 + d, 3200, d) + 32e-6 * d)
    for i in range(100):
        d = 12 + 4 * (i % 2)
        shape = StepShape(num_sampled=2, num_tokens=2 + d, num_kv_tokens=200, num_drafts=d)
        learner.observe(shape, PRIOR.step_time_s(2 + 14, 200, 14) + 32e-6 * 14)
    assert learner.model.c_draft_s == pytest.approx(PRIOR.c_draft_s + 32e-6, rel=0.15)


def test_the_same_drafts_every_step_keep_the_whole_excess_fixed() -> None:
    learner = _learn_verify_costs(lambda d: 0.03, StepTimeConfig(), draft_counts=(64,))
    assert learner.draft_slope_s == 0.0 and learner.model.c_draft_s == PRIOR.c_draft_s
    few = StepTimeLearner(PRIOR, StepTimeConfig(slope_min_samples=50))
    for i in range(20):  # spread, but fewer samples than slope_min_samples
        few.observe(_verify_shape(8 + 8 * (i % 2)), 0.02 + 0.001 * (i % 2))
    assert few.draft_slope_s == 0.0
    for field, value in [("slope_min_samples", 1), ("slope_min_var", 0.0)]:
        with pytest.raises(ValueError, match=field):
            StepTimeConfig(**{field: value}).validate()


def decoding(request_id: str) -> Request:
    """A request that decodes next step, whose history repeats (n-gram drafts always exist)."""
    r = Request(request_id, [5, 6, 7, 8] * 20, SamplingParams(temperature=0))
    r.output_token_ids = [5]
    r.num_computed_tokens = r.num_tokens - 1
    return r


def simulate(plain_s: float, verify_s: float, acceptance: float, num_steps: int = 150):
    """The drafter at batch 32 (k = 4) on a device whose decode steps take `plain_s` and verify
    steps `verify_s` [s], each draft accepted with probability `acceptance` (until the first
    rejection). Returns the drafts verified per step and the drafter."""
    now = [0.0]
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), PRIOR, 4096,
                      clock=lambda: now[0])  # fmt: skip
    running = [decoding(f"r{i}") for i in range(32)]
    rng = random.Random(0)
    drafts_per_step = []
    for _ in range(num_steps):
        if drafter.may_draft(running):
            drafter.propose(running)
        else:
            for r in running:
                r.draft_token_ids = []
        rows, accepted = [], {}
        for r in running:
            drafts = tuple(r.draft_token_ids)
            rows.append(ScheduledSequence(r.request_id, r.num_computed_tokens, 1 + len(drafts),
                                          True, draft_token_ids=drafts))  # fmt: skip
            n = 0
            while n < len(drafts) and rng.random() < acceptance:
                n += 1
            accepted[r.request_id] = n
        sched = SchedulerOutput(scheduled=rows)
        num_drafts = sum(len(s.draft_token_ids) for s in rows)
        drafter.launched(sched)
        collect_start = now[0]
        now[0] += verify_s if num_drafts else plain_s
        if num_drafts:
            drafter.observe(sched, accepted)
        drafter.step_done(sched, collect_start)
        drafts_per_step.append(num_drafts)
    return drafts_per_step, drafter


def test_costly_verify_steps_with_modest_acceptance_turn_drafting_off_at_batch_32() -> None:
    drafts, drafter = simulate(plain_s=0.010, verify_s=0.030, acceptance=0.5)
    assert sum(drafts[:10]) > 0  # the prior model drafts
    # the measured one does not, but for the acceptance probe: at most one step in 100 (its
    # wait doubles up to 128 steps), a sample of RETRY_SAMPLE requests drafting
    probes = [d for d in drafts[-100:] if d]
    assert len(probes) <= 1 and all(d <= RETRY_SAMPLE * 4 for d in probes)
    assert drafter.timer.num_plain > 50


def test_cheap_verify_steps_with_high_acceptance_keep_drafting_at_batch_32() -> None:
    drafts, drafter = simulate(plain_s=0.010, verify_s=0.011, acceptance=0.9)
    drafting = sum(1 for d in drafts[-100:] if d)
    assert drafting >= 90  # probes without drafts: at most 2 per 64 verify steps
    assert drafter.timer.num_plain >= 2  # the probes measured plain steps


def test_a_step_costs_its_host_work_its_wait_and_its_update() -> None:
    """Async scheduling: step() begins, collects the step before (its cost ends there), does the
    host work of the next step up to its launch; that step's wait and update come in the next
    call. Device time that overlapped the host work is no step's."""
    now = [0.0]
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), PRIOR, 4096,
                      timer_config=StepTimeConfig(clip_factor=100.0, prior_samples=0), clock=lambda: now[0])  # fmt: skip
    first = SchedulerOutput(scheduled=[ScheduledSequence("a", 10, 1, True)])
    second = SchedulerOutput(scheduled=[ScheduledSequence("a", 11, 1, True)])
    drafter.may_draft([decoding("a")])  # step() begins at 0
    now[0] = 0.002
    drafter.launched(first)  # 2 ms of host work
    now[0] = 0.010  # the caller's time between step() calls: no step's
    drafter.may_draft([decoding("a")])
    drafter.step_done(first, collect_start=0.010)  # no wait: it finished while the host worked
    assert drafter.timer.num_plain == 1
    now[0] = 0.013
    drafter.launched(second)  # 3 ms of host work after the collection
    now[0] = 0.020
    drafter.step_done(second, collect_start=0.014)  # 6 ms of wait and update
    learner = StepTimeLearner(PRIOR, StepTimeConfig(clip_factor=100.0, prior_samples=0))
    learner.observe(StepShape(1, 1, 10, 0), 0.002)
    learner.observe(StepShape(1, 1, 11, 0), 0.009)
    assert drafter.timer.plain_residual_s == pytest.approx(learner.plain_residual_s)
    assert drafter.timer.num_plain == 2


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    from tests.engine.tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_steps", 5)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_engine_reports_its_steps_and_greedy_outputs_stay_equal(tiny_llama, async_scheduling):
    """With the cost rule on, the engine tells the drafter every collected step (decode-only
    ones become samples, whatever the wall-clock times were) and outputs equal speculation off."""
    from phloem import LLM
    from tests.spec_decode.test_spec_engine import GREEDY, prompts

    outputs, samples = [], []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        llm = LLM(str(tiny_llama), speculative_config=spec, block_size=4,
                  max_num_batched_tokens=32, async_scheduling=async_scheduling)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
        outputs.append([[c.token_ids for c in o.outputs] for o in outs])
        drafter = llm.llm_engine.drafter
        if drafter is not None:
            samples.append(drafter.timer.num_plain + drafter.timer.num_verify)
            assert not drafter._host_s  # every launched step was collected
        llm.close()
    assert outputs[0] == outputs[1]
    assert samples[0] >= 10  # 30 tokens a request: most steps decode only


def _row_cost(rows: int, drafts: int) -> float:
    """A device whose steps cost 0.5 ms + 40 us a row, verify steps 0.3 ms + 30 us a draft more
    (H200 copy batch 32: ~25-60 us a row, ~17-38 us a draft, benchmarks/results/
    2026-11-27d-cpu-spec-row-cost), over the prior's time."""
    prior = PRIOR.step_time_s(rows + drafts, 100 * rows, drafts)
    return prior + 5e-4 + 40e-6 * rows + ((3e-4 + 30e-6 * drafts) if drafts else 0.0)


def _row_shape(rows: int, drafts: int) -> StepShape:
    return StepShape(num_sampled=rows, num_tokens=rows + drafts, num_kv_tokens=100 * rows,
                     num_drafts=drafts)  # fmt: skip


def _learn_rows(config: StepTimeConfig, collinear: bool = False) -> StepTimeLearner:
    """A learner fed steps of 2-32 rows (a batch and its tail), plain and verify alternately,
    then 30 steps of 32 rows only; drafts 2-5 a row (4 a row where `collinear`)."""
    learner = StepTimeLearner(PRIOR, config)
    rng = random.Random(0)
    steps = [rng.choice([2, 4, 8, 16, 24, 32]) for _ in range(150)] + [32] * 30
    for i, rows in enumerate(steps):
        drafts = 0 if i % 2 else rows * (4 if collinear else rng.randint(2, 5))
        learner.observe(_row_shape(rows, drafts), _row_cost(rows, drafts))
    return learner


def test_a_per_row_cost_is_learned_and_predicts_the_tail() -> None:
    """The rows' cost is fitted with the drafts' (least squares over plain and verify steps):
    after a run of 32-row steps the model still predicts a 2-row step of the tail; without
    the row term the plain residual holds 32 rows' cost and a 2-row step is over-predicted by
    ~30 x 40 us."""
    config = StepTimeConfig(clip_factor=100.0)
    for collinear in (False, True):  # drafts proportional to rows: those from plain steps
        learner = _learn_rows(config, collinear)
        assert learner.model.c_row_s == pytest.approx(40e-6, rel=0.05)
        assert learner.model.c_draft_s == pytest.approx(PRIOR.c_draft_s + 30e-6, rel=0.05)
        for rows, drafts in [(2, 0), (2, 8), (32, 0), (32, 128)]:
            predicted = learner.model.step_time_s(rows + drafts, 100 * rows, drafts)
            assert predicted == pytest.approx(_row_cost(rows, drafts), rel=0.03)
    # collinear without plain steps to tell them apart: every plain step of 32 rows, 4 drafts
    # a verify row; the drafts' slope carries the rows' cost (30 + 40 / 4 us), rows get none
    learner = StepTimeLearner(PRIOR, config)
    for i in range(200):
        rows = 32 if i % 2 else 2 + 6 * (i % 6)
        learner.observe(
            _row_shape(rows, 4 * rows * (i % 2 == 0)), _row_cost(rows, 4 * rows * (i % 2 == 0))
        )
    assert learner.row_slope_s == 0.0
    assert learner.draft_slope_s == pytest.approx(40e-6, rel=0.01)
    rowless = _learn_rows(StepTimeConfig(clip_factor=100.0, row_min_var=float("inf")))
    assert rowless.model.c_row_s == 0.0
    assert rowless.model.step_time_s(2, 200) > _row_cost(2, 0) + 25 * 40e-6
    for field, value in [("row_min_var", 0.0), ("max_row_draft_r2", 1.0)]:
        with pytest.raises(ValueError, match=field):
            StepTimeConfig(**{field: value}).validate()


def test_a_padded_prior_charges_the_width_the_step_ran() -> None:
    """Verify graphs of widths 4 and 8: the prior's time of a verify step is that of its rows
    x (1 + the narrowest width >= its longest row), which `StepShape.of` gives; the learner's
    residual is taken against it."""
    padded = dataclasses.replace(PRIOR, t_weights_s=0.0, verify_widths=(4, 8), verify_max_rows=64)
    rows = [ScheduledSequence("a", 10, 4, True, draft_token_ids=(4, 5, 6)),
            ScheduledSequence("b", 7, 2, True, draft_token_ids=(9,))]  # fmt: skip
    shape = StepShape.of(rows)
    assert shape.longest_drafts == 3
    args = (shape.num_tokens, shape.num_kv_tokens, shape.num_drafts, 2)
    assert padded.step_time_s(*args, 3) == pytest.approx(padded.step_time_s(10, 17, 4, 2))
    assert padded.step_time_s(*args, 5) == pytest.approx(padded.step_time_s(18, 17, 4, 2))
    learner = StepTimeLearner(padded, StepTimeConfig(prior_samples=0))
    learner.observe(shape, padded.step_time_s(*args, 3) + 1e-3)
    assert learner.verify_residual_s == pytest.approx(1e-3)
