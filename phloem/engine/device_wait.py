"""The held constrained step sampled behind a device-side wait for its bitmask's fill
(`PHLOEM_CONSTRAINED_DEVICE_WAIT`, on by default on CUDA since an H200 measured it: 0.837 vs
0.784 of unconstrained at 1,024 x 128, benchmarks/results/2026-11-27f-h200; one process; issue 21).

Without it the engine loop (`engine/structured_outputs.py`) runs, under async scheduling,

    bitmask(N+1): wait for the fill -> sample(N+1) -> launch(N+2) -> collect(N+1)

so the next step's host launch (8 ms for a 1,024-row piecewise step on an H200) and the rest of
the loop sit behind the fill every step, though the fill is shorter than the forward pass it
overlaps (benchmarks/results/2026-11-27e-h200). With it:

    sample(N+1): enqueue [wait for flag >= k | copy the bitmask | mask | draw], no host wait
      -> launch(N+2) -> collect(N+1): apply the fill's host results (failed rows), then update

- The fill of N+1 writes a page-locked buffer chosen by the loop at the hand-over
  (`reserve`, passed to `StructuredOutputManager.bitmask(out=...)`), so the copy can be
  enqueued before the rows exist. When the fill's future completes (its result or its
  exception), its done-callback, on the fill thread after the library's threads joined and
  `bitmask` returned, stores k into the flag (`HostFlag.set`): every row is written before.
- `start` registers that callback before anything is enqueued, then `Executor.sample(...,
  wait=)`: the worker enqueues the wait on its bitmask copy stream (`flag_wait_triton`, a
  bounded spin) and the copy behind it on that stream, then the mask and the draw as before.
- `settle` (from `StructuredOutputs.collected`, after the step's tokens came) takes the fill's
  result: rows the grammar could not constrain fail alone (as `StructuredOutputs.bitmask` does
  before sampling without the switch; the request is in step N+2 either way, scheduled before),
  and a spin that timed out raises RuntimeError (its step read an unfinished mask).
- `release` (drop_held after an exception out of `step()`, `close`) stores the last k: the
  device never waits for a fill that will not be taken. A failed fill sets the flag too (the
  callback runs for exceptions); the exception surfaces in `settle`, as it did in `bitmask`.

One buffer would do: the fill of N+2 starts in `collected(N+1)`, after N+1's tokens came to the
host, which the device produced after N+1's copy (same streams' order), so no fill overwrites a
buffer whose copy has not run. Two alternate anyway, for a step dropped uncollected
(`abort_all`), whose copy may still be queued when the next fill starts.

No deadlock: the flag needs the fill thread, which needs nothing of the loop's but the GIL (its
Python around the library's calls and the callback); the loop holds no lock the thread takes
while it waits. Between `start` and the flag, every host wait of the loop that could reach work
behind the spin releases the GIL: torch's stream and event synchronizations and its copies to
the host (`.cpu()`, `.tolist()`, `.item()`: the ATen bindings release it), Triton's launcher
(the launch itself) and `Future.result`/`Condition.wait` (the host-wait stand-in below). A wait
holding the GIL would stall until the spin's timeout (TIMEOUT_S) and then raise in `settle`,
never hang.

Elsewhere (no GPU; the tests, PHLOEM_CONSTRAINED_DEVICE_WAIT=host) the "device wait" is a host
wait at the same point of the deferred sampling (`HostFlag.wait_on_host`), same order otherwise.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import numpy as np
import torch

from phloem.structured_output.manager import GrammarBitmask

ENV = "PHLOEM_CONSTRAINED_DEVICE_WAIT"
TIMEOUT_S = 10.0  # longest device (or host) wait for one fill [s]; then the step raises


def device_wait_mode() -> str | None:
    """The mode: "device" (PHLOEM_CONSTRAINED_DEVICE_WAIT=1 or unset, with a GPU), "host" (=host:
    the host-wait stand-in on any device), or None (0, or no GPU: the loop waits as before).

    Raises:
        ValueError: the variable is set to anything else."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1", "host"):
        raise ValueError(f"{ENV} must be 0, 1 or host, got {value!r}")
    if value == "1":
        return "device" if torch.cuda.is_available() else None
    return "host" if value == "host" else None


class HostFlag:
    """int32 [2] words, page-locked with `pinned`: word 0 the flag (the last sequence number
    released; never lowered), word 1 the error word (a sequence number whose wait timed out)."""

    def __init__(self, pinned: bool) -> None:
        self.tensor = torch.zeros(2, dtype=torch.int32, pin_memory=pinned)
        self.words = self.tensor.numpy()
        self._changed = threading.Condition()

    def set(self, seq: int) -> None:
        """Release every wait for a sequence number <= `seq` (any thread)."""
        with self._changed:
            if seq > self.words[0]:
                self.words[0] = seq  # one aligned 4-byte store: the device reads it whole
            self._changed.notify_all()

    def wait_on_host(self, seq: int, timeout_s: float) -> None:
        """Block (the GIL released) until the flag is >= `seq`; after `timeout_s` store `seq`
        into the error word and return (the device wait's contract)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.words[0] >= seq, timeout_s):
                self.words[1] = seq

    def timed_out(self, seq: int) -> bool:
        return int(self.words[1]) == seq


class DeviceWait:
    """The deferred sampling's state (module docstring). Args: on_device: the wait is the
    `flag_wait_triton` kernel and the buffers are page-locked (else the host wait)."""

    def __init__(self, on_device: bool, timeout_s: float = TIMEOUT_S) -> None:
        self.on_device, self.timeout_s = on_device, timeout_s
        self.flag = HostFlag(pinned=on_device)
        self._seq = 0  # the last sequence number handed out
        self._buffers: list[np.ndarray] = [np.empty((0, 0), dtype=np.int32)] * 2
        self._turn = 0
        self._reserved: tuple[object, np.ndarray] | None = None  # (step, its fill's buffer)
        # (step, its fill, its sequence number): sampled, its host results not taken yet
        self.pending: tuple[object, concurrent.futures.Future, int] | None = None

    def reserve(self, sched: object, num_rows: int, width: int) -> np.ndarray:
        """int32 [num_rows, width]: where the fill of `sched`, about to be handed over, writes
        (the other buffer than the last call's; grown by doubling; page-locked with a GPU,
        also for the host wait: `bitmask_to_device` copies it in place behind the wait)."""
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer.shape[0] < num_rows or buffer.shape[1] != width:
            shape = (max(num_rows, 2 * buffer.shape[0]), width)
            pin = torch.cuda.is_available()
            buffer = torch.empty(shape, dtype=torch.int32, pin_memory=pin).numpy()
            self._buffers[self._turn] = buffer
        self._reserved = (sched, buffer[:num_rows])
        return buffer[:num_rows]

    def has_buffer(self, sched: object) -> object:
        """`sched` when its fill writes a buffer `reserve` gave, else None (it writes elsewhere)."""
        return sched if self._reserved is not None and self._reserved[0] is sched else None

    def start(self, executor, launched, seq_ids: list[str], fill: concurrent.futures.Future):
        """Enqueue the sampling of `launched` (an engine `LaunchedStep` held for `fill`, the
        rows `seq_ids`) behind the wait for its fill; returns without waiting for the fill."""
        sched = launched.scheduler_output
        assert self._reserved is not None and self._reserved[0] is sched, "no buffer reserved"
        assert self.pending is None, "the step sampled before was never settled"
        buffer, self._reserved = self._reserved[1], None
        self._seq += 1
        seq = self._seq
        self.pending = (sched, fill, seq)
        fill.add_done_callback(lambda _: self.flag.set(seq))  # now, if already done
        grammar = GrammarBitmask(list(seq_ids), buffer)
        executor.sample(launched.handle, grammar, wait=lambda: self._wait(seq))

    def _wait(self, seq: int) -> None:
        """Called by the worker on its bitmask copy stream, before the copy."""
        if self.on_device:
            from phloem.ops.flag_wait_triton import launch

            launch(self.flag.tensor, seq, int(self.timeout_s * 1e9))
        else:
            self.flag.wait_on_host(seq, self.timeout_s)

    def settle(self, sched: object) -> dict[str, str] | None:
        """After the tokens of `sched` were collected: its fill's {seq id: reason} rows to fail,
        or None when `sched` is not the pending step.

        Raises:
            RuntimeError: its wait timed out (the step sampled under an unfinished mask).
            Exception: what its fill raised."""
        pending = self.pending
        if pending is None or pending[0] is not sched:
            return None
        self.pending = None
        _, fill, seq = pending
        _, failed = fill.result()
        if self.flag.timed_out(seq):
            raise RuntimeError(f"the device waited over {self.timeout_s} s for a bitmask fill")
        return failed

    def release(self) -> None:
        """Release every wait enqueued so far and forget the pending step (its fill is waited
        for by the caller)."""
        self.flag.set(self._seq)
        self.pending = self._reserved = None
