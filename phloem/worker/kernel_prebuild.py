"""The FlashInfer modules an engine's attention path loads, built before their first use (issue 19).

FlashInfer compiles each attention module (nvcc through ninja) the first time a wrapper plans
with it, in the thread that plans: on the default path of a Hopper GPU the fa2 paged prefill
module at the memory profile's first forward, then the fa3 one at the shared-prefix warm-up,
one after the other, and each before the engine can go on. Here:

- `required_modules` lists the modules a configuration will load, by the rule
  `ops.attention.get_attention_backend` picks backends with (pure: it runs on the CPU);
- `build_modules` builds them all at once into FlashInfer's JIT cache, each with its own
  ninja run in its own build directory, the one FlashInfer's first use runs ninja in (its
  objects compile in parallel, and the modules build side by side), so a later use finds
  them and compiles nothing. Not FlashInfer's `build_jit_specs`: its one ninja run over every
  module keeps ninja's build log and dependency records in the JIT directory's root, and the
  first use's ninja, run in the module's directory, finds none there and compiles every
  object again, in the thread that plans (benchmarks/results/2026-11-26c-cpu-triton-compile);
- `KernelPrebuild` does that in a background thread at engine start-up, started before the
  weights load (the compiler runs while they are read) and waited for before the first step
  that plans attention. A failed prebuild is logged and left to the first use, which builds
  (or raises) as it always did.
- The fa3 module is *deferred* (`split_deferred`): only the long prefill chunks of eager steps
  use it (`ops/attention/prefill_split.py`; shared-prefix steps compute them on our Triton
  kernel without it, plain steps on fa2), and on a bare H200 it compiles for 123 s against ~45 s for fa2. The thread builds
  it after the required modules, on every core, and `wait()` returns once those are built; the
  shared-prefix backend hands chunks to fa3 only from the step after `deferred_ready()` says it
  is built (`SharedPrefixAttention.prefill_ready`). A warm cache builds nothing, so there fa3
  is ready before the first step as before; on a cold start the first minutes of steps run
  their long chunks on our kernel (shared-prefix steps) or on fa2 (plain steps).

`phloem prebuild-kernels` runs `build_modules` for a model and settings ahead of time.

    |-- start: prebuild thread (ninja per module: fa2 [| FP8 decode / XQA | comm]) --|-- fa3 -|
    |-- main:  load weights --------------------|-- wait --|-- profile, warm-up, graphs, steps
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from phloem.ops.attention import FLASHINFER_HEAD_DIMS
from phloem.ops.attention.flashinfer_backend import (
    fp8_decode_kernel,
    fp8_decode_on_cuda_cores,
    fp8_decode_path,
)
from phloem.ops.attention.flashinfer_xqa import resolve_fp8_decode, xqa_runs_on

logger = logging.getLogger(__name__)

FP8_KV = "float8_e4m3fn"  # the torch dtype name of an FP8 KV cache


@dataclass(frozen=True)
class FlashInferModule:
    """One FlashInfer JIT module (its template arguments; the rest are phloem's constants:
    int32 page indices, output in the query dtype, no RoPE in the kernel, no sliding window,
    no logits soft cap, no fp16 QK reduction).

    Attributes:
        kind: "prefill" (the batch prefill module: prefill, chunked appends and decode),
            "decode" (the CUDA-core batch decode module, FP8 caches), "xqa" (TensorRT-LLM's
            XQA decode module, FP8 caches on sm_90/100/120 by default) or "comm"
            (TensorRT-LLM's all-reduce kernels, `FUSED_NORM_COMM`: PHLOEM_TP_ALLREDUCE=
            fused_norm under TP).
        backend: "fa2" or "fa3" for prefill; "" for decode and xqa; "trtllm" for comm.
        q_dtype / kv_dtype: torch dtype names ("bfloat16", "float8_e4m3fn", ...).
        head_dim: per attention head (queries and values alike).
        page_size / gqa_group: the KV block size and query heads per KV head, template
            arguments of the xqa module only (0 for the others).
    """

    kind: str
    backend: str
    q_dtype: str
    kv_dtype: str
    head_dim: int
    page_size: int = 0
    gqa_group: int = 0

    def describe(self) -> str:
        if self.kind == "comm":
            return f"comm {self.backend}"
        if self.kind == "xqa":
            return (f"xqa q {self.q_dtype} kv {self.kv_dtype} head_dim {self.head_dim} "
                    f"page {self.page_size} group {self.gqa_group}")  # fmt: skip
        backend = f" {self.backend}" if self.backend else ""
        return f"{self.kind}{backend} q {self.q_dtype} kv {self.kv_dtype} head_dim {self.head_dim}"


def required_modules(
    attention_backend: str,
    head_dim: int,
    dtype: str,
    kv_dtype: str,
    cuda_capability: tuple[int, int] | None,
    triton_available: bool,
    gqa_group: int = 1,
    block_size: int = 16,
) -> list[FlashInferModule]:
    """The FlashInfer modules an engine of these settings loads (`get_attention_backend`'s rule;
    the shared-prefix impl "auto" is our Triton kernel, which needs no FlashInfer module):

    - none off CUDA (`cuda_capability` None), for "reference", or for "auto"/"shared_prefix"
      at a head dim FlashInfer does not compile (the reference serves those);
    - the fa2 prefill module (q `dtype`, KV `kv_dtype`), plus the CUDA-core decode module for an
      FP8 cache whose decode steps use it (`fp8_decode_on_cuda_cores`: PHLOEM_FP8_DECODE_KERNEL=
      cuda_core and a GQA group it is compiled for), or the XQA decode module for one whose
      decode steps run XQA (`_runs_xqa`: by default, PHLOEM_FP8_DECODE_KERNEL unset or "auto",
      on every GPU XQA runs on, for the head dims and block sizes it compiles), so its first
      decode step compiles nothing;
    - the fa3 prefill module too on Hopper (major 9) when prefix sharing wraps FlashInfer
      ("shared_prefix", or "auto" with Triton) and the cache is in the query's dtype.

    Args:
        attention_backend: `ModelConfig.attention_backend` ("auto", "flashinfer",
            "shared_prefix", "reference").
        dtype / kv_dtype: torch dtype names of the queries and of the KV cache.
        gqa_group: query heads per KV head on one rank (`gqa_group_of`).
        block_size: tokens per KV block (`CacheConfig.block_size`; the xqa module's page).
    Raises:
        ValueError: an unknown backend name, or a non-positive head_dim or gqa_group.
    """
    if attention_backend not in ("auto", "flashinfer", "shared_prefix", "reference"):
        raise ValueError(f"unknown attention backend {attention_backend!r}")
    if head_dim < 1 or gqa_group < 1:
        raise ValueError(f"head_dim and gqa_group must be positive, got {head_dim}, {gqa_group}")
    if cuda_capability is None or attention_backend == "reference":
        return []
    if attention_backend != "flashinfer" and head_dim not in FLASHINFER_HEAD_DIMS:
        return []
    modules = [FlashInferModule("prefill", "fa2", dtype, kv_dtype, head_dim)]
    if kv_dtype == FP8_KV and fp8_decode_on_cuda_cores(gqa_group):
        modules.append(FlashInferModule("decode", "", dtype, kv_dtype, head_dim))
    if kv_dtype == FP8_KV and _runs_xqa(head_dim, gqa_group, block_size, cuda_capability):
        xqa = FlashInferModule("xqa", "", dtype, kv_dtype, head_dim, block_size, gqa_group)
        modules.append(xqa)
    shared = attention_backend == "shared_prefix" or (
        attention_backend == "auto" and triton_available
    )
    if shared and cuda_capability[0] == 9 and kv_dtype == dtype:
        modules.append(FlashInferModule("prefill", "fa3", dtype, kv_dtype, head_dim))
    return modules


def _runs_xqa(
    head_dim: int, gqa_group: int, block_size: int, cuda_capability: tuple[int, int]
) -> bool:
    """Whether an FP8 cache's decode steps run FlashInfer's XQA kernel, by the backend's rule:
    PHLOEM_FP8_DECODE_KERNEL resolved for this capability (`resolve_fp8_decode`: "auto" is
    "xqa" on a GPU XQA runs on), this geometry taken (`fp8_decode_path`), and a GPU it
    compiles for (an explicit "xqa" elsewhere is the backend's ValueError, not a build)."""
    kernel = resolve_fp8_decode(fp8_decode_kernel(), cuda_capability)
    path = fp8_decode_path(kernel, gqa_group, head_dim, block_size)
    return path == "xqa" and xqa_runs_on(cuda_capability)


# The all-reduce + residual + RMSNorm kernel's module (`distributed/fused_norm_all_reduce.py`):
# FlashInfer compiles it when the first rank sets up its workspace, after the weights load, in
# the engine's start-up path: on two H200s the start-up outlived a 200 s limit with it
# (benchmarks/results/2026-11-26h-h200x2). Prebuilt beside the attention modules instead.
FUSED_NORM_COMM = FlashInferModule("comm", "trtllm", "", "", 0)


def comm_modules(tp_size: int, environ: dict[str, str] | None = None) -> list[FlashInferModule]:
    """[`FUSED_NORM_COMM`] when tensor parallelism runs the fused all-reduce + RMSNorm kernel
    (tp_size > 1 and PHLOEM_TP_ALLREDUCE=fused_norm), else [].

    Raises:
        ValueError: naming PHLOEM_TP_ALLREDUCE for a value that is not one of its choices.
    """
    from phloem.distributed.symm_all_reduce import all_reduce_choice

    choice, _ = all_reduce_choice(environ)
    return [FUSED_NORM_COMM] if tp_size > 1 and choice == "fused_norm" else []


def comm_triton_hooks(
    hidden_size: int, tp_size: int, dtype: Any, environ: dict[str, str] | None = None
) -> list[tuple[str, Callable[[], None]]]:
    """The Triton prebuild's (`worker.triton_prebuild`) hooks for the all-reduce kernels:
    PHLOEM_TP_ALLREDUCE=symm_norm's all-reduce + add + RMSNorm kernel
    (`distributed/symm_norm_kernel.py`; no FlashInfer module) when tp_size > 1, the torch
    `dtype` is one it takes and the width fits it; else [].

    Raises:
        ValueError: naming PHLOEM_TP_ALLREDUCE(_MAX_KB) for a value that is not one it takes.
    """
    from phloem.distributed.fused_norm_all_reduce import FUSED_DTYPES
    from phloem.distributed.symm_all_reduce import all_reduce_choice
    from phloem.distributed.symm_norm_all_reduce import rows_for

    choice, max_bytes = all_reduce_choice(environ)
    rows = rows_for(hidden_size, tp_size, max_bytes)
    if tp_size == 1 or choice != "symm_norm" or dtype not in FUSED_DTYPES or rows == 0:
        return []
    from phloem.distributed import symm_norm_kernel

    call = partial(symm_norm_kernel.compile_variants, hidden_size, tp_size, rows, dtype)
    return [("symm_norm", call)]


def head_dim_of(hf_config: Any) -> int:
    """Per-head size of a transformers config: `head_dim` when it sets one, else
    hidden_size / num_attention_heads."""
    explicit = getattr(hf_config, "head_dim", None)
    return int(explicit or hf_config.hidden_size // hf_config.num_attention_heads)


def gqa_group_of(hf_config: Any, tp_size: int = 1) -> int:
    """Query heads per KV head on one tensor-parallel rank: H / tp over max(1, H_kv / tp) (KV
    heads are replicated when tp > H_kv, `layers.linear.QKVLinear`)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return (heads // tp_size) // max(1, kv_heads // tp_size)


def _jit_spec(module: FlashInferModule):
    """FlashInfer's `JitSpec` of `module` (imports flashinfer)."""
    import torch
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module

    if module.kind == "comm":
        from flashinfer.comm import gen_trtllm_comm_module

        return gen_trtllm_comm_module()
    q, kv = getattr(torch, module.q_dtype), getattr(torch, module.kv_dtype)
    d = module.head_dim
    if module.kind == "xqa":  # the module `flashinfer.xqa.xqa` loads for a decode step: no
        # sliding window, output in the query dtype, one query token
        from flashinfer.jit.xqa import gen_xqa_module

        return gen_xqa_module(q, kv, module.page_size, d, module.gqa_group, False, q, 1)
    if module.kind == "decode":
        return gen_batch_decode_module(q, kv, q, torch.int32, d, d, 0, False, False)
    return gen_batch_prefill_module(
        module.backend, q, kv, q, torch.int32, d, d, 0, False, False, False
    )


def build_modules(modules: Sequence[FlashInferModule]) -> None:
    """Build `modules` into FlashInfer's JIT cache (`build_specs` of their JIT specs); modules
    already built are up to date at once.

    Raises:
        ImportError: FlashInfer is not installed. RuntimeError: a compile failed (ninja's
            output says which).
    """
    if modules:
        build_specs([_jit_spec(m) for m in modules])


def build_specs(specs: Sequence[Any]) -> None:
    """Build FlashInfer JIT specs side by side, one thread each, each through its own
    `build(need_lock=True)`: the ninja run FlashInfer's first use makes, in the module's own
    build directory and under the module's file lock (module docstring: why not one
    `build_jit_specs` run). A spec with a prebuilt AOT module is skipped (FlashInfer loads that
    one); a single spec builds in the calling thread. MAX_JOBS caps each ninja run's jobs.

    Raises:
        the first build's error, after every build has ended.
    """
    pending = [spec for spec in specs if not spec.is_aot]
    if len(pending) == 1:  # in the calling thread: a daemon prebuild thread's build of the
        # deferred fa3 module then never holds the process's exit (a pool's workers would)
        pending[0].build(need_lock=True)
        return
    if not pending:
        return
    with ThreadPoolExecutor(max_workers=len(pending), thread_name_prefix="phloem-ninja") as pool:
        futures = [pool.submit(spec.build, need_lock=True) for spec in pending]
    for future in futures:
        future.result()


def split_deferred(
    modules: Sequence[FlashInferModule],
) -> tuple[list[FlashInferModule], list[FlashInferModule]]:
    """(required, deferred): the fa3 prefill modules are deferred (module docstring), the rest
    are required before the first step."""
    deferred = [m for m in modules if m.kind == "prefill" and m.backend == "fa3"]
    return [m for m in modules if m not in deferred], deferred


class KernelPrebuild:
    """`build_modules` in a background thread (module docstring). Start it, do other work, and
    `wait()` before anything plans attention (a module FlashInfer builds itself meanwhile would
    race this build in the same directory); plan with a deferred module only once
    `deferred_ready()`.

    Args:
        modules: what to build before the first step (none and no deferred: nothing starts).
        build: the builder, `build_modules` unless a test passes another.
        deferred: what the same thread builds after `modules` (the fa3 prefill modules).
    """

    def __init__(
        self,
        modules: Sequence[FlashInferModule],
        build: Callable[[Sequence[FlashInferModule]], None] = build_modules,
        deferred: Sequence[FlashInferModule] = (),
    ) -> None:
        self.modules, self.deferred = list(modules), list(deferred)
        self._build = build
        self._error: BaseException | None = None
        self._seconds = 0.0
        self._required_done = threading.Event()
        self._deferred_done = threading.Event()
        self._deferred_ok = not self.deferred
        self._thread: threading.Thread | None = None
        if self.modules or self.deferred:
            self._thread = threading.Thread(target=self._run, name="phloem-prebuild", daemon=True)
            self._thread.start()
        else:
            self._required_done.set()
            self._deferred_done.set()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            if self.modules:
                self._build(self.modules)
        except BaseException as e:  # reported by wait(); the first use builds or raises itself
            self._error = e
        self._seconds = time.perf_counter() - start
        self._required_done.set()
        if self.deferred:
            self._build_deferred()
        self._deferred_done.set()

    def _build_deferred(self) -> None:
        start = time.perf_counter()
        names = ", ".join(m.describe() for m in self.deferred)
        try:
            self._build(self.deferred)
        except BaseException as e:  # noqa: BLE001 - the deferred kernels stay unused
            logger.warning("building the deferred FlashInfer modules failed (%s: %s); the steps "
                           "that would use them keep their other kernels", type(e).__name__, e)  # fmt: skip
            return
        self._deferred_ok = True
        logger.info("deferred FlashInfer modules ready after %.1f s more: %s",
                    time.perf_counter() - start, names)  # fmt: skip

    def deferred_ready(self) -> bool:
        """Whether the deferred modules are built (True when there are none; False after their
        build failed). Never blocks."""
        return self._deferred_done.is_set() and self._deferred_ok

    def wait(self) -> float:
        """Block until the required modules are built (the deferred ones go on building);
        returns the duration [s] (0.0 when none were to build). A failed build is logged as a
        warning, not raised: FlashInfer then builds each module at its first use, as without a
        prebuild."""
        if self._thread is None or not self.modules:
            return 0.0
        self._required_done.wait()
        self._thread = None
        names = ", ".join(m.describe() for m in self.modules)
        if self._error is not None:
            logger.warning("prebuilding FlashInfer modules failed (%s: %s); they build at first "
                           "use", type(self._error).__name__, self._error)  # fmt: skip
        else:
            logger.info("FlashInfer modules ready in %.1f s: %s", self._seconds, names)
        return self._seconds

    @classmethod
    def for_engine(
        cls, model_config, cache_config, hf_config, device, dtype, tp_size: int = 1
    ) -> KernelPrebuild:
        """The prebuild of an engine's worker (nothing off CUDA or without FlashInfer).

        Args:
            model_config / cache_config: the worker's configs. hf_config: the model's
                transformers config. device: its torch device. dtype: its resolved torch dtype.
                tp_size: the tensor-parallel size (the heads per rank).
        """
        if device.type != "cuda" or not importable("flashinfer"):
            return cls([])
        import torch

        kv_dtype = FP8_KV if cache_config.kv_cache_dtype == "fp8" else _dtype_name(dtype)
        modules = required_modules(
            model_config.attention_backend,
            head_dim_of(hf_config),
            _dtype_name(dtype),
            kv_dtype,
            torch.cuda.get_device_capability(device),
            importable("triton"),
            gqa_group_of(hf_config, tp_size),
            cache_config.block_size,
        )
        required, deferred = split_deferred(modules)
        return cls(required + comm_modules(tp_size), deferred=deferred)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def importable(module: str) -> bool:
    """Whether `module` imports here (an optional GPU package: flashinfer, triton)."""
    try:
        __import__(module)
    except ImportError:
        return False
    return True
