"""Start-up with nothing to compile on the default path (issue 19): which FlashInfer modules a
configuration loads (the planning rule, checked on the CPU for GPU settings), the engine's
prebuild runs in the background in ONE build of every module while the main thread goes on, a
failed prebuild is left to the first use, start-up phases are logged as one parseable line, and
`phloem prebuild-kernels --dry-run` lists the modules. FlashInfer itself is replaced by a fake
builder here; the real build is checked on a GPU (benchmarks/startup_gpu.py)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import ModuleType, SimpleNamespace

import pytest
import torch

from phloem.entrypoints.cli import main
from phloem.ops.attention import FLASHINFER_HEAD_DIMS
from phloem.worker.kernel_prebuild import (
    FlashInferModule,
    KernelPrebuild,
    gqa_group_of,
    head_dim_of,
    importable,
    required_modules,
)
from phloem.worker.startup_phases import StartupPhases, parse_phases

HOPPER, AMPERE = (9, 0), (8, 0)
BF16, FP8 = "bfloat16", "float8_e4m3fn"


def _names(modules):
    return [(m.kind, m.backend, m.kv_dtype) for m in modules]


@pytest.mark.parametrize(
    ("backend", "head_dim", "kv", "capability", "triton", "expected"),
    [
        ("auto", 128, BF16, HOPPER, True, [("prefill", "fa2", BF16), ("prefill", "fa3", BF16)]),
        ("auto", 128, BF16, AMPERE, True, [("prefill", "fa2", BF16)]),
        ("auto", 128, BF16, HOPPER, False, [("prefill", "fa2", BF16)]),  # no prefix-sharing wrap
        ("shared_prefix", 64, BF16, HOPPER, False, [("prefill", "fa2", BF16), ("prefill", "fa3", BF16)]),
        ("flashinfer", 128, BF16, HOPPER, True, [("prefill", "fa2", BF16)]),
        ("auto", 128, FP8, HOPPER, True, [("prefill", "fa2", FP8), ("xqa", "", FP8)]),  # decodes on XQA
        ("auto", 128, FP8, AMPERE, True, [("prefill", "fa2", FP8)]),  # decodes on prefill
        ("auto", 96, BF16, HOPPER, True, []),  # the reference serves head dims FlashInfer lacks
        ("flashinfer", 96, BF16, HOPPER, True, [("prefill", "fa2", BF16)]),  # asked for: tried
        ("reference", 128, BF16, HOPPER, True, []),
        ("auto", 128, BF16, None, True, []),  # no GPU
    ],
)  # fmt: skip
def test_required_modules(backend, head_dim, kv, capability, triton, expected, monkeypatch):
    monkeypatch.delenv("PHLOEM_FP8_DECODE_KERNEL", raising=False)  # the default, "auto"
    modules = required_modules(backend, head_dim, BF16, kv, capability, triton)
    assert _names(modules) == expected
    assert all(m.q_dtype == BF16 and m.head_dim == head_dim for m in modules)


def test_fp8_decode_module_only_when_its_kernel_is_chosen(monkeypatch):
    """An FP8 cache decodes on XQA by default on Hopper, on the prefill kernel with
    PHLOEM_FP8_DECODE_KERNEL=prefill: no CUDA-core decode module either way. With
    =cuda_core, Llama-3.1-8B (group 4) decodes on the CUDA-core kernel; 70B (group 8) keeps
    the prefill kernel, so its decode module is not built."""
    llama8b = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    llama70b = SimpleNamespace(num_attention_heads=64, num_key_value_heads=8, hidden_size=8192)
    assert [gqa_group_of(llama8b, tp) for tp in (1, 2, 8, 16)] == [4, 4, 4, 2]
    assert gqa_group_of(llama70b) == 8 and head_dim_of(llama70b) == 128
    cases = {
        "prefill": (["prefill"], ["prefill"]),
        "cuda_core": (["prefill", "decode"], ["prefill"]),
    }
    for kernel, expected in cases.items():
        monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", kernel)
        for config, kinds in zip((llama8b, llama70b), expected):
            modules = required_modules("auto", 128, BF16, FP8, HOPPER, True, gqa_group_of(config))
            assert [m.kind for m in modules] == kinds, kernel
    monkeypatch.delenv("PHLOEM_FP8_DECODE_KERNEL")
    for capability, kinds in ((HOPPER, ["prefill", "xqa"]), (AMPERE, ["prefill"])):
        modules = required_modules("auto", 128, BF16, FP8, capability, True, 4)
        assert [m.kind for m in modules] == kinds
    monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", "tensor")
    with pytest.raises(ValueError, match="PHLOEM_FP8_DECODE_KERNEL must be one of"):
        required_modules("auto", 128, BF16, FP8, HOPPER, True, 4)


@pytest.mark.parametrize("kernel", [None, "auto", "xqa"])
def test_xqa_module_only_where_xqa_decodes(monkeypatch, kernel):
    """By default (PHLOEM_FP8_DECODE_KERNEL unset: "auto") and with =xqa, FlashInfer's XQA
    module is prebuilt, with the block size and GQA group it is compiled for, where the backend
    sends decode steps to it (`fp8_decode_path`: head_dim a multiple of 16 up to 256, a block
    size of 16-128) on a GPU it runs on (sm_90, 100, 120); a bf16 cache, another block size,
    Ampere or Ada, or =prefill add nothing."""
    monkeypatch.delenv("PHLOEM_FP8_DECODE_KERNEL", raising=False)
    if kernel is not None:
        monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", kernel)

    def modules(kv=FP8, capability=HOPPER, head_dim=128, group=4, block_size=16, backend="auto"):
        return required_modules(backend, head_dim, BF16, kv, capability, True, group, block_size)

    xqa = FlashInferModule("xqa", "", BF16, FP8, 128, 16, 4)
    assert modules() == [FlashInferModule("prefill", "fa2", BF16, FP8, 128), xqa]
    assert xqa.describe() == "xqa q bfloat16 kv float8_e4m3fn head_dim 128 page 16 group 4"
    assert modules(capability=(10, 0))[-1] == modules(capability=(12, 0))[-1] == xqa
    assert modules(group=8, block_size=64)[-1] == FlashInferModule("xqa", "", BF16, FP8, 128, 64, 8)
    for kwargs in ({"kv": BF16, "backend": "flashinfer"}, {"capability": AMPERE},
                   {"capability": (8, 9)}, {"block_size": 8},
                   {"head_dim": 512, "backend": "flashinfer"}):  # fmt: skip
        assert [m.kind for m in modules(**kwargs)] == ["prefill"], kwargs
    monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", "prefill")
    assert [m.kind for m in modules()] == ["prefill"]


def test_xqa_module_spec_is_the_one_its_first_use_loads(monkeypatch):
    """The prebuilt spec has `flashinfer.xqa.xqa`'s arguments for a decode step: bf16 queries,
    the e4m3 cache, the page size, head dim and group, no sliding window, bf16 output, one
    query token (a fake `flashinfer.jit` records the call)."""
    from phloem.worker.kernel_prebuild import _jit_spec

    calls = []
    jit = ModuleType("flashinfer.jit")
    jit.gen_batch_decode_module = jit.gen_batch_prefill_module = None
    jit_xqa = ModuleType("flashinfer.jit.xqa")
    jit_xqa.gen_xqa_module = lambda *args: calls.append(args) or "spec"
    monkeypatch.setitem(sys.modules, "flashinfer", ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.jit", jit)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.xqa", jit_xqa)
    assert _jit_spec(FlashInferModule("xqa", "", BF16, FP8, 128, 32, 4)) == "spec"
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    assert calls == [(bf16, e4m3, 32, 128, 4, False, bf16, 1)]


def test_required_modules_refuses_bad_input():
    assert 128 in FLASHINFER_HEAD_DIMS  # the rule reads the backends' own list
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        required_modules("fast", 128, BF16, BF16, HOPPER, True)
    with pytest.raises(ValueError, match="head_dim and gqa_group must be positive"):
        required_modules("auto", 0, BF16, BF16, HOPPER, True)
    with pytest.raises(ValueError, match="head_dim and gqa_group must be positive"):
        required_modules("auto", 128, BF16, BF16, HOPPER, True, 0)


def test_prebuild_runs_every_module_in_one_build_while_the_caller_goes_on(caplog):
    """The fake build blocks until the main thread (the weights' load) has gone on: a build
    run in the caller's thread would never see that and fails the test instead of hanging."""
    weights_loaded = threading.Event()
    calls = []

    def build(modules):
        calls.append((list(modules), threading.current_thread() is threading.main_thread()))
        assert weights_loaded.wait(timeout=30), "the prebuild held up its caller"

    modules = required_modules("auto", 128, BF16, BF16, HOPPER, True)
    prebuild = KernelPrebuild(modules, build=build)
    weights_loaded.set()  # the caller's own work, meanwhile
    with caplog.at_level(logging.INFO, logger="phloem.worker.kernel_prebuild"):
        seconds = prebuild.wait()
    assert calls == [(modules, False)]  # one call with all modules, in another thread
    assert seconds >= 0.0
    assert "FlashInfer modules ready" in caplog.text and "prefill fa3" in caplog.text
    assert prebuild.wait() == 0.0  # waited once; a second wait has nothing to join


class _FakeSpec:
    """A FlashInfer JIT spec's build seam: `build(need_lock=...)`, `is_aot`."""

    def __init__(self, is_aot=False, barrier=None, error=None):
        self.is_aot, self.barrier, self.error, self.calls = is_aot, barrier, error, []

    def build(self, need_lock=False):
        self.calls.append((need_lock, threading.current_thread().name))
        if self.barrier is not None:
            self.barrier.wait(timeout=10)  # both builds must run at once to pass it
        if self.error is not None:
            raise self.error


def test_each_module_builds_in_its_own_ninja_run_side_by_side():
    """Each spec builds through its own `build` (FlashInfer's first-use ninja run, in the
    module's directory, under its lock), two at once (a sequential build would break the
    barrier), AOT modules not at all; an error surfaces after every build has ended."""
    from phloem.worker.kernel_prebuild import build_specs

    barrier = threading.Barrier(2)
    fa2, fa3, aot = _FakeSpec(barrier=barrier), _FakeSpec(barrier=barrier), _FakeSpec(True)
    build_specs([fa2, aot, fa3])
    assert [c[0] for c in fa2.calls + fa3.calls] == [True, True] and aot.calls == []
    assert fa2.calls[0][1] != fa3.calls[0][1]
    failing, other = _FakeSpec(error=RuntimeError("Ninja build failed.")), _FakeSpec()
    with pytest.raises(RuntimeError, match="Ninja build failed"):
        build_specs([failing, other])
    assert other.calls  # built although the first one failed
    alone = _FakeSpec()  # a single pending module (the deferred fa3 one): no pool thread, so a
    build_specs([alone, _FakeSpec(True)])  # daemon prebuild thread never holds process exit
    assert alone.calls == [(True, threading.current_thread().name)]


def test_failed_prebuild_is_left_to_first_use(caplog):
    def build(modules):
        raise RuntimeError("nvcc not found")

    prebuild = KernelPrebuild([FlashInferModule("prefill", "fa2", BF16, BF16, 128)], build=build)
    with caplog.at_level(logging.WARNING, logger="phloem.worker.kernel_prebuild"):
        prebuild.wait()  # logs, does not raise
    assert "RuntimeError: nvcc not found" in caplog.text and "build at first use" in caplog.text


def test_nothing_to_build_starts_nothing():
    calls = []
    prebuild = KernelPrebuild([], build=calls.append)
    assert prebuild.wait() == 0.0 and calls == []
    cpu = KernelPrebuild.for_engine(None, None, None, torch.device("cpu"), torch.float32)
    assert cpu.modules == [] and cpu.wait() == 0.0


def test_startup_phases_log_one_parseable_line(caplog):
    phases = StartupPhases()
    phases.mark("weights")
    phases.mark("attention_warmup")
    phases.mark("weights")  # a phase marked again adds up
    with caplog.at_level(logging.INFO, logger="phloem.worker.startup_phases"):
        phases.finish("cuda_graphs", flashinfer_prebuild=1.5)
    (record,) = parse_phases(caplog.text)
    assert list(record) == ["weights", "attention_warmup", "cuda_graphs", "total",
                            "flashinfer_prebuild"]  # fmt: skip
    assert record["flashinfer_prebuild"] == 1.5
    assert record["total"] == pytest.approx(sum(phases.seconds.values()), abs=2e-3)


def test_engine_start_logs_its_phases(tmp_path_factory, embedded_tokenizer_dir, caplog):
    from phloem import LLM
    from tests.engine.tiny_models import tiny_model_dir

    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "prebuild", 1)
    with caplog.at_level(logging.INFO, logger="phloem.worker.startup_phases"):
        LLM(str(path), dtype="float32", device="cpu")
    (record,) = parse_phases(caplog.text)
    assert {"weights", "setup_and_flashinfer_wait", "memory_profile_and_kv", "cuda_graphs"} <= set(
        record
    )
    assert record["flashinfer_prebuild"] == 0.0  # nothing to build on the CPU
    assert "triton_wait" in record and record["triton_prebuild"] == 0.0


def _flashinfer_lines(out: list[str]) -> list[str]:
    return [x for x in out if x.startswith("FlashInfer")]


def test_cli_dry_run_lists_the_modules(capsys, monkeypatch):
    monkeypatch.delenv("PHLOEM_FP8_DECODE_KERNEL", raising=False)
    assert main(["prebuild-kernels", "--dry-run", "--cuda-arch", "9.0"]) == 0
    out = capsys.readouterr().out.splitlines()
    expected = ["FlashInfer module: prefill fa2 q bfloat16 kv bfloat16 head_dim 64"]
    if importable("triton"):
        expected.append("FlashInfer module: prefill fa3 q bfloat16 kv bfloat16 head_dim 64")
    assert _flashinfer_lines(out) == expected  # the embedded model: head_dim 64
    if importable("triton"):  # rope, silu, 4 attention tiles, merge, the grammar mask (bf16,
        # float32), the seeded sampling noise, small decode (tests/worker/test_triton_*)
        assert sum(x.startswith("Triton kernel: ") for x in out) == 11
    assert (
        main(["prebuild-kernels", "--dry-run", "--cuda-arch", "9.0", "--kv-cache-dtype", "fp8"])
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert _flashinfer_lines(out) == [  # decode steps on XQA (9 / 3 heads: group 3)
        "FlashInfer module: prefill fa2 q bfloat16 kv float8_e4m3fn head_dim 64",
        "FlashInfer module: xqa q bfloat16 kv float8_e4m3fn head_dim 64 page 16 group 3",
    ]

    assert main(["prebuild-kernels", "--dry-run", "--cuda-arch", "9"]) == 2
    assert "--cuda-arch must be MAJOR.MINOR" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["prebuild-kernels", "--dry-run"]) == 0
        assert "no FlashInfer module to build" in capsys.readouterr().out


@pytest.mark.skipif(importable("flashinfer"), reason="checks the message without FlashInfer")
def test_cli_build_without_flashinfer_says_how_to_get_it(capsys):
    assert main(["prebuild-kernels", "--cuda-arch", "9.0"]) == 1
    assert "pip install 'phloem[gpu]'" in capsys.readouterr().err


def test_the_fused_all_reduce_module_is_prebuilt_only_where_it_runs():
    """PHLOEM_TP_ALLREDUCE=fused_norm under TP adds TensorRT-LLM's comm module to the prebuild
    (FlashInfer would compile it in the start-up path otherwise); TP = 1, or another choice,
    adds nothing; a bad choice is named."""
    from phloem.worker.kernel_prebuild import FUSED_NORM_COMM, comm_modules

    assert comm_modules(2, {"PHLOEM_TP_ALLREDUCE": "fused_norm"}) == [FUSED_NORM_COMM]
    assert comm_modules(1, {"PHLOEM_TP_ALLREDUCE": "fused_norm"}) == []
    assert comm_modules(2, {"PHLOEM_TP_ALLREDUCE": "symm_mem"}) == comm_modules(4, {}) == []
    assert FUSED_NORM_COMM.describe() == "comm trtllm"
    with pytest.raises(ValueError, match="PHLOEM_TP_ALLREDUCE"):
        comm_modules(2, {"PHLOEM_TP_ALLREDUCE": "fused"})


def test_deferred_modules_build_after_the_required_ones_without_holding_the_start(caplog):
    """`wait()` returns once the required modules are built while the deferred fa3 module is
    still building (the fake build of it blocks until the test lets it go); `deferred_ready()`
    turns True only after; a failed deferred build leaves it False with a warning. The
    engine's split puts fa3 in the deferred set and everything else in the required one."""
    from phloem.worker.kernel_prebuild import split_deferred

    modules = required_modules("auto", 128, BF16, BF16, HOPPER, True)
    required, deferred = split_deferred(modules)
    assert [m.backend for m in required] == ["fa2"] and [m.backend for m in deferred] == ["fa3"]
    release, built = threading.Event(), []

    def build(mods):
        if mods == deferred:
            assert release.wait(timeout=30), "wait() held the start for the deferred module"
        built.append(list(mods))

    prebuild = KernelPrebuild(required, build=build, deferred=deferred)
    prebuild.wait()
    assert built == [required] and not prebuild.deferred_ready()
    release.set()
    for _ in range(300):
        if prebuild.deferred_ready():
            break
        time.sleep(0.01)
    assert prebuild.deferred_ready() and built == [required, deferred]

    def failing(mods):
        if mods == deferred:
            raise RuntimeError("Ninja build failed.")

    with caplog.at_level(logging.WARNING, logger="phloem.worker.kernel_prebuild"):
        broken = KernelPrebuild(required, build=failing, deferred=deferred)
        broken.wait()
        for _ in range(300):
            if broken._deferred_done.is_set():
                break
            time.sleep(0.01)
    assert not broken.deferred_ready() and "deferred FlashInfer modules failed" in caplog.text
    assert KernelPrebuild([]).deferred_ready()  # nothing deferred: ready
