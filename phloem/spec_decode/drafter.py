"""The engine's side of speculative decoding: before each step, drafts for the running requests
that decode (`Request.draft_token_ids`, which `Scheduler.schedule` takes), trimmed by the cost
rule; after it, the acceptance estimates and the counters.

Which requests draft: one that decodes this step (its last token known on the host, or
pending in the step in flight: then the proposal runs one step ahead, `ahead.py`) and whose
sampling the verifier reproduces exactly: no grammar, no log-probs, no
penalties, `min_tokens` reached. While a constrained request runs, nobody drafts (a step samples
one way: under the grammar bitmask, or through the verifier). Everything else decodes plainly.

The cost rule's step time model (`step_time.step_time_model`): on CUDA the Llama-3.1-8B-on-H100
constants (`LLAMA_8B_H100`) scaled by the model's parameters and KV bytes; on the CPU the
constants fitted to the embedded model's steps (`benchmarks/spec_decode_steps.py --fit`,
`benchmarks/results/2026-11-26d-cpu-spec-decode/`) scaled the same way: the prior, which
`step_time.StepTimeLearner` corrects by the running device's measured step times (the engine
reports each step to `launched` and `step_done`; the module docstring of `step_time.py` gives the
rule, its EMA weights and its probes without drafts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phloem.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from phloem.core.request import Request, token_slice
from phloem.core.scheduler_output import SchedulerOutput
from phloem.spec_decode import ahead
from phloem.spec_decode.acceptance import AcceptanceTracker
from phloem.spec_decode.cost_rule import (
    CostRuleConfig,
    DraftCandidate,
    StepTimeModel,
    choose_num_drafts,
    uniform_drafts_pay,
    uniform_num_drafts,
)
from phloem.spec_decode.ngram_proposer import NgramProposer
from phloem.spec_decode.proposer import DraftRequest, Proposer
from phloem.spec_decode.step_time import (
    StepShape,
    StepTimeConfig,
    StepTimeLearner,
    step_time_model,
)
from phloem.spec_decode.suffix_proposer import SuffixProposer

# Weight of a proposal's outcome in `Drafter.offer_rate` (an exponential moving average): a few
# proposals in a row that offer nothing turn the pre-check off (~log2 of the batch), one does not.
OFFER_RATE_WEIGHT = 0.5
# Requests a retry of the offer rate proposes for (`Drafter._retry_due`): the first eligible
# ones in the batch's order, so that a retry at a large batch indexes a few histories (the
# same ones each time, whose indexes then only catch up), not every prompt
RETRY_SAMPLE = 8
# The longest wait between retries of the offer rate [steps]: a retry costs about one step (its
# sync and its proposal), so a batch with nothing to match loses < 1 % to them
RETRY_MAX_STEPS = 128

if TYPE_CHECKING:
    from phloem.spec_decode.draft_model import DraftModelProposer


@dataclass
class SpecDecodeStats:
    """Counters since the engine started (vLLM's `spec_decode_*` names).

    Only drafts that were verified count: not a void row's (stacked on a row that rejected
    a draft), nor those of a row whose guess of its pending token failed (`ahead.py`).

    Attributes:
        num_drafts: verify rows (a request verifying drafts in one step) [rows].
        num_draft_tokens: drafts verified [tokens].
        num_accepted_tokens: drafts accepted [tokens].
        num_spec_steps: steps that verified any drafts [steps].
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row emitted on average: accepted drafts + 1 (0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_spec_steps": self.num_spec_steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


class _History(Sequence):
    """A request's prompt + outputs as one read-only sequence, without concatenating them."""

    def __init__(self, request: Request) -> None:
        self.prompt, self.output = request.prompt_token_ids, request.output_token_ids
        self.length = len(self.prompt) + len(self.output)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1:
                return list(self)[index]
            return token_slice(self.prompt, self.output, start, max(start, stop))
        if index < 0:
            index += self.length
        n = len(self.prompt)
        return self.prompt[index] if index < n else self.output[index - n]


class Drafter:
    """Proposes, trims and accounts for drafts (see the module docstring).

    Args:
        config: the user's speculative decoding settings.
        time_model: the cost rule's prior step time model (corrected online: `timer`).
        max_num_batched_tokens: the scheduler's step budget [tokens].
        proposer: the proposer, built by the caller (a draft model: `draft_model.py`); None
            builds the n-gram or suffix proposer of `config`.
        timer_config: settings of the online step time correction; None: the defaults.
        clock: the step timer's clock [s] (tests pass a fake one).
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        time_model: StepTimeModel,
        max_num_batched_tokens: int,
        proposer: Proposer | None = None,
        timer_config: StepTimeConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        if proposer is None:
            if config.method not in ("ngram", "suffix"):
                raise ValueError(f"speculative_config.method {config.method!r} needs a proposer")
            proposer_config = config.proposer_config()
            proposer = (
                NgramProposer(proposer_config)
                if config.method == "ngram"
                else SuffixProposer(proposer_config)
            )
        self.proposer = proposer
        self.tracker = AcceptanceTracker()
        self.cost = CostRuleConfig(max_draft_tokens=config.num_speculative_tokens)
        self.timer = StepTimeLearner(time_model, timer_config)
        self._clock = clock
        self._call_start = self._collect_end = 0.0  # this step() call began; a collection ended
        self._host_s: dict[int, float] = {}  # id(launched SchedulerOutput) -> its host work [s]
        self.budget = max_num_batched_tokens
        self.stats = SpecDecodeStats()
        self._steps_off = 0  # consecutive steps `_may_pay` said no
        # acceptance probes since the pre-check last paid on its own: each doubles the wait for
        # the next (`_probe_due`), so a batch whose drafts stay rejected is probed rarely
        self._probe_streak = 0
        self._probe_drafts = 0  # > 0: the next proposal is a probe's, this many drafts a request
        # the share of eligible requests the proposer offered drafts for (moving average): the
        # pre-check counts only that share as drafting, so a batch whose histories never match
        # (random prompts) stops proposing, and stops the sync each proposal costs. It starts
        # at 0, so the first proposal is a retry's (`_retry_due`, one step in): a sample of
        # `RETRY_SAMPLE` requests, whose share offered drafts then sets it (the whole batch is
        # asked next where the sample was offered drafts).
        # Starting at 1 proposed for every request until the rate fell (~4 proposals): each
        # indexes every prompt it has not seen, ~2.6 ms per 2,200-token prompt (n-gram), a
        # ~1 s pause per proposal at batchllm's 1,600 requests where nothing ever matches
        # (results/2026-11-26h-cpu-spec-gpu-gaps)
        self.offer_rate = 0.0
        # proposals in a row that offered nothing, and steps since the last proposal: where
        # the offer rate alone holds proposing back, it is retried after 2^streak steps (at most
        # `RETRY_MAX_STEPS`), so a pause in matching (a paraphrase, a preamble) costs a few
        # steps of drafting, not `probe_after`, and a batch with nothing to match syncs rarely
        self._empty_streak, self._since_proposal = 0, 1
        self._retrying = False  # the pre-check said yes on a retry: propose for a sample
        # host cost counters (`counters`): steps whose in-flight step the engine collected so
        # that drafts could be proposed, proposals, and the host time of both calls [s]
        self.num_syncs = self.num_proposals = 0
        self.may_draft_s = self.propose_s = 0.0

    def propose(
        self,
        running: Sequence[Request],
        blocked: bool = False,
        flight: SchedulerOutput | None = None,
    ) -> int:
        """Set `draft_token_ids` (and `draft_guess`) of each running request for the next
        `schedule()` (cleared where it gets none; the engine calls it when `may_draft` said
        yes); `blocked`: nobody drafts; `flight`: the step in flight, whose tokens are pending
        (its requests' proposals run one step ahead, `ahead.py`; never for a costly proposer).
        Returns the drafts handed out."""
        start = time.perf_counter()
        handed = self._propose(running, blocked, flight)
        self.num_proposals += 1
        self.propose_s += time.perf_counter() - start
        return handed

    def _propose(
        self, running: Sequence[Request], blocked: bool, flight: SchedulerOutput | None
    ) -> int:
        rows = ahead.rows_in_flight(None if self.proposer.costly else flight)
        eligible, leads = [], []
        for request in running:
            request.draft_token_ids, request.draft_guess = [], -1
            if not blocked and _can_draft(request):
                num_lead = ahead.lead(request, rows)
                if num_lead >= 0:
                    eligible.append(request)
                    leads.append(num_lead)
        if self._retrying:  # the same requests while they run: their indexes only catch up
            eligible, leads = eligible[:RETRY_SAMPLE], leads[:RETRY_SAMPLE]
        self._retrying = False
        probe, self._probe_drafts = self._probe_drafts, 0
        if not eligible:
            return 0
        step = _step_shape(running, self.budget)
        rule = self.config.use_cost_rule and not probe  # a probe's sample drafts regardless
        budgets = [probe or self.config.num_speculative_tokens] * len(eligible)
        if rule and self.proposer.costly:  # ask only for the drafts the rule would verify
            budgets = self._choose(list(zip(eligible, budgets)), step)
            for request, budget in zip(eligible, budgets):
                if not budget:
                    self.tracker.skipped(request.request_id)
        proposals = self.proposer.propose(
            [
                DraftRequest(
                    r.request_id, _History(r), r.num_prompt_tokens, n + budget if budget else 0, n
                )
                for r, n, budget in zip(eligible, leads, budgets)
            ]
        )
        guessed = [
            ahead.split(d, n, rows.get(r.request_id)) for r, n, d in zip(eligible, leads, proposals)
        ]
        offered = [(r, g, d) for r, (g, d) in zip(eligible, guessed) if d]
        asked = sum(1 for budget in budgets if budget)  # (a costly proposer: those the rule chose)
        if asked:  # the first proposal's share sets the rate, later ones move it
            weight = OFFER_RATE_WEIGHT if self.num_proposals else 1.0
            self.offer_rate += weight * (len(offered) / asked - self.offer_rate)
            self._empty_streak = 0 if offered else self._empty_streak + 1
        self._since_proposal = 0
        chosen = (
            self._choose([(r, len(d)) for r, _, d in offered], step)
            if rule
            else [len(d) for _, _, d in offered]
        )
        handed = 0
        for (request, guess, drafts), num in zip(offered, chosen):
            if num:
                request.draft_token_ids, request.draft_guess = drafts[:num], guess
                handed += num
            else:
                self.tracker.skipped(request.request_id)
        return handed

    def counters(self) -> dict[str, float]:
        """The host cost counters since the engine started: `num_syncs` (steps whose step in
        flight was collected before scheduling so that the drafter could propose: async
        scheduling's overlap lost), `num_proposals` (`propose` calls), `may_draft_s` and
        `propose_s` (host time in those calls [s])."""
        return {
            "num_syncs": self.num_syncs,
            "num_proposals": self.num_proposals,
            "may_draft_s": self.may_draft_s,
            "propose_s": self.propose_s,
        }

    @property
    def time_model(self) -> StepTimeModel:
        """The cost rule's step time model: the prior corrected by the measured steps."""
        return self.timer.model

    def _choose(self, offered: list[tuple[Request, int]], step: tuple[int, int, int]) -> list[int]:
        """The cost rule's drafts per (request, drafts available) for a step of shape `step`."""
        chains = [self.tracker.chain(r.request_id) for r, _ in offered]
        candidates = [DraftCandidate(a, n, c) for (a, c), (_, n) in zip(chains, offered)]
        num_sampled = max(step[0], len(candidates))
        return choose_num_drafts(candidates, num_sampled, *step[1:], self.time_model, self.cost)

    def may_draft(self, running: Sequence[Request]) -> bool:
        """Whether the next step may verify drafts at all (the cost rule's pre-check over the
        step's shape, `_may_pay`; no while the step time model probes a step without drafts,
        `StepTimeLearner.probe_due`); reads only counts, so it runs before the step in flight is
        collected (async scheduling keeps its overlap while it says no)."""
        self._call_start = self._clock()  # the engine's step() begins here (`launched`)
        if not running:
            return False
        if not self.config.use_cost_rule:
            return True
        start = time.perf_counter()
        may = not self.timer.probe_due() and self._may_pay(_step_shape(running, self.budget))
        self.may_draft_s += time.perf_counter() - start
        return may

    def _may_pay(self, step: tuple[int, int, int]) -> bool:
        """Whether the rule would hand out any draft if every sequence the step samples drafted
        at the proposer's global acceptance rate: else nothing is proposed this step. Every
        sequence, not one: the rule asks the whole step's rate to beat no drafts by `min_gain`,
        and at a large batch one request's drafts cannot lift it that much where all of them
        together would. The rule's loop stops as soon as its ratio falls, so where drafts do
        not pay this costs a few iterations. Once it has said no for `probe_after` steps in a
        row (doubled per probe since it last paid on its own, at most `RETRY_MAX_STEPS`), every
        sequence is tried at the prior rate, so a rate that fell once (and stopped being
        measured) can recover at any batch size; the proposal that follows drafts for a sample
        of `RETRY_SAMPLE` requests only (`_retrying`), each as many drafts as the rule gives a
        request when all draft at the prior rate, whatever the rule says of the sample alone
        (`_probe_drafts`): exploring never drafts a whole large batch, and the sample's
        verified drafts move the rate. (A probe of one request, as before,
        never passed at a batch of 32: one bad verify step turned drafting off for the run.)
        Only the share of sequences the proposer has been offering drafts for
        (`offer_rate`) counts as drafting: drafts never verified never lower the acceptance
        rate, so without it a batch with nothing to match would propose (and sync) forever."""
        config = self.tracker.config
        num_sampled = max(step[0], 1)
        model, cost, k = self.time_model, self.cost, self.config.num_speculative_tokens
        num_offered = int(num_sampled * self.offer_rate + 0.5)  # those the proposer would serve
        # equal candidates: `uniform_drafts_pay`, O(1) lists where the batch is large
        candidate = DraftCandidate(self.tracker.global_rate, k)
        pays = uniform_drafts_pay(candidate, num_offered, num_sampled, *step[1:], model, cost)
        if not pays and num_offered < num_sampled and self._retry_due(RETRY_MAX_STEPS):
            # the offer rate is retried on a sample (`_retry_due`): every sequence counts
            pays = self._retrying = uniform_drafts_pay(
                candidate, num_sampled, num_sampled, *step[1:], model, cost
            )
        elif pays:
            self._probe_streak = 0
        if not pays and self._steps_off >= self._probe_wait(config.probe_after):
            probe = DraftCandidate(max(self.tracker.global_rate, config.prior), k)
            # the drafts a request would get if all drafted at the prior rate (0: none pays)
            num_drafts, most = uniform_num_drafts(
                probe, num_sampled, num_sampled, *step[1:], model, cost
            )
            pays = self._retrying = num_drafts > 0
            if pays:
                self._probe_streak += 1
                self._probe_drafts = most
        self._steps_off = 0 if pays else self._steps_off + 1
        self._since_proposal += not pays
        return pays

    def _probe_wait(self, probe_after: int) -> int:
        """Steps off before the next acceptance probe: `probe_after`, doubled per probe since
        the pre-check last paid on its own, at most max(`probe_after`, `RETRY_MAX_STEPS`)."""
        return min(probe_after << min(self._probe_streak, 16), max(probe_after, RETRY_MAX_STEPS))

    def _retry_due(self, cap: int) -> bool:
        """Whether the pre-check counts every sequence as offered again: 2^(proposals in a row
        that offered nothing) steps, at most `cap`, have passed since the last proposal. The
        proposal that follows asks the first `RETRY_SAMPLE` eligible requests only:
        where it offers drafts the offer rate rises and the next step proposes for all."""
        return self._since_proposal >= min(1 << min(self._empty_streak, 30), cap)

    def observe(
        self,
        sched: SchedulerOutput,
        num_accepted: Mapping[str, int],
        missed_guess_seq_ids: Sequence[str] = (),
    ) -> None:
        """Record a verify step's outcome in the estimates and the counters: its verify rows'
        accepted counts (`num_accepted`), and the rows whose drafts followed a guess of their
        pending token that failed (`missed_guess_seq_ids`). Those verified nothing: no trial,
        no verify in the counters (their 0 accepted said nothing of the drafts, and counted
        they read the acceptance rate low), but their request's chain of accepted drafts is
        broken (`AcceptanceTracker.chain_broken`). A void row is in neither."""
        for seq_id in missed_guess_seq_ids:
            self.tracker.chain_broken(seq_id)
        verified = False
        for s in sched.scheduled:
            if s.draft_token_ids and s.seq_id in num_accepted:
                accepted = num_accepted[s.seq_id]
                self.tracker.observe(s.seq_id, len(s.draft_token_ids), accepted)
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += len(s.draft_token_ids)
                self.stats.num_accepted_tokens += accepted
                verified = True
        self.stats.num_spec_steps += verified

    def launched(self, sched: SchedulerOutput) -> None:
        """The engine launched the step of `sched`: its host work (proposing, scheduling,
        launching; on the CPU the forward pass too) is the time since this step() call began or
        since the collection the call made before it, whichever is later."""
        if self.config.use_cost_rule:
            now = self._clock()
            self._host_s[id(sched)] = now - max(self._call_start, self._collect_end)

    def step_done(self, sched: SchedulerOutput, collect_start: float) -> None:
        """The engine collected and updated the step of `sched`, having begun waiting for it at
        `collect_start` [s, the drafter's clock]. Its cost, host work + wait + update, is a
        sample of the step time model (`step_time.py`): each moment of a step() call is
        charged to one step, device time that overlapped host work to none."""
        self._collect_end = now = self._clock()
        host_s = self._host_s.pop(id(sched), None)
        if host_s is not None:
            self.timer.observe(
                StepShape.of(sched.scheduled), host_s + max(0.0, now - collect_start)
            )
        if len(self._host_s) > 8:  # steps launched and never collected (an abort): forget them
            self._host_s.clear()

    def finish(self, seq_id: str) -> None:
        """Forget a sequence that left (finished, aborted, failed)."""
        self.proposer.finish(seq_id)
        self.tracker.finish(seq_id)

    def preempted(self, seq_ids: Sequence[str]) -> None:
        """Sequences the scheduler preempted: the proposer frees what it holds for them (their
        acceptance estimates stay)."""
        for seq_id in seq_ids:
            self.proposer.preempted(seq_id)


def load_draft_model(
    config: EngineConfig, hf_config, scheduler_config: SchedulerConfig
) -> DraftModelProposer | None:
    """The draft model's proposer when `config.speculative.method` is "draft_model" (loaded
    now: `draft_model.load_draft_proposer`, whose ValueErrors it raises), else None."""
    if config.speculative is None or config.speculative.method != "draft_model":
        return None
    from phloem.spec_decode.draft_model import load_draft_proposer

    return load_draft_proposer(config, hf_config, scheduler_config)


def build_drafter(
    config: EngineConfig,
    hf_config,
    max_num_batched_tokens: int,
    proposer: DraftModelProposer | None,
) -> Drafter:
    """The engine's drafter for `config.speculative` (set) and a target of `hf_config`'s
    shape; `proposer`: from `load_draft_model` (its passes are charged to the time model)."""
    spec = config.speculative
    assert spec is not None
    device = device_type(config.model.device)
    model = step_time_model(hf_config, device)
    if proposer is not None:
        model = proposer.charge(model, spec.num_speculative_tokens, device)
    return Drafter(spec, model, max_num_batched_tokens, proposer)


def device_type(device: str) -> str:
    """ "cuda" or "cpu" for a `ModelConfig.device` setting ("auto": CUDA when available)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _can_draft(request: Request) -> bool:
    """The request's sampling is one the verifier reproduces (whether it decodes next step:
    `ahead.lead`)."""
    params = request.sampling_params
    return (
        params.structured_outputs is None
        and params.logprobs is None
        and not params.has_penalties
        and len(request.output_token_ids) >= params.min_tokens
    )


def _step_shape(running: Sequence[Request], budget: int) -> tuple[int, int, int]:
    """(sequences sampled, tokens computed, KV tokens read) of the next step without drafts,
    estimated from the running requests (waiting ones are not counted). The pre-check runs it
    every step over the whole running set: `Request.num_tokens` is spelled out (no property
    call), 380 -> 180 us at 2,048 requests (results/2026-11-26h-cpu-spec-gpu-gaps)."""
    num_sampled = num_tokens = num_kv = 0
    for request in running:
        computed = request.num_computed_tokens
        num_kv += computed
        left = (
            request.num_prompt_tokens
            + len(request.output_token_ids)
            + request.num_pending_tokens
            - computed
        )
        if left > 0 and num_tokens < budget:
            if left <= budget - num_tokens:
                num_sampled += 1
                num_tokens += left
            else:
                num_tokens = budget
    return num_sampled, max(num_tokens, 1), num_kv
