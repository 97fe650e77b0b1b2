"""Admission's balanced waves: a queue that needs a bit more KV than the pool runs as two equal
waves, not a full pool and a remainder that decodes alone; never a preemption, the same outputs;
short decodes (prefill-heavy shapes) are scheduled exactly as by finishing size alone."""

from __future__ import annotations

from phloem.config import SchedulerConfig
from phloem.core.admission import Admission
from phloem.core.kv_manager import KVManager
from phloem.core.prefix_groups import PrefixGroups
from phloem.core.scheduler import Scheduler
from tests.core.test_prefix_sharing import grouped_workload, planned_requests
from tests.core.test_prefix_sharing import run as run_planned
from tests.core.test_scheduler import reference_outputs, req, run_to_completion


def scheduler(balanced: bool, num_blocks: int = 50) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=256)
    kv = KVManager(num_blocks, block_size=4)
    return Scheduler(config, kv, PrefixGroups(kv, Admission(config, kv, balanced_waves=balanced)))


def run(balanced: bool, max_tokens: int) -> tuple[list, dict, int]:
    """Five requests of 8 prompt tokens; with 40 outputs each needs 12 blocks at its end and the
    50-block pool holds 4 of them: (steps, outputs, preemptions)."""
    s = scheduler(balanced)
    requests = [req(f"r{i}", 8, max_tokens=max_tokens, seed_token=i) for i in range(5)]
    for r in requests:
        s.add_request(r)
    steps = run_to_completion(s)
    outputs = {r.request_id: r.output_token_ids for r in requests}
    assert outputs == reference_outputs(requests)
    return steps, outputs, s.num_preemptions


def test_balanced_waves_leave_no_lone_remainder():
    finish_steps, finish_out, finish_preempted = run(balanced=False, max_tokens=40)
    steps, outputs, preempted = run(balanced=True, max_tokens=40)
    assert finish_preempted == preempted == 0
    assert outputs == finish_out
    # by finishing size: 4 requests, then the fifth decodes alone for most of its 40 tokens
    assert max(map(len, finish_steps)) == 4
    assert sum(len(step) == 1 for step in finish_steps) >= 35
    # balanced: waves of 2 and 3 (cap = 60 blocks / 2 waves = 30 blocks: 2 requests)
    assert max(map(len, steps)) == 3
    assert sum(len(step) == 1 for step in steps) <= 2


def test_short_decodes_are_not_balanced():
    """4 outputs: each request decodes fewer steps than 2 x pool x block size / budget = 12.5,
    so the waves are not balanced: the very same schedule."""
    assert run(balanced=False, max_tokens=4)[0] == run(balanced=True, max_tokens=4)[0]


def test_balanced_waves_default_and_env(monkeypatch):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    kv = KVManager(50, block_size=4)
    monkeypatch.delenv("PHLOEM_BALANCED_WAVES", raising=False)
    assert Admission(config, kv).balanced_waves
    monkeypatch.setenv("PHLOEM_BALANCED_WAVES", "0")
    assert not Admission(config, kv).balanced_waves
    assert Admission(config, kv, balanced_waves=True).balanced_waves


def test_balanced_waves_keep_each_group_prefix_computed_once():
    """3 groups x 4 members (prefix 32 tokens, 4 own, 40 outputs: 11 own blocks each) over 100
    blocks: the queue needs 1.6 pools, so the waves are capped; each prefix is still computed
    once, nothing is preempted, the outputs are the reference's."""
    prompts, max_tokens = grouped_workload(
        num_groups=3, degree=4, prefix_len=32, suffix_len=4, max_tokens=40
    )
    results = {}
    for balanced in (False, True):
        plan, requests = planned_requests(prompts, max_tokens, block_size=4)
        s = scheduler(balanced, num_blocks=100)
        most: list[int] = []

        def count(sch, _, most=most):
            most.append(len(sch.running))

        computed = run_planned(s, requests, check=count)
        assert computed == plan.num_physical_prompt_tokens
        assert s.num_preemptions == 0
        results[balanced] = ({r.request_id: r.output_token_ids for r in requests}, max(most))
    assert results[True][0] == results[False][0] == reference_outputs(requests)
    assert results[True][1] < results[False][1]
