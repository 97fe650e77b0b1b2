"""benchmarks/schedule_sim.py runs the real planner and scheduler to completion on a tiny pool,
and its step-time model turns the steps into seconds."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import schedule_sim  # noqa: E402


def sim_args(**kw) -> argparse.Namespace:
    args = dict(workload="batchllm", num_groups=None, degree=None, num_requests=None,
                input_len=None, output_len=None, num_blocks=2000, block_size=16,
                max_num_seqs=8, max_num_batched_tokens=1024)  # fmt: skip
    return argparse.Namespace(**{**args, **kw})


def test_simulation_finishes_and_ends_in_a_decode_tail(capsys):
    steps, scheduler = schedule_sim.simulate(sim_args(num_groups=3, degree=4))
    # 12 requests of 2,200 prompt tokens: prefill needs >= 3 * (2000 + 4 * 200) / 1024 steps;
    # the last request admitted still decodes 99 tokens alone after its prefill step
    assert len(steps) >= 9 + 99
    assert all(kind == "D" for kind, *_ in steps[-99:])
    assert steps[-1][4] >= 1 and max(s[4] for s in steps) <= 8  # the sequence cap holds
    assert scheduler.num_preemptions == 0
    schedule_sim.main(["--num-groups", "3", "--degree", "4", "--num-blocks", "2000",
                       "--max-num-seqs", "8", "--max-num-batched-tokens", "1024"])  # fmt: skip
    assert "decode-only" in capsys.readouterr().out


def test_balanced_waves_shorten_the_decode_heavy_tail():
    """400 requests of 16 + 48 tokens (4 blocks each) over 1,400 blocks: by finishing size 350
    run, then 50 decode at a batch whose steps only read the weights; balanced, two waves of
    200: the same steps, fewer modelled seconds."""
    args = sim_args(workload="decode-heavy", num_requests=400, input_len=16, output_len=48,
                    num_blocks=1400, max_num_seqs=512, max_num_batched_tokens=8192)  # fmt: skip
    finish_steps, finish = schedule_sim.simulate(args, "finish")
    steps, balanced = schedule_sim.simulate(args, "balanced")
    assert finish.num_preemptions == balanced.num_preemptions == 0
    assert [s[1] for s in finish_steps if s[0] == "M"] == [350, 50]
    assert [s[1] for s in steps if s[0] == "M"] == [200, 200]
    seconds = [schedule_sim.summary(*run)["seconds"] for run in ((finish_steps, finish),
                                                                 (steps, balanced))]  # fmt: skip
    assert seconds[1] < 0.9 * seconds[0]


def test_step_model_batch_one_decode():
    """A batch-1 decode step at a short context: ~5.1 ms (overhead + the weights' read)."""
    seconds = schedule_sim.StepModel().seconds(tokens=1, sampled=1, kv_tokens=200,
                                               attention_pairs=0)  # fmt: skip
    assert 5.0e-3 < seconds < 5.3e-3
