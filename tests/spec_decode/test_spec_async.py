"""Verify steps keep async scheduling's overlap (issue 20; the engine with an oracle proposer:
test_spec_engine.py, `test_verify_steps_do_not_sync_on_the_step_in_flight` and
`test_a_wrong_guess_verifies_nothing_and_outputs_stay`). Here: the rejection sampler's `valid`
mask samples the target's first position (a row whose guess of its pending token failed), and
the scheduler alone, against test_spec_scheduler's fake KV model run a step ahead of its
updates with drafts proposed ahead (`spec_decode/ahead.py`): rows stacked on rejected drafts
are void and rolled back, and the block tables and the radix cache stay right, with
preemption."""

from __future__ import annotations

import random

import pytest
import torch

from phloem.config import SchedulerConfig
from phloem.core.kv_manager import KVManager
from phloem.core.request import Request
from phloem.core.scheduler import Scheduler
from phloem.sampling_params import SamplingParams
from phloem.spec_decode import ahead
from phloem.spec_decode.rejection_sampler import rejection_sample
from tests.spec_decode.test_spec_scheduler import VOCAB, check_cache_tokens, expected, next_token

K = 4


def test_an_invalid_row_samples_the_first_position():
    """valid=False: no draft accepted and the token is a sample of p_0 (the residual of a
    rejected draft 0 would never emit the draft's own token)."""
    p0 = torch.tensor([0.7, 0.1, 0.1, 0.1])
    p1 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    batch = 4000
    probs = torch.stack((p0, p1)).expand(batch, 2, 4).contiguous()
    drafts = torch.zeros(batch, 1, dtype=torch.long)  # draft 0: likely accepted where valid
    gen = torch.Generator().manual_seed(0)
    valid = torch.zeros(batch, dtype=torch.bool)
    out = rejection_sample(probs, drafts, [1] * batch, fallback_generator=gen, valid=valid)
    assert int(out.num_accepted.sum()) == 0
    share = (out.token_ids[:, 0] == 0).float().mean().item()
    assert share == pytest.approx(0.7, abs=0.03)
    greedy = rejection_sample(probs[:2], drafts[:2], [1, 1], is_greedy=[True, True],
                              valid=torch.tensor([False, True]))  # fmt: skip
    assert greedy.num_accepted.tolist() == [0, 1]
    assert greedy.token_ids[0, 0] == 0 and greedy.token_ids[1, 1] == 0


class FakeDevice:
    """The fake model of test_spec_scheduler behind async scheduling: a step runs at launch
    on the device's own token lists (which know every launched step's tokens), as the worker
    would (`worker/stacked_rows.py`): a row whose input lies past those is void, a row whose
    guess of its pending token is wrong accepts no draft."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.slots = scheduler, {}
        self.tokens: dict[str, list[int]] = {}  # seq id -> prompt + tokens emitted on the device

    def launch(self, out):
        kv, bs = self.scheduler.kv, self.scheduler.kv.block_size
        sampled, accepted = {}, {}
        for seq_id in out.preempted_seq_ids:
            self.tokens.pop(seq_id, None)
        for s in out.scheduled:
            if s.new_sequence is not None:
                new = s.new_sequence
                self.tokens[s.seq_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            known, table = self.tokens[s.seq_id], kv.block_ids(s.seq_id)
            start, drafts = s.num_computed_tokens, list(s.draft_token_ids)
            end = start + s.num_tokens - len(drafts)
            inputs = known[start:end] + [0] * (end - len(known)) + drafts  # void: garbage
            for pos, token in zip(range(start, start + s.num_tokens), inputs):
                self.slots[table[pos // bs] * bs + pos % bs] = token
            if not s.sample or end > len(known):  # past the tokens emitted: void
                continue
            last = end - 1

            def predict(pos, table=table):
                return next_token(
                    [self.slots[table[p // bs] * bs + p % bs] for p in range(pos + 1)]
                )

            a = 0
            if s.pending_guess < 0 or known[last] == s.pending_guess:
                while a < len(drafts) and drafts[a] == predict(last + a):
                    a += 1
            sampled[s.seq_id], accepted[s.seq_id] = predict(last + a), a
            known += drafts[:a] + [sampled[s.seq_id]]
        return sampled, accepted


def _ahead_drafts(scheduler, flight, k: int, rng) -> None:
    """Drafts as the drafter would set them (`ahead.lead` / `ahead.split`): the true
    continuation of the known tokens, lead tokens first, cut or corrupted at random."""
    rows = ahead.rows_in_flight(flight)
    for r in scheduler.running:
        r.draft_token_ids, r.draft_guess = [], -1
        lead = ahead.lead(r, rows)
        if lead < 0:
            continue
        tokens = list(r.prompt_token_ids) + list(r.output_token_ids)
        proposal = []
        for _ in range(lead + rng.randint(0, k)):
            proposal.append(next_token(tokens + proposal))
        if proposal and rng.random() < 0.3:
            proposal[rng.randrange(len(proposal))] = rng.randrange(VOCAB)
        r.draft_guess, r.draft_token_ids = ahead.split(proposal, lead, rows.get(r.request_id))


@pytest.mark.parametrize("num_blocks", [40, 200])
def test_stacked_rows_roll_back_with_preemption_and_prefix_cache(num_blocks):
    """Step N+1 scheduled before step N is applied, with drafts proposed ahead: outputs are the
    fake model's greedy ones, `check_integrity` and the cached blocks' tokens hold after every
    step, and guesses, void rows and preemptions (the small pool) all occur."""
    rng = random.Random(num_blocks)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    prompts_ = [
        shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(10)
    ]
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=256,
                             memory_centric_admission=False)  # fmt: skip
    scheduler = Scheduler(config, KVManager(num_blocks, 4, enable_prefix_cache=True))
    device = FakeDevice(scheduler)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    requests = [Request(str(i), list(p), params) for i, p in enumerate(prompts_)]
    for r in requests:
        scheduler.add_request(r)
    flight, seen = None, {"guess": 0, "void": 0}
    while scheduler.has_unfinished_requests() or flight is not None:
        _ahead_drafts(scheduler, flight and flight[0], K, rng)
        out = scheduler.schedule()
        result = device.launch(out)
        seen["guess"] += sum(s.pending_guess >= 0 for s in out.scheduled)
        if flight is not None:
            sched, (sampled, accepted) = flight
            seen["void"] += sum(s.sample and s.seq_id not in sampled for s in sched.scheduled)
            scheduler.update_from_output(sched, sampled, accepted)
        flight = (out, result) if out.scheduled else None
        scheduler.check_integrity()
        check_cache_tokens(scheduler, device)
    assert [r.output_token_ids for r in requests] == expected(prompts_, 30)
    assert seen["guess"] > 20 and seen["void"] > 5
    assert num_blocks > 40 or scheduler.num_preemptions > 0
