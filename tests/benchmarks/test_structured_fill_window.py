"""The structured-output benchmarks' per-quarter view of a decode (`by_quarter`): the GPU
benchmark's schema makes masks ~17x dearer in the last quarter of a 128-token walk than in the
first, so a fill measured over the first 64 steps (8.8 ms on the H200 host) says little about
the engine's 128-step run (26-28 ms; benchmarks/results/2026-11-27h-cpu-fill-gap). Both
benchmarks report fills by quarter through this one function."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import grammar_fill_threads  # noqa: E402
import structured_outputs  # noqa: E402


def test_by_quarter_means_in_step_order_remainder_last():
    assert structured_outputs.by_quarter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == [
        1.5,
        3.5,
        5.5,
        7.5,
    ]
    # 10 steps: quarters of 2, the last takes the 4 left over
    assert structured_outputs.by_quarter([float(i) for i in range(10)]) == [0.5, 2.5, 4.5, 7.5]
    assert structured_outputs.by_quarter([1.0, 2.0, 3.0]) == []


def test_fill_threads_reports_quarters_of_every_step():
    """`grammar_fill_threads` keeps each step's fill and advance and reports them by quarter
    (the window the engine's run covers), from the benchmark's own helper."""
    assert grammar_fill_threads.by_quarter is structured_outputs.by_quarter

    class Backend:
        def fill_bitmasks(self, matchers, bitmask, rows):
            pass

        def advance(self, matchers, tokens):
            return [False] * len(matchers)

    config = {"backend": Backend(), "bitmask": None}
    state = {"matchers": [object(), object()], "crc": 0, "fill_ms": 0.0, "fill_cpu_ms": 0.0,
             "fill_vcsw": 0, "advance_ms": 0.0, "masks": 0, "fill_steps": [],
             "advance_steps": []}  # fmt: skip
    for _ in range(8):
        grammar_fill_threads._step(config, state, [0, 1], [5, 6], digest=False)
    assert len(state["fill_steps"]) == len(state["advance_steps"]) == 8
    assert abs(sum(state["fill_steps"]) - state["fill_ms"]) < 1e-9
    assert len(structured_outputs.by_quarter(state["fill_steps"])) == 4
