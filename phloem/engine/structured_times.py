"""Where the engine loop's structured-output work goes (`LoopTimes`): the timers
`engine/structured_outputs.py` adds to, which benchmarks/structured_outputs.py reports per
constrained step (`loop_ms_per_bitmask`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoopTimes:
    """Where the engine loop's structured-output work went since the engine started (seconds of
    wall time; benchmarks read them to tell the host's share of a constrained step).

    Attributes:
        mark_s: `mark` (setting each step's constrained rows; an empty step's wait for held
            requests' grammars included).
        advance_s: `collected` and `advance` (the matchers accepting a step's tokens: on the
            loop, or the loop's hand-over and its wait for the fill thread's advance).
        handover_s: of `advance_s`, `collected`'s hand-over of the advance and the next fill
            to the fill thread (its wait for the thread to begin, and for the GIL while the
            thread gathers the rows before the library's advance releases it).
        advance_wait_s: of `advance_s`, `advance` waiting for the fill thread's advance (the
            rest of the advance after the loop's update, and the thread's Python until the
            library's fill releases the GIL).
        advanced_s: from that hand-over until the thread had the advance's results (the
            latency the loop's `advance` may wait for; with `library_advance_s` of the
            manager's `GrammarStats`, what of it is the library's call).
        fill_s: the bitmask fills themselves (in the fill thread or on the loop; with the
            grammar process, its fills).
        fill_wait_s: the loop blocked in `bitmask` for a fill started in `advance`.
        fill_lag_s: from `collected` (or `advance`) handing the advance and fill (or a fill)
            to the fill thread until the thread began (with the grammar process: sending the
            request until the process read it).
        fill_done_s: from that hand-over until the fill ended (in the thread or the grammar
            process; the latency a step's `bitmask` may wait for).
        num_bitmasks: the steps' bitmasks taken.
    """

    mark_s: float = 0.0
    advance_s: float = 0.0
    handover_s: float = 0.0
    advance_wait_s: float = 0.0
    advanced_s: float = 0.0
    fill_s: float = 0.0
    fill_wait_s: float = 0.0
    fill_lag_s: float = 0.0
    fill_done_s: float = 0.0
    num_bitmasks: int = 0
