"""Same-run A/B of source trees, for the CPU benchmarks in benchmarks/.

`run_in_trees` runs a benchmark script's child mode once per tree (a checkout of phloem, e.g.
the commit before a change and the working tree), each in a fresh interpreter whose PYTHONPATH
is that tree, alternating trees within each round so slow periods of a shared machine hit both.
Only the parent imports this module: a child may run a tree from before it existed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_in_trees(script: str, child_args: list[str], trees: str, rounds: int) -> list[dict]:
    """`python script --child TREE *child_args` for each tree of the comma list `trees`, `rounds`
    times, alternating; each child prints its result as the last line of stdout (one JSON
    object). Returns those objects with "tree" (resolved path) and "round" added, in run order.

    Raises:
        subprocess.CalledProcessError: a child exited non-zero.
    """
    runs = []
    for round_ in range(rounds):
        for tree in trees.split(","):
            tree = str(Path(tree).resolve())
            command = [sys.executable, script, "--child", tree, *child_args]
            env = os.environ | {"PYTHONPATH": tree}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1]) | {"tree": tree, "round": round_}
            print(json.dumps(run), flush=True)
            runs.append(run)
    return runs
