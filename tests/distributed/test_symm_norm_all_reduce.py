"""PHLOEM_TP_ALLREDUCE=symm_norm: phloem's one-shot all-reduce + residual add + RMSNorm kernel.

On the CPU (Triton's interpreter) the kernel's per-rank math runs without its barrier, plain
tensors standing in for the peers' symmetric buffers: the sum of the ranks' partials plus the
residual, then RMSNorm, against a float64 reference. Compiled for sm_90 without a GPU: the
kernel with its barrier (system-scope acquire/release atomics) passes ptxas, and the variant
the prebuild records is the one the engine's call launches. The barrier itself and CUDA-graph
replay run on two GPUs (tests/distributed/test_tp_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from phloem.distributed.symm_all_reduce import all_reduce_choice
from phloem.distributed.symm_norm_all_reduce import MAX_ROWS, rows_for
from phloem.worker.kernel_prebuild import comm_modules, comm_triton_hooks

pytest.importorskip("triton")

EPS = 1e-5


def run_rank(parts, residual, weight, rank: int, slot_offset: int):
    """The kernel as rank `rank` of len(parts) runs it, the peers' buffers filled already:
    (normed, new residual, this rank's buffer after the call)."""
    from phloem.distributed.symm_norm_kernel import all_reduce_add_norm

    rows, hidden = residual.shape
    buffers = [torch.zeros(slot_offset + MAX_ROWS * hidden, dtype=residual.dtype) for _ in parts]
    for peer, part in enumerate(parts):
        if peer != rank:
            buffers[peer][slot_offset : slot_offset + rows * hidden] = part.view(-1)
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    out, new_residual = all_reduce_add_norm(parts[rank], residual, weight, EPS, table, table,
                                            rank, slot_offset, barrier=False)  # fmt: skip
    return out, new_residual, buffers[rank]


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
    table = torch.zeros(2, dtype=torch.int64)
    k.all_reduce_add_norm(x, x.clone(), torch.ones(4096, dtype=torch.bfloat16), 1e-5, table,
                          table, 1, k.slot_elements(MAX_ROWS, 4096))

(launched,) = tv.record_variants(engine_call, target)
print("same" if launched.specialization == prebuilt[0].specialization else "differs")
tv.compile_variant(prebuilt[0])  # ptxas accepts the barrier's atomics (after the records:
# a compiled kernel would be launched, not recorded)
"""


def test_prebuild_compiles_what_the_engine_launches(compile_for_hopper):
    out = compile_for_hopper(PREBUILD_AND_LAUNCH).split("\n")
    assert "WORLD=2" in out[0] and "BARRIER=True" in out[0]
    assert out[1] == "same"
