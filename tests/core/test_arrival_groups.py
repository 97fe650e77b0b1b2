"""Online prefix groups (issue 24, item 4): requests that arrive together, or while their prefix
is being computed, compute it once; a lone request is never held back (fake model, exact token
counts). And the prefill cap for steady inter-token latency (item 3)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from phloem.core.arrival_groups import block_hashes
from phloem.core.request import Request
from phloem.sampling_params import SamplingParams
from tests.core.test_scheduler import fake_sampled, make_scheduler, reference_outputs

BS = 4


def prompts_with_prefix(num, prefix_blocks, seed=0, suffix=(2, 7)):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 1000) for _ in range(prefix_blocks * BS)]
    return [
        prefix + [rng.randrange(1, 1000) for _ in range(rng.randint(*suffix))] for _ in range(num)
    ]


def requests_of(prompts, max_tokens=4, tag="r"):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(f"{tag}{i}", list(p), params) for i, p in enumerate(prompts)]


def step(s):
    out = s.schedule()
    s.update_from_output(out, fake_sampled(s, out))
    s.check_integrity()
    return out


def run(s, arrivals, max_steps=500):
    """Step to the end; `arrivals` maps a step index to the requests added before it. Returns
    the prompt tokens computed and the step at which each request was first scheduled."""
    first: dict[str, int] = {}
    for i in range(max_steps):
        for r in arrivals.get(i, []):
            s.add_request(r)
        if not s.has_unfinished_requests() and i > max(arrivals):
            break
        for x in step(s).scheduled:
            first.setdefault(x.seq_id, i)
    assert not s.has_unfinished_requests()
    return s.num_computed_prompt_tokens, first


def scheduler(prefix_cache=True, grouping=True, budget=64, **kw):
    s = make_scheduler(num_blocks=200, block_size=BS, budget=budget, prefix_cache=prefix_cache)
    s.config = dataclasses.replace(s.config, online_prefix_grouping=grouping, **kw)
    if not grouping:
        s.arrival_groups = None
    return s


def test_simultaneous_arrivals_compute_the_common_prefix_once():
    requests = requests_of(prompts_with_prefix(5, prefix_blocks=3))
    expected = reference_outputs(requests)
    s = scheduler()
    computed, first = run(s, {0: requests})
    suffixes = sum(r.num_prompt_tokens - 3 * BS for r in requests)
    assert computed == 3 * BS + suffixes  # the prefix once
    assert s.num_reused_prompt_tokens == 4 * 3 * BS
    assert {r.request_id: r.output_token_ids for r in requests} == expected
    assert first["r0"] == 0 and all(first[r.request_id] == 1 for r in requests[1:])


def test_members_decode_as_one_prefix_group():
    """The step after the leader's prefill, every member's row names the group's prefix (the
    worker's prefix-shared attention groups them), as for an offline planned group."""
    requests = requests_of(prompts_with_prefix(4, prefix_blocks=3, seed=6), max_tokens=6)
    s = scheduler()
    for r in requests:
        s.add_request(r)
    step(s)
    step(s)  # the members' admission
    rows = step(s).scheduled  # everyone decodes
    assert len(rows) == 4 and {x.prefix_len for x in rows} == {3 * BS}
    assert len({x.group_id for x in rows}) == 1 and rows[0].group_id >= 0


def test_without_grouping_the_same_arrivals_compute_it_each_time():
    """The reference the dedup is measured against: the radix cache alone knows nothing of
    blocks not yet computed, so every request admitted in the first step computes the prefix."""
    requests = requests_of(prompts_with_prefix(5, prefix_blocks=3))
    computed, _ = run(scheduler(grouping=False), {0: requests})
    assert computed == sum(r.num_prompt_tokens for r in requests)


def test_prefix_caching_off_changes_nothing():
    requests = requests_of(prompts_with_prefix(5, prefix_blocks=3))
    expected = reference_outputs(requests)
    s = scheduler(prefix_cache=False)
    assert s.arrival_groups is None
    computed, first = run(s, {0: requests})
    assert computed == sum(r.num_prompt_tokens for r in requests)
    assert set(first.values()) == {0}
    assert all(r.shared_prefix is None for r in requests)
    assert {r.request_id: r.output_token_ids for r in requests} == expected


def test_a_lone_request_is_scheduled_in_the_first_step():
    shared = requests_of(prompts_with_prefix(3, prefix_blocks=3, seed=1))
    lone = requests_of([[7] * 9 + [1, 2, 3]], tag="lone")
    s = scheduler()
    computed, first = run(s, {0: shared + lone})
    assert first["lone0"] == 0 and lone[0].shared_prefix is None
    assert computed == 3 * BS + sum(r.num_prompt_tokens - 3 * BS for r in shared) + 12


def test_arrivals_over_steps_wait_for_the_prefix_in_flight_and_reuse_it():
    """a's 6-block prefix is computed over several 8-token chunks; b arrives while it is being
    computed and waits for it instead of computing it; c arrives after a finished and reuses
    the cached blocks."""
    a, b, c = requests_of(prompts_with_prefix(3, prefix_blocks=6, seed=2), max_tokens=3)
    expected = reference_outputs([a, b, c])
    s = scheduler(budget=8)
    computed, first = run(s, {0: [a], 1: [b], 20: [c]})
    suffixes = sum(r.num_prompt_tokens - 6 * BS for r in (a, b, c))
    assert computed == 6 * BS + suffixes
    assert first["r0"] == 0 and first["r1"] <= 4  # a's 24 prefix tokens take 3 steps of 8
    assert b.num_cached_tokens == 6 * BS and c.num_cached_tokens == 6 * BS
    assert {r.request_id: r.output_token_ids for r in (a, b, c)} == expected


def test_a_shorter_common_part_than_the_group_prefix_is_not_joined():
    long_group = requests_of(prompts_with_prefix(2, prefix_blocks=4, seed=3), tag="g")
    partial = Request(
        "p", long_group[0].prompt_token_ids[: 2 * BS] + [5, 6, 7], long_group[0].sampling_params
    )
    s = scheduler(budget=8)
    for r in long_group:
        s.add_request(r)
    step(s)
    s.add_request(partial)
    step(s)
    assert partial.shared_prefix is None  # it starts from the radix cache instead
    run(s, {0: []})


def test_finished_owners_leave_the_index():
    a, b = requests_of(prompts_with_prefix(2, prefix_blocks=3, seed=4))
    s = scheduler()
    run(s, {0: [a]})
    assert not s.arrival_groups._index and not s.arrival_groups._keys
    s.add_request(b)
    s.abort_requests(["r1"])
    run(s, {0: []})
    assert not s.arrival_groups._index


def test_a_hash_collision_shares_nothing(monkeypatch):
    """Index hits are confirmed on the tokens: a request whose hash collides is not grouped."""
    import phloem.core.arrival_groups as ag

    monkeypatch.setattr(ag, "block_hashes", lambda tokens, bs: [1] * ((len(tokens) - 1) // bs))
    a = requests_of([[1] * 13], tag="a")[0]
    b = requests_of([[2] * 13], tag="b")[0]
    s = scheduler()
    s.add_request(a)
    step(s)
    s.add_request(b)
    step(s)
    assert b.shared_prefix is None and a.shared_prefix is None


def test_block_hashes_leave_one_token():
    assert len(block_hashes(list(range(12)), 4)) == 2
    assert len(block_hashes(list(range(13)), 4)) == 3
    assert block_hashes([1, 2, 3, 4, 9], 4) == block_hashes([1, 2, 3, 4, 8], 4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grouped_outputs_match_through_async_updates(async_scheduling):
    """With async scheduling the update of step N comes after scheduling N+1: members still
    wait for the leader, outputs are the reference's."""
    requests = requests_of(prompts_with_prefix(6, prefix_blocks=3, seed=5), max_tokens=5)
    expected = reference_outputs(requests)
    s = scheduler(budget=16, async_scheduling=async_scheduling)
    for r in requests:
        s.add_request(r)
    pending = None  # the step launched before (async: updated after the next is scheduled)
    while s.has_unfinished_requests() or pending is not None:
        out = s.schedule()
        if pending is not None:
            s.update_from_output(pending, fake_sampled(s, pending))
        pending = out if out.scheduled else None
        if not async_scheduling and pending is not None:
            s.update_from_output(pending, fake_sampled(s, pending))
            pending = None
        s.check_integrity()
    assert {r.request_id: r.output_token_ids for r in requests} == expected


# -- prefill cap (item 3) -------------------------------------------------------------------------


def test_prefill_cap_bounds_prompt_tokens_while_streams_decode():
    decoders = requests_of([[i + 1] * 5 for i in range(3)], max_tokens=30, tag="d")
    long = requests_of([list(range(1, 200))], max_tokens=2, tag="long")[0]
    s = scheduler(budget=64, max_prefill_tokens_per_step=16)
    for r in decoders:
        s.add_request(r)
    step(s)
    s.add_request(long)
    for _ in range(5):
        out = s.schedule()
        rows = {x.seq_id: x.num_tokens for x in out.scheduled}
        assert all(rows[r.request_id] == 1 for r in decoders)  # every decode, every step
        assert rows["long0"] == 16
        s.update_from_output(out, fake_sampled(s, out))


def test_a_burst_lifts_the_cap_until_its_queue_is_empty():
    from phloem.core.prefill_cap import BURST_BUDGETS

    decoders = requests_of([[i + 1] * 5 for i in range(3)], max_tokens=60, tag="d")
    s = scheduler(budget=64, max_prefill_tokens_per_step=16)
    for r in decoders:
        s.add_request(r)
    step(s)
    burst = requests_of([[i + 10] * 40 for i in range(8)], max_tokens=2, tag="b")  # 320 tokens
    assert 40 * 8 > BURST_BUDGETS * 64
    for r in burst:
        s.add_request(r)

    def prompt_tokens_of_steps(n: int) -> list[int]:
        tokens = []
        for _ in range(n):
            out = s.schedule()
            tokens.append(sum(x.num_tokens for x in out.scheduled if x.num_tokens > 1))
            s.update_from_output(out, fake_sampled(s, out))
            s.check_integrity()
        return tokens

    # 320 tokens wait: the whole budget after the decodes, also once the backlog left fits in
    # 4 budgets (capped, its last prompts would start one a step), until the queue is empty;
    # then the rest of the last one's prompt is capped
    first = prompt_tokens_of_steps(5)
    assert first[0] == 64 - 3 and min(first) > 16 and not s.waiting
    rest = prompt_tokens_of_steps(3)
    assert rest[0] == 16 and max(rest) == 16
    late = requests_of([list(range(1, 100))], max_tokens=2, tag="late")[0]
    s.add_request(late)  # arrives after the burst: capped again
    assert prompt_tokens_of_steps(2) == [16, 16]


def test_no_cap_without_streams_and_the_default_takes_the_budget():
    long = requests_of([list(range(1, 200))], max_tokens=2, tag="long")[0]
    s = scheduler(budget=64, max_prefill_tokens_per_step=16)
    s.add_request(long)
    assert step(s).scheduled[0].num_tokens == 64  # nobody streams: the whole budget
    decoders = requests_of([[i + 1] * 5 for i in range(3)], max_tokens=30, tag="d")
    s = scheduler(budget=64)
    for r in decoders:
        s.add_request(r)
    step(s)
    s.add_request(long.__class__(long.request_id, long.prompt_token_ids, long.sampling_params))
    rows = {x.seq_id: x.num_tokens for x in step(s).scheduled}
    assert rows["long0"] == 64 - 3


def test_cap_keeps_decodes_behind_a_running_prefill():
    """A prompt chunk ahead of the streams in the running order (as after a readmission) leaves
    one token for each decode behind it, even when the cap alone would not."""
    decoders = requests_of([[i + 1] * 3 for i in range(4)], max_tokens=20, tag="d")
    s = scheduler(budget=32, max_prefill_tokens_per_step=1000)
    for r in decoders:
        s.add_request(r)
    step(s)
    first = requests_of([list(range(1, 300))], max_tokens=2, tag="p")[0]
    s.add_request(first)
    step(s)
    s.running.remove(first)
    s.running.insert(0, first)
    rows = {x.seq_id: x.num_tokens for x in step(s).scheduled}
    assert rows["p0"] == 32 - 4 and all(rows[r.request_id] == 1 for r in decoders)


def test_cap_needs_chunked_prefill():
    from phloem.config import SchedulerConfig

    with pytest.raises(ValueError, match="max_prefill_tokens_per_step"):
        SchedulerConfig(
            max_prefill_tokens_per_step=8, enable_chunked_prefill=False, max_num_batched_tokens=8192
        ).validate()
    with pytest.raises(ValueError, match="max_prefill_tokens_per_step"):
        SchedulerConfig(max_prefill_tokens_per_step=0).validate()


def test_ids_the_planner_refuses_only_skip_the_grouping():
    """Token ids outside [0, 2**32) (the planner's encoding) leave the arrivals ungrouped among
    themselves; scheduling goes on."""
    prefix = [2**33 + i for i in range(3 * BS)]
    requests = requests_of([prefix + [1, 2], prefix + [3, 4]])
    computed, first = run(scheduler(), {0: requests})
    assert computed == sum(r.num_prompt_tokens for r in requests) and set(first.values()) == {0}
