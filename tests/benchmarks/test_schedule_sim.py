"""benchmarks/schedule_sim.py runs the real planner and scheduler to completion on a tiny pool."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import schedule_sim  # noqa: E402


def test_simulation_finishes_and_ends_in_a_decode_tail(capsys):
    args = argparse.Namespace(
        workload="batchllm", num_groups=3, degree=4, num_blocks=2000, block_size=16,
        max_num_seqs=8, max_num_batched_tokens=1024,
    )  # fmt: skip
    steps = schedule_sim.simulate(args)
    # 12 requests of 2,200 prompt tokens: prefill needs >= 3 * (2000 + 4 * 200) / 1024 steps;
    # the last request admitted still decodes 99 tokens alone after its prefill step
    assert len(steps) >= 9 + 99
    assert all(kind == "D" for kind, *_ in steps[-99:])
    assert steps[-1][4] >= 1 and max(s[4] for s in steps) <= 8  # the sequence cap holds
    schedule_sim.main(["--num-groups", "3", "--degree", "4", "--num-blocks", "2000",
                       "--max-num-seqs", "8", "--max-num-batched-tokens", "1024"])  # fmt: skip
    assert "decode-only" in capsys.readouterr().out
