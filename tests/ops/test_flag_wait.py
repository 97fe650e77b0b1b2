"""The device-side wait for a host flag (`phloem.ops.flag_wait_triton`): under the interpreter
it returns once another thread sets the flag and writes the error word after its bound; the
GPU compiler takes it for Hopper (volatile loads in the loop, the global timer)."""

from __future__ import annotations

import threading
import time

import torch

COMPILE_FOR_HOPPER = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from phloem.ops import flag_wait_triton as f

for timeout in ("i64", "i32"):  # 10 s in ns is an i64; a short timeout an i32
    sig = {"words_ptr": "*i32", "seq": "i32", "timeout_ns": timeout, "max_spins": "i32",
           "INTERPRET": "constexpr"}
    src = ASTSource(fn=f._flag_wait_kernel, signature=sig, constexprs={"INTERPRET": False})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    ptx = ptx.asm["ptx"]
    loop = ptx[ptx.index("Loop Header"):]
    assert "ld.volatile.global" in loop and "%globaltimer" in loop, ptx
    print("compiled", timeout)
"""


def test_returns_once_the_flag_is_set_and_times_out_else(triton_kernels):
    module = triton_kernels("phloem.ops.flag_wait_triton", "_flag_wait_kernel")
    on_gpu = not module.INTERPRET  # compiled: page-locked words, the launch is asynchronous
    words = torch.zeros(2, dtype=torch.int32, pin_memory=on_gpu)

    def wait(seq: int, max_spins: int) -> None:  # bound: 0.2 s on the GPU, max_spins interpreted
        module.launch(words, seq, 2 * 10**8, max_spins=max_spins)
        if on_gpu:
            torch.cuda.synchronize()

    wait(1, max_spins=20)  # never set: the bound, then the error word
    assert words.tolist() == [0, 1]
    words.zero_()

    def set_later():
        time.sleep(0.05)
        words.numpy()[0] = 3  # a later sequence number releases an earlier wait too

    setter = threading.Thread(target=set_later)
    setter.start()
    wait(2, max_spins=10**9)
    setter.join()
    assert words.tolist() == [3, 0]
    wait(3, max_spins=1)  # already set: no spin
    assert words.tolist() == [3, 0]


def test_kernel_compiles_for_hopper(compile_for_hopper):
    assert compile_for_hopper(COMPILE_FOR_HOPPER).count("compiled") == 2
