"""The grammar process's bitmask in shared memory (`grammar_process.py`): one
`multiprocessing.shared_memory` segment holds two int32 [rows, W] buffers, laid one after the
other, which the manager in the grammar process fills in turn and the engine reads in place.

    |-- buffer 0: rows x W words --|-- buffer 1: rows x W words --|

The engine creates a segment (`BitmaskSegment`, page-locked for CUDA copies where asked) and
unlinks it; the grammar process attaches it by name (`AttachedSegment`). Imports no torch
(`host_register` and `BitmaskSegment.release` import it when pinning).
"""

from __future__ import annotations

import logging
import os
from multiprocessing import shared_memory

import numpy as np

logger = logging.getLogger(__name__)


def shared_views(buf, max_rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The two int32 [max_rows, width] bitmask buffers laid one after the other in `buf`."""
    size = max_rows * width * 4
    return tuple(  # type: ignore[return-value]
        np.ndarray((max_rows, width), dtype=np.int32, buffer=buf, offset=k * size) for k in range(2)
    )


def shared_memory_fits(num_bytes: int, path: str = "/dev/shm") -> bool:
    """Whether `path` (where POSIX shared memory lives on Linux) has `num_bytes` free: a
    segment larger than that is created, but writing past the free space kills the process
    (SIGBUS; a container's /dev/shm is often 64 MB)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return True  # not Linux: the platform allocates it
    return stat.f_bavail * stat.f_frsize >= num_bytes


class BitmaskSegment:
    """A shared-memory segment of two int32 [rows, W] bitmask buffers, page-locked with `pin`.

    Raises:
        ValueError: /dev/shm has no room for it (`shared_memory_fits`).
    """

    def __init__(self, rows: int, width: int, pin: bool) -> None:
        num_bytes = 2 * rows * width * 4
        if not shared_memory_fits(num_bytes):
            raise ValueError(f"/dev/shm has no room for the grammar bitmask ({num_bytes} bytes)")
        self.shm = shared_memory.SharedMemory(create=True, size=num_bytes)
        self.rows = rows
        self.views: tuple[np.ndarray, np.ndarray] | None = shared_views(self.shm.buf, rows, width)
        self.registered = host_register(self.views[0], num_bytes) if pin else None

    def release(self) -> None:
        """Unpin, close and unlink (a view still referenced keeps its mapping until collected)."""
        self.views = None
        if self.registered is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = None
        try:
            self.shm.close()
        except BufferError:
            pass
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


class AttachedSegment:
    """A `BitmaskSegment` attached by name in the grammar process: its two buffers' views."""

    def __init__(self, name: str, rows: int, width: int) -> None:
        self.shm = shared_memory.SharedMemory(name=name)
        self.views = shared_views(self.shm.buf, rows, width)
        self.first = self.views[0].ctypes.data  # a fill names the buffer it wrote

    def close(self) -> None:
        self.views = None  # type: ignore[assignment]
        try:
            self.shm.close()
        except BufferError:  # a view still referenced: unmapped when it is collected
            pass


def host_register(view: np.ndarray, num_bytes: int) -> int | None:
    """Page-lock `num_bytes` from `view`'s first byte for CUDA copies (`cudaHostRegister`);
    its address, or None when CUDA refused (the worker's copy is then staged)."""
    import torch

    address = view.ctypes.data
    error = torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)
    if int(error) != 0:
        logger.warning("cudaHostRegister of the grammar bitmask failed (%s)", error)
        return None
    return address
