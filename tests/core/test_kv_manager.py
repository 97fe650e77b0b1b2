"""KVManager: freeing into the radix cache from the request's locked node leaves the cache, the
ref counts and the free list exactly as inserting its whole sequence from the root does."""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from phloem.config import SchedulerConfig
from phloem.core.kv_manager import KVManager
from phloem.core.request import Request
from phloem.core.scheduler import Scheduler
from phloem.sampling_params import SamplingParams
from tests.core.test_prefix_sharing import grouped_workload, planned_requests
from tests.core.test_radix_tree import snapshot
from tests.core.test_scheduler import fake_sampled


class FromRootKVManager(KVManager):
    """The reference: `free` offers the request's whole sequence to the cache from the root (it
    forgets its locked node first, and unlocks it after, as `free` does)."""

    def free(self, request: Request, cache: bool = False) -> None:
        locked = self._locked_nodes.pop(request.request_id, None)
        super().free(request, cache)
        if locked is not None:
            assert self.prefix_cache is not None
            self.prefix_cache.unlock(locked[0])


def workload(seed: int, block_size: int) -> list[Request]:
    """Planned groups (shared prefixes), then plain requests that share prompt heads with each
    other and with the groups, so the radix cache matches, splits and locks mid-tree."""
    rng = random.Random(seed)
    prompts, max_tokens = grouped_workload(
        rng.randint(1, 3), rng.randint(2, 4), rng.randint(2, 12), rng.randint(1, 6), 0, seed
    )
    max_tokens = [rng.randint(1, 8) for _ in prompts]
    _, requests = planned_requests(prompts, max_tokens, block_size)
    heads = [p[: rng.randint(1, len(p))] for p in prompts] + [[7, 7, 7, 7, 7]]
    for k in range(rng.randint(2, 8)):
        prompt = rng.choice(heads) + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 9))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 8), ignore_eos=True)
        requests.append(Request(f"p{k}", prompt, params))
    return requests


def state(scheduler: Scheduler, out) -> tuple:
    kv = scheduler.kv
    assert kv.prefix_cache is not None
    scheduled = [
        (s.seq_id, s.num_computed_tokens, s.num_tokens, tuple(kv.block_ids(s.seq_id)))
        for s in out.scheduled
    ]
    return (scheduled, out.preempted_seq_ids, snapshot(kv.prefix_cache),
            list(kv.allocator._free), kv.allocator._ref_counts)  # fmt: skip


@settings(max_examples=60, deadline=None)
# a group member readmitted after preemption used to recompute its cached prompt beside the
# cached copy its lock pinned, and preempted itself for ever (12 blocks: PrefixGroups.attach)
@example(seed=1505, block_size=1, num_blocks=12, budget=3, async_scheduling=False)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(12, 40),
    budget=st.integers(3, 24),
    async_scheduling=st.booleans(),
)
def test_free_from_locked_node_matches_free_from_root(
    seed, block_size, num_blocks, budget, async_scheduling
):
    schedulers = []
    for manager in (KVManager, FromRootKVManager):
        config = SchedulerConfig(
            max_num_seqs=random.Random(seed).randint(1, 6),
            max_num_batched_tokens=budget,
            max_model_len=num_blocks * block_size,
            async_scheduling=async_scheduling,
        )
        scheduler = Scheduler(config, manager(num_blocks, block_size, enable_prefix_cache=True))
        for request in workload(seed, block_size):
            if request.num_prompt_tokens < num_blocks * block_size:
                scheduler.add_request(request)
        schedulers.append(scheduler)
    in_flight = [None, None]
    for _ in range(2_000):
        if not any(s.has_unfinished_requests() for s in schedulers) and in_flight[0] is None:
            break
        states = []
        for k, scheduler in enumerate(schedulers):
            out = scheduler.schedule()
            states.append(state(scheduler, out))
            done = in_flight[k] if async_scheduling else out
            if done is not None:
                scheduler.update_from_output(done, fake_sampled(scheduler, done))
            in_flight[k] = (out if out.scheduled else None) if async_scheduling else None
            scheduler.check_integrity()
        assert states[0] == states[1]
        assert snapshot(schedulers[0].kv.prefix_cache) == snapshot(schedulers[1].kv.prefix_cache)
    else:
        raise AssertionError("no progress")
