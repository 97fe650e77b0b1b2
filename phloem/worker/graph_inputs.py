"""The static input rows a graph runner's captured steps read (decode, verify and piecewise
graphs): token ids, positions and slot mapping in one int64 [3, rows] device buffer whose
address the graphs keep, and the choice of a step's bucket.

    rows |-- the padded step's tokens --|-- unused (stale from an earlier, larger step) --|

Before a capture every row is token 0 at position 0 writing the scratch slot; before a replay
the padded step's host lists are copied into its first rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from phloem.ops.staging import pinned
from phloem.worker.input_batch import HostStep


def smallest_bucket(sizes: Iterable[int], num: int) -> int | None:
    """The first of the ascending `sizes` that is >= `num` (sequences or tokens), or None when
    there is none."""
    for size in sizes:
        if size >= num:
            return size
    return None


class GraphInputs:
    """The static input buffer (module docstring).

    Args:
        rows: tokens of the largest captured step; device: where the buffer lives.
    Attributes:
        buffer: int64 [3, rows]: input ids, positions, slots.
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        self.buffer = torch.zeros(3, rows, dtype=torch.int64, device=device)

    def ids(self, rows: int) -> torch.Tensor:
        """The first `rows` input ids (a view)."""
        return self.buffer[0, :rows]

    def positions(self, rows: int) -> torch.Tensor:
        """The first `rows` positions (a view)."""
        return self.buffer[1, :rows]

    def slots(self, rows: int) -> torch.Tensor:
        """The first `rows` slots of the slot mapping (a view)."""
        return self.buffer[2, :rows]

    def reset(self, scratch_slot: int) -> None:
        """For a capture: every row becomes token 0 at position 0 writing `scratch_slot`."""
        self.buffer.zero_()
        self.buffer[2].fill_(scratch_slot)

    def load(self, step: HostStep) -> None:
        """Copy a padded step's T input ids, positions and slots into the first T rows."""
        self.load_rows(np.stack((step.input_ids, step.positions, step.slots)))

    def load_rows(self, inputs: np.ndarray) -> None:
        """Copy int64 [3, T] host rows (ids, positions, slots) into the first T rows: a
        non-blocking copy from pinned host memory, enqueued on the current stream."""
        self.buffer[:, : inputs.shape[1]].copy_(pinned(inputs), non_blocking=True)
