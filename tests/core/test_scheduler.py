"""Scheduler loops with a fake model: exact block ids, chunked prefill, preemption, n > 1 forks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phloem.config import SchedulerConfig
from phloem.core.admission import Admission
from phloem.core.block_allocator import BlockAllocator, NoFreeBlocksError
from phloem.core.kv_manager import KVManager
from phloem.core.prefix_groups import PrefixGroups
from phloem.core.request import Request, RequestStatus, SharedPrefix
from phloem.core.scheduler import Scheduler
from phloem.sampling_params import SamplingParams

VOCAB = 1000


def fake_next_token(request: Request) -> int:
    """A deterministic 'model': the next token is a function of all previous tokens."""
    tokens = request.prompt_token_ids + request.output_token_ids
    return (sum(tokens) * 31 + len(tokens)) % VOCAB


def fake_sampled(scheduler: Scheduler, out) -> dict[str, int]:
    """The fake model's token for each sequence of `out` that samples and is still live (one
    that finished since `out` was scheduled, under async scheduling, gets none: its update
    skips it)."""
    sampled = {}
    for s in out.scheduled:
        request = scheduler.requests.get(s.seq_id)
        if s.sample and request is not None:
            sampled[s.seq_id] = fake_next_token(request)
    return sampled


def make_scheduler(
    num_blocks=64,
    block_size=4,
    budget=32,
    max_seqs=8,
    max_len=512,
    chunked=True,
    memory_centric=True,
    prefix_cache=False,
):
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=chunked,
        memory_centric_admission=memory_centric,
    )
    return Scheduler(config, KVManager(num_blocks, block_size, enable_prefix_cache=prefix_cache))


def run_to_completion(scheduler: Scheduler, max_steps=10_000, on_step=None):
    """Step with the fake model; returns the per-step (request_id, num_tokens) lists."""
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(out.scheduled) <= scheduler.config.max_num_seqs
        steps.append([(s.seq_id, s.num_tokens) for s in out.scheduled])
        scheduler.update_from_output(out, fake_sampled(scheduler, out))
        scheduler.check_integrity()
        if on_step:
            on_step(scheduler, out)
        assert len(steps) < max_steps, "scheduler made no progress"
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks, "blocks leaked"
    return steps


def req(rid, prompt_len, max_tokens=4, seed_token=0, **kw):
    prompt = [(seed_token + 7 * i) % VOCAB for i in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(rid, prompt, params)


def reference_outputs(requests):
    """Each request alone, one token at a time: what every schedule must reproduce."""
    result = {}
    for r in requests:
        clone = Request(r.request_id, list(r.prompt_token_ids), r.sampling_params)
        while len(clone.output_token_ids) < r.sampling_params.max_tokens:
            clone.append_output_token(fake_next_token(clone))
        result[r.request_id] = clone.output_token_ids
    return result


def test_exact_block_ids_chunked_prefill_and_decode():
    s = make_scheduler(num_blocks=16, block_size=4, budget=8)
    a, b = req("a", 10, max_tokens=2), req("b", 3, max_tokens=2)
    s.add_request(a)
    s.add_request(b)

    out = s.schedule()  # a: chunk of 8 (blocks 0,1); b gets nothing (budget spent)
    assert [(x.seq_id, x.num_tokens) for x in out.scheduled] == [("a", 8)]
    assert s.kv.block_ids("a") == [0, 1]
    assert not out.scheduled[0].sample
    s.update_from_output(out, {})

    out = s.schedule()  # a: last 2 prompt tokens (block 2); b: all 3 (block 3)
    assert [(x.seq_id, x.num_tokens) for x in out.scheduled] == [("a", 2), ("b", 3)]
    assert s.kv.block_ids("a") == [0, 1, 2] and s.kv.block_ids("b") == [3]
    assert all(x.sample for x in out.scheduled)
    s.update_from_output(out, {"a": 5, "b": 6})
    assert a.output_token_ids == [5] and b.output_token_ids == [6]

    out = s.schedule()  # decode: a at position 10 (block 2 has room), b at 3 (block 3 has room)
    assert [(x.seq_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 1)]
    assert s.kv.block_ids("a") == [0, 1, 2] and s.kv.block_ids("b") == [3]
    s.update_from_output(out, {"a": 7, "b": 8})
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH
    assert s.kv.num_free_blocks == 16
    s.check_integrity()


def test_chunked_prefill_mixes_with_decode():
    s = make_scheduler(num_blocks=64, block_size=4, budget=6)
    s.add_request(req("short", 2, max_tokens=6))
    s.add_request(req("long", 20, max_tokens=2))
    steps = run_to_completion(s)
    mixed = [st for st in steps if ("short", 1) in st and any(r == "long" and n > 1 for r, n in st)]
    assert mixed, f"no step mixed a decode with a prefill chunk: {steps}"


def test_chunked_prefill_off_admits_whole_prompts_only():
    s = make_scheduler(num_blocks=200, budget=512, chunked=False)
    s.add_request(req("a", 300, max_tokens=1))
    s.add_request(req("b", 300, max_tokens=1))
    steps = run_to_completion(s)
    assert steps[0] == [("a", 300)]
    assert steps[1] == [("b", 300)]


def test_preemption_recomputes_and_keeps_outputs():
    requests = [req(f"r{i}", 5 + 3 * i, max_tokens=12, seed_token=i) for i in range(6)]
    expected = reference_outputs(requests)
    s = make_scheduler(num_blocks=12, block_size=4, budget=16, max_seqs=6, memory_centric=False)
    for r in requests:
        s.add_request(r)
    preemptions = []
    run_to_completion(s, on_step=lambda sch, out: preemptions.extend(out.preempted_seq_ids))
    assert preemptions, "the tiny pool should have forced a preemption"
    assert {r.request_id: r.output_token_ids for r in requests} == expected
    assert sum(r.num_preemptions for r in requests) == len(preemptions)


def test_memory_centric_admission_avoids_preemption():
    requests = [req(f"r{i}", 5 + 3 * i, max_tokens=12, seed_token=i) for i in range(6)]
    expected = reference_outputs(requests)
    s = make_scheduler(num_blocks=12, block_size=4, budget=16, max_seqs=6, memory_centric=True)
    for r in requests:
        s.add_request(r)
    preemptions = []
    run_to_completion(s, on_step=lambda sch, out: preemptions.extend(out.preempted_seq_ids))
    assert preemptions == []
    assert {r.request_id: r.output_token_ids for r in requests} == expected


def test_abort_frees_blocks():
    s = make_scheduler()
    for i in range(3):
        s.add_request(req(f"r{i}", 9, max_tokens=50))
    out = s.schedule()
    s.update_from_output(out, {x.seq_id: 1 for x in out.scheduled if x.sample})
    s.abort_requests(["r1", "missing"])
    s.check_integrity()
    assert s.requests.keys() == {"r0", "r2"}
    out = s.schedule()
    assert "r1" in out.finished_seq_ids
    s.abort_requests(["r0", "r2"])
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.has_unfinished_requests()


def test_fork_shares_full_prompt_blocks():
    s = make_scheduler(num_blocks=32, block_size=4, budget=64)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = list(range(10))
    group = SharedPrefix(prefix_len=8, num_unfinished=2)
    leader = Request("p#0", prompt, params, shared_prefix=group)
    child = Request("p#1", prompt, params, shared_prefix=group)
    s.add_request(leader)
    s.add_request(child)
    out = s.schedule()
    assert [x.seq_id for x in out.scheduled] == ["p#0"]  # child waits for the prompt
    s.update_from_output(out, {"p#0": 1})
    out = s.schedule()
    # the child shares blocks 0,1 (8 tokens) and computes the last 2 prompt tokens itself
    assert s.kv.block_ids("p#1")[:2] == s.kv.block_ids("p#0")[:2]
    # holders of a prefix block: the leader's table, the group, the child's table
    assert s.kv.allocator.ref_count(s.kv.block_ids("p#0")[0]) == 3
    assert child.num_cached_tokens == 8
    assert [(x.seq_id, x.num_tokens) for x in out.scheduled] == [("p#0", 1), ("p#1", 2)]
    s.check_integrity()
    s.update_from_output(out, {"p#0": 2, "p#1": 3})
    run_to_completion(s)


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_len=12)
    r = Request("a", list(range(10)), SamplingParams(temperature=0, max_tokens=None))
    s.add_request(r)
    run_to_completion(s)
    assert r.num_tokens == 12 and r.status is RequestStatus.FINISHED_LENGTH


def test_stop_token_and_min_tokens():
    s = make_scheduler()
    r = req("a", 4, max_tokens=10, stop_token_ids=[42], min_tokens=2)
    s.add_request(r)
    for token in (42, 42, 9, 42):
        out = s.schedule()
        while not out.scheduled[0].sample:
            s.update_from_output(out, {})
            out = s.schedule()
        s.update_from_output(out, {"a": token})
        if r.is_finished:
            break
    assert r.output_token_ids == [42, 42] and r.status is RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 42


def test_prompt_too_long_rejected():
    s = make_scheduler(max_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(req("a", 16))


@pytest.mark.parametrize("seed", range(4))
def test_reserved_blocks_agree_with_blocks_to_finish(seed):
    """`Admission.blocks_to_finish` over the running requests at once equals the per-request
    sum (it runs
    every step); the two agree in every step: max_tokens set or None, capped by the context,
    prefix-cache hits, preemption (admission by the next chunk only)."""
    rng = random.Random(seed)
    s = make_scheduler(
        num_blocks=24, block_size=4, budget=12, max_seqs=5, max_len=48,
        memory_centric=bool(seed % 2), prefix_cache=True,
    )  # fmt: skip
    for i in range(12):
        max_tokens = None if i % 3 == 0 else rng.randint(1, 40)
        s.add_request(req(f"r{i}", rng.randint(1, 30), max_tokens=max_tokens, seed_token=i % 4))

    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, fake_sampled(s, out))
        s.check_integrity()
        admission = s.admission
        total = sum(admission.blocks_to_finish((r,)) for r in s.running)
        assert admission.blocks_to_finish(s.running) == total
        assert admission.reserved_blocks(s.running) == (total if seed % 2 else 0)
    assert s.num_preemptions > 0 or seed % 2


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(8, 40),
    budget=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
)
def test_random_workloads_match_reference(seed, num_blocks, budget, block_size):
    rng = random.Random(seed)
    max_seq_tokens = num_blocks * block_size  # every single request must fit the pool alone
    requests = []
    for i in range(rng.randint(1, 8)):
        prompt_len = rng.randint(1, max(1, min(40, max_seq_tokens // 2)))
        max_tokens = rng.randint(1, max(1, min(12, max_seq_tokens - prompt_len)))
        requests.append(
            req(f"r{i}", prompt_len, max_tokens=max_tokens, seed_token=rng.randint(0, 99))
        )
    expected = reference_outputs(requests)
    s = make_scheduler(num_blocks, block_size, budget, max_seqs=rng.randint(1, 8))
    pending = list(requests)
    # requests arrive over time: continuous batching admits them between steps
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                s.add_request(pending.pop(0))
        if not s.has_unfinished_requests():
            continue
        out = s.schedule()
        s.update_from_output(out, fake_sampled(s, out))
        s.check_integrity()
    assert s.kv.num_free_blocks == num_blocks
    assert {r.request_id: r.output_token_ids for r in requests} == expected


class _AllocatorModel:
    def __init__(self, n):
        self.refs = {}
        self.n = n


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 5)), max_size=60
    )
)
def test_block_allocator_fuzz(ops):
    allocator = BlockAllocator(8)
    model: dict[int, int] = {}
    for op, k in ops:
        if op == "alloc":
            free = 8 - len(model)
            if k > free:
                with pytest.raises(NoFreeBlocksError):
                    allocator.allocate(k)
            else:
                for b in allocator.allocate(k):
                    assert b not in model
                    model[b] = 1
        elif model:
            block = sorted(model)[k % len(model)]
            if op == "incref":
                allocator.incref([block])
                model[block] += 1
            else:
                allocator.decref([block])
                model[block] -= 1
                if model[block] == 0:
                    del model[block]
        allocator.check_integrity()
        assert allocator.num_free_blocks == 8 - len(model)
        for b, c in model.items():
            assert allocator.ref_count(b) == c
    with pytest.raises(ValueError):
        free_block = next(b for b in range(8) if b not in model) if len(model) < 8 else None
        if free_block is None:
            raise ValueError("pool full")
        allocator.decref([free_block])


def test_a_request_whose_admission_or_stop_rule_raises_fails_alone(monkeypatch):
    """An exception in one waiting request's admission, or in its stop rules, finishes it as
    FINISHED_ERROR (blocks freed, reason in `failed_requests`); the others run to the end."""
    import phloem.core.scheduler as scheduler_module

    real_stop = scheduler_module.check_stop

    class FaultyPrefixGroups(PrefixGroups):
        def attach(self, request):
            if request.request_id == "bad-admit":
                raise IndexError("injected admission fault")
            return super().attach(request)

    def check_stop(request, max_model_len):
        if request.request_id == "bad-stop" and request.num_output_tokens == 2:
            raise KeyError("injected stop fault")
        return real_stop(request, max_model_len)

    monkeypatch.setattr(scheduler_module, "check_stop", check_stop)
    plain = make_scheduler()
    scheduler = Scheduler(
        plain.config, plain.kv, FaultyPrefixGroups(plain.kv, Admission(plain.config, plain.kv))
    )
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    requests = {
        rid: Request(rid, [1 + i, 2, 3, 4, 5, 6], params)
        for i, rid in enumerate(["a", "bad-admit", "bad-stop", "b"])
    }
    for request in requests.values():
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert requests["bad-admit"].status is RequestStatus.FINISHED_ERROR
    assert requests["bad-admit"].num_output_tokens == 0
    assert requests["bad-stop"].status is RequestStatus.FINISHED_ERROR
    assert requests["bad-stop"].num_output_tokens == 2
    assert set(scheduler.failed_requests) == {"bad-admit", "bad-stop"}
    assert "injected admission fault" in scheduler.failed_requests["bad-admit"]
    for rid in ("a", "b"):
        assert requests[rid].status is RequestStatus.FINISHED_LENGTH
        assert requests[rid].num_output_tokens == 5
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
