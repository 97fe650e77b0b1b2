"""This process's place in the tensor-parallel group: its rank, the group's size and the
`torch.distributed` process group (NCCL on CUDA, gloo on the CPU).

A process holds one group at a time. Until `init_tensor_parallel` runs (and after
`destroy_tensor_parallel`) the rank is 0 and the size 1, and the collectives of
`phloem.distributed.communication` are no-ops. Layers read `tp_rank()` / `tp_size()` when they are
built, so a model must be built after the group is set up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phloem.distributed.fused_norm_all_reduce import FUSED_DTYPES, FusedAllReduceNorm
from phloem.distributed.symm_all_reduce import OneShotAllReduce, all_reduce_choice
from phloem.distributed.symm_norm_all_reduce import SymmNormAllReduce
from phloem.distributed.symm_norm_all_reduce import rows_for as symm_norm_rows

logger = logging.getLogger(__name__)

# a collective waits at most this long for the other ranks [s] (a dead peer is noticed sooner:
# gloo raises when its connection closes, and the driver aborts an NCCL group on a death)
COLLECTIVE_TIMEOUT_S = 1800.0
# Seconds `destroy_tensor_parallel` waits for the group's teardown before aborting it.
DESTROY_TIMEOUT_S = 30.0
# True once this process has joined a torch symmetric-memory rendezvous, in any group (never reset:
# torch's rendezvous state outlives the group; see `symm_mem_setup`)
_symm_mem_joined = False


@dataclass(frozen=True)
class TensorParallelState:
    """rank in [0, size); group: the process group (None while size is 1 or in a layer test);
    small_all_reduce: the symmetric-memory all-reduce for small messages, or None (NCCL or
    gloo for every message; `phloem.distributed.symm_all_reduce`); all_reduce: the
    PHLOEM_TP_ALLREDUCE choice; fused_norm: the all-reduce + add + RMSNorm kernel
    (`fused_norm_all_reduce.FusedAllReduceNorm` or `symm_norm_all_reduce.SymmNormAllReduce`, set
    by `init_fused_norm_all_reduce`), or None."""

    rank: int = 0
    size: int = 1
    group: Any = None
    backend: str = ""
    small_all_reduce: Any = None
    all_reduce: str = "nccl"
    fused_norm: Any = None


_state = TensorParallelState()


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 without a group)."""
    return _state.rank


def tp_size() -> int:
    """The tensor-parallel group's size (1 without a group)."""
    return _state.size


def tp_group() -> Any:
    """The process group of the tensor-parallel ranks (None without one)."""
    return _state.group


def tp_small_all_reduce() -> Any:
    """The group's `OneShotAllReduce` for small CUDA messages, or None."""
    return _state.small_all_reduce


# the PHLOEM_TP_ALLREDUCE choices whose norms all-reduce their input (fused with add + norm)
_NORM_CHOICES = ("fused_norm", "symm_norm")


def tp_defers_all_reduce_to_norms() -> bool:
    """Whether row-parallel layers leave their all-reduce to the RMSNorm that consumes their
    output (PHLOEM_TP_ALLREDUCE=fused_norm or symm_norm in a group of several ranks, any
    backend)."""
    return _state.size > 1 and _state.all_reduce in _NORM_CHOICES


def tp_fused_norm_all_reduce() -> Any:
    """The group's fused all-reduce + residual add + RMSNorm (`FusedAllReduceNorm` or
    `SymmNormAllReduce`: `fits(x, residual)`, `(x, residual, weight, eps, slot)` -> (normed,
    residual)), or None (the norm then all-reduces through `communication.tp_all_reduce` and
    normalizes)."""
    return _state.fused_norm


def init_fused_norm_all_reduce(hidden_size: int, dtype: torch.dtype) -> None:
    """Set up the fused all-reduce + add + RMSNorm kernel for rows of `hidden_size` in `dtype`
    (the model's; float32 models keep the group's all-reduce) when the group runs NCCL and
    PHLOEM_TP_ALLREDUCE is fused_norm (FlashInfer's kernel) or symm_norm (phloem's, up to
    `symm_norm_all_reduce.rows_for` rows); otherwise nothing. Collective: every rank calls it
    at the same point, after the model is built. Messages of up to PHLOEM_TP_ALLREDUCE_MAX_KB
    take it. symm_norm stays off, with a warning, in a group where a rank joined a
    symmetric-memory rendezvous in an earlier group (`symm_mem_setup`: a second engine of one
    process).

    Raises:
        ImportError, RuntimeError: from the kernel's set-up (FlashInfer or Triton missing, no
            peer access).
    """
    global _state
    if not (tp_defers_all_reduce_to_norms() and _state.backend == "nccl"):
        return
    if dtype not in FUSED_DTYPES:
        return
    choice, max_bytes = all_reduce_choice()
    max_tokens = max(1, max_bytes // (2 * hidden_size))  # 2-byte rows
    if choice == "symm_norm":
        max_tokens = symm_norm_rows(hidden_size, _state.size, max_bytes)
        if max_tokens == 0:
            logger.warning("symm_norm takes no rows of %d columns: the group's all-reduce serves "
                           "every norm", hidden_size)  # fmt: skip
            return
        device = torch.device("cuda", torch.cuda.current_device())
        group = _state.group
        fused: Any = symm_mem_setup(
            group, device, lambda: SymmNormAllReduce(group, device, hidden_size, max_tokens, dtype),
            "symm_norm",
        )  # fmt: skip
        if fused is None:
            return
    else:
        fused = FusedAllReduceNorm(
            _state.group, _state.rank, _state.size, hidden_size, max_tokens, dtype
        )
    _state = dataclasses.replace(_state, fused_norm=fused)
    logger.info("tensor parallel: %s all-reduce + RMSNorm for up to %d tokens", choice, max_tokens)


def symm_mem_setup(group, device: torch.device, build: Callable[[], Any], what: str) -> Any:
    """`build()` (a constructor that joins a torch symmetric-memory rendezvous over `group`) when
    every rank of `group` can join one, else None on every rank, with a warning (the group's
    all-reduce then serves). Collective: every rank of `group` calls it at the same point; it
    all-reduces one flag on `device` (CUDA for NCCL, the CPU for gloo). Sets `_symm_mem_joined`.

    A rank can join only if no rank of the group has joined a rendezvous before, in an earlier
    group. Torch names a rendezvous's store keys by per-process sequence numbers (`StoreExchange`
    in CUDASymmetricMemory, the `rendezvous` counters of SymmetricMemory.cpp) and keeps the store
    it registered for a group name for the life of the process (`enable_symm_mem_for_group` does
    nothing for a name it has seen), while a process group made again gets the same name ("0").
    The driver (rank 0) lives on from engine to engine and ranks 1.. are new processes, so in a
    second engine of one process the driver and its new peers wait for each other's keys, under
    other numbers (and, in torch versions that read the registered store, in the first group's
    store), in C++ for the store's timeout (COLLECTIVE_TIMEOUT_S): the symm_norm GPU test's third
    engine hung there (benchmarks/results/2026-11-27c-cpu-symm-norm-hang).

    Args:
        group: the process group; device: where the flag is all-reduced.
        build: the set-up, called only where every rank will call it; what: its name, for logs.
    Returns:
        build()'s result, or None.
    """
    global _symm_mem_joined
    fresh = torch.tensor([0 if _symm_mem_joined else 1], dtype=torch.int32, device=device)
    dist.all_reduce(fresh, op=dist.ReduceOp.MIN, group=group)
    if not int(fresh.item()):
        logger.warning(
            "tensor parallel: %s is off for this group (the group's all-reduce serves): a rank "
            "(the driver, after an earlier engine in this process) joined a symmetric-memory "
            "rendezvous before, and torch cannot rendezvous it again with new peers; start the "
            "engine in a new process to use it", what)  # fmt: skip
        return None
    _symm_mem_joined = True  # before the rendezvous: a partial one leaves torch's state behind too
    logger.info("tensor parallel: %s joins a symmetric-memory rendezvous", what)
    return build()


def tp_backend() -> str:
    """ "nccl", "gloo", or "" without a group."""
    return _state.backend


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str) -> None:
    """Join the group of `size` ranks as `rank` (blocks until every rank has joined). With NCCL
    the rank's device is CUDA device `rank` (made current first) and the communicator is
    created now, not at the first collective.

    Args:
        init_method: the rendezvous, e.g. "tcp://127.0.0.1:PORT" (rank 0 hosts the store).
        backend: "nccl" (CUDA) or "gloo" (CPU).
    With NCCL and PHLOEM_TP_ALLREDUCE=symm_mem, every rank also sets up the symmetric-memory
    all-reduce for small messages here (collectively; not where a rank joined a symmetric-memory
    rendezvous in an earlier group: `symm_mem_setup`).

    Raises:
        RuntimeError: this process already belongs to a process group (one started by torchrun,
            or an earlier engine's that was not closed).
        ValueError: for a rank outside [0, size).
    """
    global _state
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} outside [0, {size})")
    if dist.is_initialized():
        raise RuntimeError(
            "tensor_parallel_size > 1 starts its own torch.distributed process group, but this "
            "process already has one (close the other engine, or run without torchrun)"
        )
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    device = None
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timeout,
        device_id=device,
    )
    small = None
    choice, max_bytes = all_reduce_choice()
    if device is not None and choice == "symm_mem":  # device: set for nccl only
        world = dist.group.WORLD
        small = symm_mem_setup(
            world, device, lambda: OneShotAllReduce(world, device, max_bytes), "symm_mem"
        )
    _state = TensorParallelState(rank, size, dist.group.WORLD, backend, small, choice)


def destroy_tensor_parallel(timeout_s: float = DESTROY_TIMEOUT_S) -> None:
    """Leave the group (idempotent); the state goes back to rank 0 of 1. Never waits longer than
    about `timeout_s` seconds [s] per teardown call.

    Every member calls it when the group ends (the driver after sending "stop", each rank on
    "stop"), after freeing its CUDA graphs (`Worker.release_cuda_graphs`): a graph that captured
    the group's collectives keeps the communicator referenced, and tearing the group down then
    hangs (pytorch/pytorch#115388). An NCCL group is aborted (`ncclCommAbort`: local, it neither
    waits for the peers, which may have exited already, nor for their in-flight work); a graceful
    NCCL teardown (`destroy_process_group`) waits for every peer. A gloo group is destroyed, and
    aborted if the teardown still runs after `timeout_s` (a peer died). A teardown that does not
    return in time is left running in a daemon thread, with a warning."""
    global _state
    backend, fused, _state = _state.backend, _state.fused_norm, TensorParallelState()
    if fused is not None:
        fused.close()
    if not dist.is_initialized():
        return
    if backend == "nccl":
        if not finished_within(abort_tensor_parallel, timeout_s):
            logger.warning(
                "aborting the NCCL group did not finish in %.0f s; left to exit", timeout_s
            )
            return
        if not dist.is_initialized():
            return
    if not finished_within(dist.destroy_process_group, timeout_s) and not finished_within(
        abort_tensor_parallel, timeout_s
    ):
        logger.warning(
            "leaving the %s group did not finish in %.0f s; left to exit", backend, 2 * timeout_s
        )


def finished_within(fn: Callable[[], object], timeout_s: float) -> bool:
    """Run `fn` in a daemon thread; True when it returned within `timeout_s` seconds [s] (a call
    still running after that is left running: nothing can stop a thread blocked in C++)."""
    thread = threading.Thread(target=fn, name=f"phloem-tp-{fn.__name__}", daemon=True)
    thread.start()
    thread.join(timeout=timeout_s)
    return not thread.is_alive()


def abort_tensor_parallel() -> None:
    """Abort the group's pending collectives (from another thread, when a rank died: an NCCL
    collective waiting for a dead peer would otherwise wait out its timeout), and make the fused
    all-reduce's barriers give up (`SymmNormAllReduce.abort`: a spinning kernel would otherwise
    never end). Best effort."""
    fused = _state.fused_norm
    if fused is not None:
        fused.abort()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()


@contextlib.contextmanager
def tensor_parallel_layout(rank: int, size: int) -> Iterator[None]:
    """Build layers as rank `rank` of `size` without a process group (weight-loading tests and
    tools that only shard weights; collectives would fail inside)."""
    global _state
    saved = _state
    _state = TensorParallelState(rank, size)
    try:
        yield
    finally:
        _state = saved
