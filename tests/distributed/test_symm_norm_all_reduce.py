"""PHLOEM_TP_ALLREDUCE=symm_norm: phloem's one-shot all-reduce + residual add + RMSNorm kernel.

The kernel's per-rank math runs without its barrier, plain tensors standing in for the peers'
symmetric buffers (on the CPU under Triton's interpreter; on one GPU where there is one): the sum
of the ranks' partials plus the residual, then RMSNorm, against a float64 reference. Under the
interpreter two forked processes also run it with the barrier, over shared memory standing in
for the symmetric buffers and signal pads: consecutive calls of several row counts, slots
alternating, the same results on both ranks and every flag back to 0 (the protocol; not the
GPU's memory ordering); a rank whose peer never comes leaves its barrier once its abort flag is
set. Compiled for sm_90 without a GPU: the kernel with its barrier
(system-scope acquire/release atomics) passes ptxas, and the variant the prebuild records is
the one the engine's call launches. NVLink and CUDA-graph replay run on two GPUs
(tests/distributed/test_tp_gpu.py)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from phloem.distributed.symm_all_reduce import all_reduce_choice
from phloem.distributed.symm_norm_all_reduce import MAX_ROWS, rows_for
from phloem.worker.kernel_prebuild import comm_modules, comm_triton_hooks

pytest.importorskip("triton")

EPS = 1e-5
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"


def run_rank(parts, residual, weight, rank: int, slot_offset: int):
    """The kernel as rank `rank` of len(parts) runs it, the peers' buffers filled already:
    (normed, new residual, this rank's buffer after the call), on the CPU."""
    from phloem.distributed.symm_norm_kernel import all_reduce_add_norm

    rows, hidden = residual.shape
    buffers = [torch.zeros(slot_offset + MAX_ROWS * hidden, dtype=residual.dtype, device=DEVICE)
               for _ in parts]  # fmt: skip
    for peer, part in enumerate(parts):
        if peer != rank:
            buffers[peer][slot_offset : slot_offset + rows * hidden] = part.view(-1)
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)
    x, residual, weight = (t.to(DEVICE) for t in (parts[rank], residual, weight))
    out, new_residual = all_reduce_add_norm(x, residual, weight, EPS, table, table, rank,
                                            slot_offset, barrier=False)  # fmt: skip
    return out.cpu(), new_residual.cpu(), buffers[rank].cpu()


@pytest.mark.parametrize("hidden", [4096, 896])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_sum_add_norm_matches_float64(rows, hidden):
    """Each rank's outputs are the float64 reference's within bf16 rounding, the same bits on
    every rank (the sum runs in rank order), and the rank's own partial lands in its slot."""
    gen = torch.Generator().manual_seed(rows * hidden)
    world = 2

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    parts = [randn(rows, hidden) for _ in range(world)]
    residual, weight = randn(rows, hidden), randn(hidden)
    total = sum(p.double() for p in parts) + residual.double()
    slot_offset = MAX_ROWS * hidden  # slot 1
    results = [run_rank(parts, residual, weight, rank, slot_offset) for rank in range(world)]
    for rank, (out, new_residual, buffer) in enumerate(results):
        # one bf16 ulp per rounding (Triton's interpreter truncates, the GPU rounds to nearest):
        # the new residual is rounded once, the output twice (normalized row, times the weight)
        torch.testing.assert_close(new_residual.double(), total, rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(out.double(), rms_norm(new_residual, weight), rtol=2**-6,
                                   atol=1e-6)  # fmt: skip
        assert torch.equal(buffer[slot_offset : slot_offset + rows * hidden], parts[rank].view(-1))
        assert not buffer[:slot_offset].any()  # the other slot is untouched
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_four_ranks_sum_in_rank_order():
    gen = torch.Generator().manual_seed(4)
    parts = [torch.randn(2, 896, generator=gen).to(torch.bfloat16) for _ in range(4)]
    residual, weight = (
        torch.zeros(2, 896, dtype=torch.bfloat16),
        torch.ones(896, dtype=torch.bfloat16),
    )
    total = sum(p.double() for p in parts)
    results = [run_rank(parts, residual, weight, rank, 0) for rank in (0, 3)]
    torch.testing.assert_close(results[0][1].double(), total, rtol=2**-7, atol=1e-6)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def rms_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm of the rows of h in float64."""
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


# (rows, slot) of consecutive calls, as a decode step's norms and the next step's make them
CALLS = [(3, 0), (3, 1), (1, 0), (4, 1), (4, 0), (2, 1), (2, 0), (2, 1)]
HIDDEN, CALL_ROWS = 256, 4


def call_inputs(call: int, rank: int):
    """(this rank's partial, the residual, the weight) of call `call`: the residual and weight
    are the same on every rank."""
    rows = CALLS[call][0]
    own = torch.Generator().manual_seed(100 * call + rank)
    shared = torch.Generator().manual_seed(call)
    return (torch.randn(rows, HIDDEN, generator=own).to(torch.bfloat16),
            torch.randn(rows, HIDDEN, generator=shared).to(torch.bfloat16),
            torch.randn(HIDDEN, generator=shared).to(torch.bfloat16))  # fmt: skip


def rank_process(rank: int, buffers, pads, results) -> None:
    """One forked rank: every call of CALLS with the barrier; its outputs into results[rank]."""
    from phloem.distributed.symm_norm_kernel import all_reduce_add_norm, slot_elements

    buffer_table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    abort = torch.zeros(1, dtype=torch.int32)  # never set
    pad_table = torch.tensor([p.data_ptr() for p in pads] + [abort.data_ptr()], dtype=torch.int64)
    stride = slot_elements(CALL_ROWS, HIDDEN)
    for call, (rows, slot) in enumerate(CALLS):
        out, new_residual = all_reduce_add_norm(*call_inputs(call, rank), EPS, buffer_table,
                                                pad_table, rank, slot * stride)  # fmt: skip
        results[rank, call, :rows] = torch.stack([out, new_residual], dim=1)


@pytest.mark.skipif(not INTERPRETED, reason="CPU processes under Triton's interpreter")
def test_two_ranks_meet_at_the_barrier():
    from phloem.distributed.symm_norm_kernel import slot_elements

    world, stride = 2, slot_elements(CALL_ROWS, HIDDEN)
    buffers = [torch.zeros(2 * stride, dtype=torch.bfloat16).share_memory_() for _ in range(world)]
    pads = [torch.zeros(CALL_ROWS * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    results = torch.zeros(world, len(CALLS), CALL_ROWS, 2, HIDDEN, dtype=torch.bfloat16)
    results.share_memory_()
    context = multiprocessing.get_context("fork")  # the interpreter and phloem imported already
    ranks = [context.Process(target=rank_process, args=(r, buffers, pads, results))
             for r in range(world)]  # fmt: skip
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
        if process.is_alive():  # a barrier that never opens: end this test's own processes
            for p in ranks:
                p.kill()
            pytest.fail("the ranks did not get through their barriers in 60 s")
        assert process.exitcode == 0
    for call, (rows, _) in enumerate(CALLS):
        inputs = [call_inputs(call, r) for r in range(world)]
        total = sum(x.double() for x, _, _ in inputs) + inputs[0][1].double()
        torch.testing.assert_close(
            results[0, call, :rows, 1].double(), total, rtol=2**-7, atol=1e-6
        )
        assert torch.equal(results[0, call], results[1, call])
    assert not any(p.any() for p in pads)  # every flag consumed


def lone_rank(returned) -> None:
    """Rank 0 of two whose peer never runs, its previous flag to the peer not yet consumed: one
    call with the barrier, the abort flag set by a timer. returned[0] = the abort flag as the call
    returned (1: it waited until the abort)."""
    import threading

    from phloem.distributed.symm_norm_kernel import all_reduce_add_norm

    x = torch.ones(1, HIDDEN, dtype=torch.bfloat16)
    buffers = [torch.zeros(HIDDEN, dtype=torch.bfloat16) for _ in range(2)]
    pads = [torch.zeros(2, dtype=torch.int32) for _ in range(2)]
    pads[1][0] = 1  # flag (program 0, from rank 0) on the peer's pad: the arrive spins too
    abort = torch.zeros(1, dtype=torch.int32)
    buffer_table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    pad_table = torch.tensor([p.data_ptr() for p in pads] + [abort.data_ptr()], dtype=torch.int64)
    threading.Timer(0.5, abort.fill_, args=(1,)).start()
    all_reduce_add_norm(x, x, x[0], EPS, buffer_table, pad_table, 0, 0)
    returned[0] = int(abort.item())


@pytest.mark.skipif(not INTERPRETED, reason="a CPU process under Triton's interpreter")
def test_abort_flag_ends_a_barrier_whose_peer_is_gone():
    """A peer that died leaves the barrier's spins waiting forever; the abort flag (set by the
    executor's watchdog through `SymmNormAllReduce.abort`) ends them, both the arrive's and the
    wait's."""
    returned = torch.full((1,), -1, dtype=torch.int32).share_memory_()
    process = multiprocessing.get_context("fork").Process(target=lone_rank, args=(returned,))
    process.start()
    process.join(timeout=60)
    if process.is_alive():
        process.kill()
        pytest.fail("the call still spun 60 s after its abort flag was set")
    assert process.exitcode == 0 and returned.item() == 1


def test_pad_table_needs_the_abort_flag():
    from phloem.distributed.symm_norm_kernel import all_reduce_add_norm

    x, table = torch.ones(1, HIDDEN, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="2 pad table entries for 2 ranks"):
        all_reduce_add_norm(x, x, x[0], EPS, table, table, 0, 0)


def test_choice_names_symm_norm_and_the_bad_value():
    assert all_reduce_choice({"PHLOEM_TP_ALLREDUCE": "symm_norm"})[0] == "symm_norm"
    with pytest.raises(ValueError, match=r"PHLOEM_TP_ALLREDUCE must be one of .*'symm_norm'.*"
                       r"got 'symm-norm'"):  # fmt: skip
        all_reduce_choice({"PHLOEM_TP_ALLREDUCE": "symm-norm"})


def test_rows_and_prebuild_hooks():
    """Up to 16 rows within the size limit; widths the kernel does not take get no rows (the
    group's all-reduce serves them). The Triton prebuild compiles the kernel only under TP with
    symm_norm; FlashInfer builds nothing for it."""
    assert rows_for(4096, 2, 512 << 10) == MAX_ROWS
    assert rows_for(4096, 2, 16 << 10) == 2 and rows_for(4100, 2, 512 << 10) == 0
    assert rows_for(16384, 2, 512 << 10) == 0 and rows_for(896, 8, 512 << 10) == MAX_ROWS
    env = {"PHLOEM_TP_ALLREDUCE": "symm_norm"}
    assert comm_modules(2, env) == []
    assert [n for n, _ in comm_triton_hooks(4096, 2, torch.bfloat16, env)] == ["symm_norm"]
    assert comm_triton_hooks(4096, 1, torch.bfloat16, env) == []
    assert comm_triton_hooks(4096, 2, torch.float32, env) == []
    assert comm_triton_hooks(4096, 2, torch.bfloat16, {"PHLOEM_TP_ALLREDUCE": "nccl"}) == []


PREBUILD_AND_LAUNCH = r"""
import os, torch
os.environ["PHLOEM_TP_ALLREDUCE"] = "symm_norm"
from phloem.distributed import symm_norm_kernel as k
from phloem.distributed.symm_norm_all_reduce import MAX_ROWS
from phloem.worker import triton_variants as tv
from phloem.worker.triton_prebuild import TritonShapes, launch_all

shapes = TritonShapes(num_heads=16, num_kv_heads=4, head_dim=128, rotary_dim=128,
                      hidden_size=4096, intermediate_size=7168, tp_size=2)
target = tv.cuda_target((9, 0))
errors = []
prebuilt = [v for v in tv.record_variants(lambda: errors.extend(launch_all(shapes)), target)
            if v.qualname == "_all_reduce_add_norm_kernel"]
assert not errors and len(prebuilt) == 1, (errors, prebuilt)
print(prebuilt[0].describe())

def engine_call():  # SymmNormAllReduce's launch: rank 1, 3 rows, slot 1
    x = torch.zeros(3, 4096, dtype=torch.bfloat16)
    table, pads = torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    k.all_reduce_add_norm(x, x.clone(), torch.ones(4096, dtype=torch.bfloat16), 1e-5, table,
                          pads, 1, k.slot_elements(MAX_ROWS, 4096))

(launched,) = tv.record_variants(engine_call, target)
print("same" if launched.specialization == prebuilt[0].specialization else "differs")
tv.compile_variant(prebuilt[0])  # ptxas accepts the barrier's atomics (after the records:
# a compiled kernel would be launched, not recorded)
"""


def test_prebuild_compiles_what_the_engine_launches(compile_for_hopper):
    out = compile_for_hopper(PREBUILD_AND_LAUNCH).split("\n")
    assert "WORLD=2" in out[0] and "BARRIER=True" in out[0]
    assert out[1] == "same"
