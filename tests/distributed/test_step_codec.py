"""The tensor-parallel step message round-trips every field of a `SchedulerOutput`."""

from __future__ import annotations

from phloem.core.scheduler_output import NewSequenceData, ScheduledSequence, SchedulerOutput
from phloem.distributed.step_codec import decode_step, encode_step
from phloem.sampling_params import SamplingParams


def test_step_round_trips():
    new = NewSequenceData([5, 6, 7], [8], SamplingParams(temperature=0.7, seed=3, max_tokens=4))
    sched = SchedulerOutput(
        [
            ScheduledSequence("a", 0, 3, True, [1, 2], 0, -1, new),
            ScheduledSequence("b#1", 16, 1, False, (), 16, 4),
        ],  # fmt: skip
        finished_seq_ids=["c"],
        preempted_seq_ids=["d"],
    )
    header, decoded = decode_step(encode_step(("step", 7, [5, 6]), sched))
    assert header == ("step", 7, [5, 6])
    assert decoded == sched
    assert decode_step(encode_step(("stop",), SchedulerOutput()))[1].is_empty
