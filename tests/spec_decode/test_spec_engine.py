"""Speculative decoding in the engine changes no greedy output: token for token equal with it
off, for the n-gram and the suffix proposer, with prefix sharing, chunked prefill, preemption,
async scheduling, stop strings and mixed sampling settings (tiny random model, and the embedded
SmolLM2 on a copy prompt); seeded sampling with drafts is reproducible; bad settings are
refused naming the field. Under async scheduling, with an oracle proposer (the target's own
greedy continuation): verify steps never collect the step in flight first (drafts proposed one
step ahead, `spec_decode/ahead.py`), and a wrong guess of the pending token verifies nothing."""

from __future__ import annotations

import random

import pytest

from phloem import LLM, SamplingParams
from phloem.spec_decode.drafter import Drafter
from phloem.spec_decode.proposer import DraftRequest, Proposer
from tests.engine.tiny_models import VOCAB, tiny_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "use_cost_rule": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "use_cost_rule": False}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_spec", 5)


def prompts(seed: int = 0, num: int = 8) -> list[list[int]]:
    """Repetitive prompts (so prompt lookup finds matches), half behind a shared system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(20)]
    out = []
    for i in range(num):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
        out.append((system if i % 2 else []) + motif * rng.randint(2, 4))
    return out


def run(path, spec, params, batch=None, **engine_args):
    # 2,048 blocks hold every batch here without preemption; the CPU default (~2M blocks of the
    # tiny model) made the per-step integrity check, O(blocks), ~0.5 s a step
    engine_args = {"block_size": 4, "max_num_batched_tokens": 32, "num_gpu_blocks": 2048,
                   **engine_args}  # fmt: skip
    llm = LLM(str(path), speculative_config=spec, **engine_args)
    engine = llm.llm_engine
    engine.add_step_observer(lambda record: engine.scheduler.check_integrity())  # every step
    batch = batch or prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    engine.scheduler.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_reclaimable_blocks == engine.kv_manager.num_blocks
    stats = engine.drafter.stats if engine.drafter is not None else None
    llm.close()  # TP ranks stop now (the integrity observer's closure keeps the engine alive)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], stats


GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_outputs_equal_with_speculation_off(tiny_llama, spec, async_scheduling):
    want, _ = run(tiny_llama, None, GREEDY, async_scheduling=async_scheduling)
    got, stats = run(tiny_llama, spec, GREEDY, async_scheduling=async_scheduling)
    assert got == want
    # async: proposals run a step ahead (spec_decode/ahead.py), and this random model's next
    # token is rarely the proposer's guess, so few drafts are verified (a failed guess's
    # drafts are not counted; test_spec_async.py: many)
    assert stats.num_draft_tokens > (5 if async_scheduling else 20)
    assert stats.num_accepted_tokens > (0 if async_scheduling else 5)


def test_greedy_equal_under_preemption_and_without_prefix_caching(tiny_llama):
    common = dict(num_gpu_blocks=30, memory_centric_admission=False)
    want, _ = run(tiny_llama, None, GREEDY, **common)
    got, stats = run(tiny_llama, NGRAM, GREEDY, **common)
    assert got == want and stats.num_accepted_tokens > 0
    got, _ = run(tiny_llama, SUFFIX, GREEDY, enable_prefix_caching=False)
    assert got == want


def test_stop_strings_and_tokens_inside_accepted_drafts(tiny_llama):
    base, _ = run(tiny_llama, None, GREEDY)
    text = next(o[0][1] for o in base if len(o[0][1]) > 30)
    stop_token = base[0][0][0][12]  # a token the first output emits mid-way
    params = SamplingParams(
        temperature=0, max_tokens=30, stop=[text[10:14]], stop_token_ids=[stop_token]
    )
    want, _ = run(tiny_llama, None, params)
    got, _ = run(tiny_llama, NGRAM, params)
    assert got == want
    assert {o[0][2] for o in want} >= {"stop"}


def test_mixed_settings_keep_the_greedy_rows_and_seeded_runs_repeat(tiny_llama):
    """Greedy rows beside seeded, logprobs, penalty and n = 2 rows (which draft or not by the
    drafter's rule) are unchanged; seeded sampling with drafts repeats itself."""
    batch = prompts(1, 4)
    mixed = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, n=2, top_k=20),
        SamplingParams(temperature=0, max_tokens=20, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=20, repetition_penalty=1.2),
    ]
    llm = LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=32, speculative_config=NGRAM)
    ask = [{"prompt_token_ids": p} for p in batch]
    first = llm.generate(ask, mixed, use_tqdm=False)
    again = llm.generate(ask, mixed, use_tqdm=False)
    plain = LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=32)
    base = plain.generate(ask, mixed, use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in (first, again, base)[0]]
    assert tokens == [[c.token_ids for c in o.outputs] for o in again]
    for i in (0, 2, 3):  # greedy, logprobs (not drafted), penalties (not drafted)
        assert first[i].outputs[0].token_ids == base[i].outputs[0].token_ids
    assert first[2].outputs[0].logprobs == base[2].outputs[0].logprobs
    assert llm.llm_engine.drafter.stats.num_draft_tokens > 0


def test_the_cost_rule_turns_drafts_off_when_they_cannot_pay(tiny_llama):
    """With the cost rule on, a large batch on a model past its knee verifies no drafts."""
    batch = prompts(2, 48)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want, _ = run(tiny_llama, None, params, batch)
    got, stats = run(tiny_llama, spec, params, batch, max_num_batched_tokens=512)
    assert got == want
    assert stats.num_draft_tokens == 0


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"k": 3}, "unknown key"),
    ],
)
def test_bad_settings_name_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        LLM(speculative_config=spec, load_format="dummy")


def test_embedded_model_copy_prompt_greedy_equal(embedded_llm):
    """The embedded SmolLM2-135M rewriting a given text: n-gram and suffix drafts are accepted
    and the outputs are the plain engine's, token for token."""
    text = (
        "The committee met on Tuesday to review the budget. It approved the new library, "
        "postponed the road repairs, and asked the treasurer for a report on the pension fund."
    )
    prompt = f"Copy this text exactly.\n\nText: {text}\n\nCopy: "
    params = SamplingParams(temperature=0, max_tokens=40)
    want = embedded_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    for spec in (NGRAM, SUFFIX):
        llm = LLM(max_num_batched_tokens=64, dtype="float32", speculative_config=spec)
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want, spec["method"]
        assert llm.llm_engine.drafter.stats.num_accepted_tokens > 10


def test_tensor_parallel_ranks_verify_alike(tiny_llama):
    """TP = 2 on gloo: the drafts travel in the step's data and every rank verifies them the
    same way (a rank that accepted differently would desynchronize the group's sequence
    state): greedy equals TP = 2 without drafts, for sequences that draft and accept."""
    batch = prompts(3, 4)
    tp = dict(tensor_parallel_size=2, dtype="float32")
    want, _ = run(tiny_llama, None, GREEDY, batch, **tp)
    got, stats = run(tiny_llama, NGRAM, GREEDY, batch, **tp)
    assert got == want and stats.num_accepted_tokens > 0


K = NGRAM["num_speculative_tokens"]


class OracleProposer(Proposer):
    """Drafts the plain engine's greedy continuation of each prompt; `wrong_every` > 0 makes
    the guess of every `wrong_every`-th proposal one step ahead (budget > K) wrong (recorded in
    `wrong` as (request id, guess))."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], wrong_every: int = 0) -> None:
        self.outputs, self.wrong_every = outputs, wrong_every
        self.num_ahead = 0
        self.wrong: set[tuple[str, int]] = set()

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            prompt = tuple(r.token_ids[: r.num_prompt_tokens])
            full = list(prompt) + self.outputs[prompt]
            drafts = full[len(r.token_ids) : len(r.token_ids) + r.max_draft_tokens]
            if r.max_draft_tokens > K and len(drafts) == r.max_draft_tokens:
                self.num_ahead += 1
                if self.wrong_every and self.num_ahead % self.wrong_every == 0:
                    at = r.max_draft_tokens - K - 1  # the guess of the pending token
                    drafts[at] = (drafts[at] + 1) % VOCAB
                    self.wrong.add((r.request_id, drafts[at]))
            out.append(drafts)
        return out

    def finish(self, request_id: str) -> None:
        pass


def _oracle_run(path, wrong_every: int = 0):
    """Greedy off, then with the oracle proposer (async scheduling): (off, on, drafter, the
    verify and void rows seen: (seq id, guess, drafts, accepted or None when void or its guess
    failed, whether its guess failed), proposer)."""
    batch = prompts(4, 6)
    want, _ = run(path, None, GREEDY, batch, async_scheduling=True)
    oracle = OracleProposer(
        {tuple(p): list(w[0][0]) for p, w in zip(batch, want)}, wrong_every=wrong_every
    )
    llm = LLM(str(path), speculative_config=NGRAM, block_size=4, max_num_batched_tokens=64,
              num_gpu_blocks=512, async_scheduling=True)  # fmt: skip
    engine = llm.llm_engine
    old = engine.drafter
    engine.drafter = Drafter(old.config, old.time_model, old.budget, oracle)
    rows = []

    def observe(record) -> None:
        engine.scheduler.check_integrity()
        out = record.runner_output
        accepted, missed = out.num_accepted_drafts, out.missed_guess_seq_ids
        for s in record.scheduler_output.scheduled:
            if s.draft_token_ids or (s.sample and s.seq_id not in out.sampled_token_ids):
                row = (s.seq_id, s.pending_guess, s.draft_token_ids, accepted.get(s.seq_id))
                rows.append((*row, s.seq_id in missed))

    engine.add_step_observer(observe)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    got = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    assert engine.kv_manager.num_reclaimable_blocks == engine.kv_manager.num_blocks
    llm.close()
    return want, got, engine.drafter, rows, oracle


def test_verify_steps_do_not_sync_on_the_step_in_flight(tiny_llama):
    want, got, drafter, rows, _ = _oracle_run(tiny_llama)
    assert got == want
    assert drafter.num_syncs == 0  # every proposal ran one step ahead of the step in flight
    guessed = [r for r in rows if r[1] >= 0]
    assert len(guessed) == len(rows) > 10  # (and no void row: every draft accepted)
    stats = drafter.stats
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 40


def test_a_wrong_guess_verifies_nothing_and_outputs_stay(tiny_llama):
    want, got, drafter, rows, oracle = _oracle_run(tiny_llama, wrong_every=3)
    assert got == want
    assert drafter.num_syncs == 0
    wrong = [r for r in rows if (r[0], r[1]) in oracle.wrong]
    # right drafts after a wrong guess: not verified, so no accepted count (the update reads 0)
    assert wrong and all(r[3] is None and r[4] for r in wrong)
    assert all((r[0], r[1]) in oracle.wrong for r in rows if r[4])
    right = [r for r in rows if (r[0], r[1]) not in oracle.wrong and r[3] is not None]
    assert sum(r[3] for r in right) > 20
    # the counters and the cost rule's rates see the verified drafts only: the oracle's are all
    # right (counting a failed guess's drafts as 0 accepted read ~3/4 here)
    stats = drafter.stats
    assert stats.num_drafts == len(right)
    assert stats.num_draft_tokens == sum(len(r[2]) for r in right)
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert drafter.tracker.global_rate > 0.99  # (counting them: ~0.95)
    # a row scheduled on top of a row whose guess failed assumed its drafts: void
    assert any(r[3] is None and not r[2] for r in rows)
