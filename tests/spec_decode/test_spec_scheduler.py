"""The scheduler with draft tokens, against a fake model that reads its tokens back out of a fake
KV cache through the block tables: rejected drafts' slots are rolled back (block tables, freed
blocks, `num_computed_tokens`), the radix cache never holds a rejected token, and every output
is the fake model's greedy continuation, with preemption, prefix caching and shared prefixes.
`check_integrity` after every step."""

from __future__ import annotations

import random

from phloem.config import SchedulerConfig
from phloem.core.kv_manager import KVManager
from phloem.core.request import Request, RequestStatus
from phloem.core.scheduler import Scheduler
from phloem.distributed.step_codec import decode_step, encode_step
from phloem.sampling_params import SamplingParams

VOCAB = 50


def next_token(tokens) -> int:
    """The fake model's greedy token after `tokens` (a function of all of them)."""
    return (sum(t * (i + 7) for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


class FakeWorker:
    """Writes each computed token into its KV slot and predicts from the slots it reads."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.slots: dict[int, int] = {}

    def run(self, out):
        kv = self.scheduler.kv
        bs = kv.block_size
        sampled, accepted = {}, {}
        for s in out.scheduled:
            request = self.scheduler.requests.get(s.seq_id)
            if request is None:
                continue
            table = kv.block_ids(s.seq_id)
            start, drafts = s.num_computed_tokens, list(s.draft_token_ids)
            end = start + s.num_tokens - len(drafts)
            tokens = request.token_ids(start, end) + drafts
            for pos, token in zip(range(start, start + s.num_tokens), tokens):
                self.slots[table[pos // bs] * bs + pos % bs] = token
            if not s.sample:
                continue
            last = start + s.num_tokens - len(drafts) - 1  # position of the last known token

            def predict(pos, table=table):
                return next_token(
                    [self.slots[table[p // bs] * bs + p % bs] for p in range(pos + 1)]
                )

            a = 0
            while a < len(drafts) and drafts[a] == predict(last + a):
                a += 1
            sampled[s.seq_id], accepted[s.seq_id] = predict(last + a), a
        return sampled, accepted


def draft_for(request: Request, k: int, rng: random.Random) -> list[int]:
    """k drafts: the true continuation, corrupted at a random point (or not at all)."""
    tokens = request.prompt_token_ids + request.output_token_ids
    drafts = []
    for _ in range(k):
        drafts.append(next_token(tokens + drafts))
    cut = rng.randint(0, k)
    return drafts[:cut] + [rng.randrange(VOCAB) for _ in range(k - cut)]


def run(prompts, max_tokens, *, num_blocks, spec_k, seed=0, prefix_cache=True, codec=False):
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=24, max_model_len=256, memory_centric_admission=False
    )
    scheduler = Scheduler(config, KVManager(num_blocks, 4, enable_prefix_cache=prefix_cache))
    worker, rng = FakeWorker(scheduler), random.Random(seed)
    requests = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests.append(Request(str(i), list(prompt), params))
        scheduler.add_request(requests[-1])
    num_drafted = num_steps = 0
    while scheduler.has_unfinished_requests():
        for r in scheduler.running:
            r.draft_token_ids = draft_for(r, rng.randint(0, spec_k), rng) if spec_k else []
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        if codec:  # the contract as the tensor-parallel driver sends it
            out = decode_step(encode_step((), out))[1]
            scheduler._unapplied = {id(out): v for v in scheduler._unapplied.values()}
        num_drafted += sum(len(s.draft_token_ids) for s in out.scheduled)
        sampled, accepted = worker.run(out)
        scheduler.update_from_output(out, sampled, accepted)
        scheduler.check_integrity()
        check_cache_tokens(scheduler, worker)
        num_steps += 1
        assert num_steps < 5000
    return [r.output_token_ids for r in requests], scheduler, num_drafted


def check_cache_tokens(scheduler: Scheduler, worker: FakeWorker) -> None:
    """Every radix-cache block holds, in the fake KV, exactly the tokens its node says."""
    cache = scheduler.kv.prefix_cache
    if cache is None:
        return
    bs = scheduler.kv.block_size
    stack = [(cache.root, [])]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            tokens = prefix + list(child.key)
            for i, block in enumerate(child.block_ids):
                start = len(prefix) + i * bs
                want = tokens[start : start + bs]
                assert [worker.slots[block * bs + j] for j in range(bs)] == want
            stack.append((child, tokens))


def expected(prompts, max_tokens):
    outs = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(next_token(tokens))
        outs.append(tokens[len(prompt) :])
    return outs


def test_drafts_give_the_greedy_outputs_with_rollback_preemption_and_prefix_cache():
    rng = random.Random(1)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    prompts = [
        shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(10)
    ]
    want = expected(prompts, 30)
    outs, scheduler, num_drafted = run(prompts, 30, num_blocks=40, spec_k=4)
    assert outs == want
    assert num_drafted > 100
    assert scheduler.num_preemptions > 0  # the pool is small enough to preempt
    assert scheduler.kv.num_free_blocks + scheduler.kv.prefix_cache.num_evictable_blocks == 40


def test_drafts_through_the_step_codec_and_without_prefix_cache():
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    outs, scheduler, _ = run(prompts, 25, num_blocks=64, spec_k=5, prefix_cache=False, codec=True)
    assert outs == expected(prompts, 25)
    assert scheduler.kv.num_free_blocks == 64


def test_drafts_are_cut_to_max_tokens_and_the_budget():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64)
    scheduler = Scheduler(config, KVManager(32, 4))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    a, b = Request("a", [1, 2, 3], params), Request("b", [4, 5], params)
    for r in (a, b):
        scheduler.add_request(r)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": 9, "b": 9})
    a.draft_token_ids, b.draft_token_ids = [1, 2, 3, 4, 5], [1, 2, 3]
    out = scheduler.schedule()
    # a: max_tokens 3 with 1 output leaves 2 tokens, so 1 draft; b: 6 - 2 - 1 = 3 budget left
    # minus its own token = 2 drafts, and max_tokens allows 1
    assert [(s.seq_id, s.num_tokens, s.draft_token_ids) for s in out.scheduled] == [
        ("a", 2, (1,)),
        ("b", 2, (1,)),
    ]
    assert a.draft_token_ids == [] and b.draft_token_ids == []
    scheduler.update_from_output(out, {"a": 7, "b": 8}, {"a": 1, "b": 0})
    assert a.output_token_ids == [9, 1, 7] and a.status is RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [9, 8] and b.num_computed_tokens == 3
    assert scheduler.num_new_tokens == {"a": 2, "b": 1}
    scheduler.check_integrity()


def test_a_stop_token_inside_the_accepted_drafts_drops_the_rest():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    scheduler = Scheduler(config, KVManager(32, 4, enable_prefix_cache=True))
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[42])
    r = Request("r", [1, 2, 3, 4, 5], params, eos_token_id=0)
    scheduler.add_request(r)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"r": 6})
    r.draft_token_ids = [7, 42, 8, 9]
    out = scheduler.schedule()
    assert out.scheduled[0].num_tokens == 5
    scheduler.update_from_output(out, {"r": 11}, {"r": 4})
    assert r.output_token_ids == [6, 7, 42] and r.stop_reason == 42
    assert r.status is RequestStatus.FINISHED_STOPPED
    scheduler.check_integrity()


def test_a_verified_run_appended_at_once_matches_the_per_token_stop_checks():
    """`apply_verified`'s bulk append against appending its run token by token with
    `check_stop` after each (the rule it shortcuts), on random runs, pending counts and stop
    settings (EOS, stop ids, min_tokens, max_tokens, the context length)."""
    from phloem.core.draft_tokens import apply_verified
    from phloem.core.scheduler_output import ScheduledSequence
    from phloem.core.stop_checker import check_stop

    rng = random.Random(0)
    for _ in range(400):
        max_tokens = rng.choice([None, rng.randint(1, 12)])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, min(4, max_tokens or 4)),
            stop_token_ids=rng.choice([[], [rng.randint(0, 9)]]),
            ignore_eos=rng.random() < 0.2,
        )
        outputs = [rng.randint(10, 19) for _ in range(rng.randint(0, 3))]
        drafts = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 6)))
        num_accepted, token_id = rng.randint(0, len(drafts)), rng.randint(0, 9)
        pending = 1 + len(drafts) + rng.choice([0, 0, 1 + len(drafts)])
        max_model_len = rng.randint(6, 20)
        eos = rng.choice([None, rng.randint(0, 9)])

        got, want = (
            Request("r", [20] * 3, params, eos_token_id=eos, output_token_ids=list(outputs))
            for _ in range(2)
        )
        for r in (got, want):
            r.num_pending_tokens, r.status = pending, RequestStatus.PREEMPTED  # (no KV to trim)
        sched = ScheduledSequence("r", 0, 1 + len(drafts), True, draft_token_ids=drafts)
        status, num_new = apply_verified(got, sched, token_id, {"r": num_accepted}, None, max_model_len)  # type: ignore[arg-type]  # fmt: skip
        want.num_pending_tokens = max(0, pending - (len(drafts) - num_accepted))
        if len(drafts) > num_accepted and want.num_pending_tokens > num_accepted + 1:
            want.num_pending_tokens = num_accepted + 1
        want_status, want_new = None, 0
        for token in (*drafts[:num_accepted], token_id):
            want.append_output_token(token)
            want_new += 1
            want_status = check_stop(want, max_model_len)
            if want_status is not None:
                break
        assert (status, num_new) == (want_status, want_new)
        assert got.output_token_ids == want.output_token_ids
        assert (got.num_pending_tokens, got.stop_reason) == (
            want.num_pending_tokens,
            want.stop_reason,
        )
