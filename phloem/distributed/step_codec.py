"""The bytes of one step as the tensor-parallel driver sends it to the other ranks: a
`SchedulerOutput` pickled with each `ScheduledSequence` flattened to a tuple of its fields.

Pickling the dataclasses themselves costs ~3 us a sequence (a 2,048-sequence decode step: ~6 ms
on the driver's critical path); tuples of plain values cost ~0.3 us. The fields are read from
the dataclasses' own declarations, so a field added to either class travels too.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
from typing import Any

from phloem.core.scheduler_output import ScheduledSequence, SchedulerOutput

_SEQ_FIELDS = tuple(f.name for f in dataclasses.fields(ScheduledSequence))
_OUT_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerOutput) if f.name != "scheduled")
_seq_row = operator.attrgetter(*_SEQ_FIELDS)
_out_rest = operator.attrgetter(*_OUT_FIELDS)


def encode_step(header: tuple[Any, ...], sched: SchedulerOutput) -> bytes:
    """`header` (plain picklable values) and `sched` as one bytes message."""
    rows = [_seq_row(s) for s in sched.scheduled]
    return pickle.dumps((header, rows, _out_rest(sched)), pickle.HIGHEST_PROTOCOL)


def decode_step(data: bytes) -> tuple[tuple[Any, ...], SchedulerOutput]:
    """The (header, SchedulerOutput) of `encode_step`'s bytes (equal to the encoded ones)."""
    header, rows, rest = pickle.loads(data)
    scheduled = [ScheduledSequence(*row) for row in rows]
    return header, SchedulerOutput(scheduled, **dict(zip(_OUT_FIELDS, rest)))
