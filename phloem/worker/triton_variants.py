"""The prebuild process of phloem's Triton kernels (`phloem.worker.triton_prebuild`): record the
kernel variants an engine launches, then compile them in parallel into Triton's cache.

Recording needs no GPU: `CompileOnlyDriver` (a Triton driver that knows the target
architecture and has no device) is made the active driver, and Triton's `jit_cache_hook` keeps
each launch's serialized specialization (what `JITFunction.run` would compile: argument types,
16-byte alignments, integer specializations, constexprs, options) and tells Triton not to
compile, so the launch returns before it would touch a device. Compiling goes through
`JITFunction.preload` of that specialization, Triton's runtime path, so the cache key written
is the one a launch on a GPU of that architecture computes.

Run as `python -m phloem.worker.triton_variants` with a JSON request on stdin (`TritonShapes`
fields under "shapes", "arch": [major, minor], "jobs", "compile"); prints one JSON summary.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver


class CompileOnlyDriver(DriverBase):
    """A Triton driver for compiling only: the target is given, the current device and stream
    are 0, and nothing can launch (`map_python_to_cpp_type` and the benchmarker raise)."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    @classmethod
    def is_active(cls) -> bool:
        return False  # never picked by Triton itself

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("a compile-only driver launches nothing")

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self):
        raise NotImplementedError("a compile-only driver has no device")

    def get_benchmarker(self):
        raise NotImplementedError("a compile-only driver launches nothing")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass


def cuda_target(arch: tuple[int, int]) -> GPUTarget:
    """The Triton target of a CUDA GPU of compute capability `arch` (what the CUDA driver's
    `get_current_target` returns on it)."""
    return GPUTarget("cuda", arch[0] * 10 + arch[1], 32)


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: `module`:`qualname` names the `@triton.jit` function,
    `specialization` is Triton's serialized specialization (JSON: signature, constexprs,
    attributes, options, target), as `JITFunction.preload` takes it."""

    module: str
    qualname: str
    specialization: str

    def describe(self) -> str:
        """The kernel's name and its constexprs, e.g. "tile_kernel(GQA=4, ..., num_warps=4)"."""
        spec = json.loads(self.specialization)
        names = list(spec["signature"])
        consts = [f"{names[k[0]]}={v['constexpr'] if isinstance(v, dict) else v}"
                  for k, v in zip(spec["constant_keys"], spec["constant_vals"])
                  if len(k) == 1 and spec["signature"][names[k[0]]] == "constexpr"]  # fmt: skip
        opts = spec["options"]
        consts += [f"num_warps={opts['num_warps']}", f"num_stages={opts['num_stages']}"]
        return f"{self.qualname}({', '.join(consts)})"


def record_variants(launch, target: GPUTarget) -> list[Variant]:
    """The distinct variants `launch()` (a function calling kernel launch wrappers on CPU
    tensors) would compile for `target`, in launch order; nothing is compiled or launched.
    Sets the active Triton driver to a `CompileOnlyDriver` for good (this process compiles
    only) and restores the jit cache hook."""
    driver.set_active(CompileOnlyDriver(target))
    seen: dict[tuple[str, str], Variant] = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        # key: Triton's in-process key of the launch (specialization and options)
        name = f"{fn.module}:{fn.name}"
        if (name, str(key)) not in seen:
            seen[name, str(key)] = Variant(fn.module, fn.name, compile["specialization_data"])
        return True  # handled: compile nothing, launch nothing

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        launch()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(seen.values())


def compile_variant(variant: Variant) -> tuple[float, bool]:
    """Compile `variant` into Triton's cache (under a `CompileOnlyDriver` of its target, or
    the real one on such a GPU), and its host launcher where this Triton compiles one per
    kernel (`build_launcher`); returns (seconds, whether the cache had the kernel already).

    Raises:
        whatever Triton's compiler raises for it (CompilationError, a ptxas failure).
    """
    fn = importlib.import_module(variant.module)
    for part in variant.qualname.split("."):
        fn = getattr(fn, part)
    hits: list[bool] = []
    knobs.compilation.listener = lambda **event: hits.append(event["cache_hit"])
    start = time.perf_counter()
    try:
        kernel = fn.preload(variant.specialization)
    finally:
        knobs.compilation.listener = None
    build_launcher(kernel)
    return time.perf_counter() - start, bool(hits and hits[0])


def build_launcher(kernel) -> bool:
    """Build `kernel`'s C launcher into Triton's cache where this Triton compiles one per
    kernel signature with the host C compiler at the kernel's first launch (Triton 3.6, whose
    nvidia driver has `make_launcher`; from 3.7 one generic launcher serves every kernel), so
    the engine's first launch finds it. Best effort: False where there is none to build or it
    cannot be built here (no libcuda on a CPU machine); the first launch then builds it."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher, make_launcher  # noqa: F401
    except ImportError:  # a Triton with one generic launcher
        return False
    try:
        CudaLauncher(kernel.src, kernel.metadata)
    except Exception:  # no libcuda or no C compiler here
        return False
    return True


def build_driver_helper() -> bool:
    """Build Triton's CUDA driver helper (`cuda_utils`, a C module the CUDA driver compiles
    with the host compiler when the engine's first Triton launch creates it; cached beside
    the kernels) now. Best effort: False where it cannot be built here (no libcuda)."""
    try:
        from triton.backends.nvidia.driver import CudaUtils

        CudaUtils()
    except Exception:  # no libcuda or no C compiler here: the engine builds it itself
        return False
    return True


def _compile_in_worker(variant: Variant) -> dict[str, Any]:
    """One variant compiled in a pool process: its report, an error as text (never raised)."""
    try:
        seconds, cached = compile_variant(variant)
    except Exception as e:  # reported: the engine's first launch compiles it (or fails) itself
        return {"kernel": variant.describe(), "error": f"{type(e).__name__}: {e}"[:2000]}
    return {"kernel": variant.describe(), "seconds": round(seconds, 3), "cached": cached}


def compile_all(variants: list[Variant], jobs: int) -> list[dict[str, Any]]:
    """Compile `variants` `jobs` at a time in forked processes (one per variant at most;
    in this process when jobs is 1); one report each, in the order given."""
    if jobs <= 1 or len(variants) <= 1:
        return [_compile_in_worker(v) for v in variants]
    context = multiprocessing.get_context("fork")  # no CUDA here: the driver compiles only
    with ProcessPoolExecutor(min(jobs, len(variants)), mp_context=context) as pool:
        return list(pool.map(_compile_in_worker, variants))


def _cache_lock(path: str):
    """An exclusive lock on `path` (created), held until the returned file is closed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle = open(path, "a")  # noqa: SIM115 (closed by the caller)
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Record the variants of request["shapes"] (`TritonShapes` fields) for the GPU of
    request["arch"] and, unless request["compile"] is false, compile them request["jobs"] at a
    time into Triton's cache, holding the cache directory's prebuild lock; the summary."""
    from phloem.worker.triton_prebuild import TritonShapes, launch_all

    shapes = TritonShapes(**request["shapes"])
    start = time.perf_counter()
    errors: list[str] = []
    variants = record_variants(lambda: errors.extend(launch_all(shapes)),
                               cuda_target(tuple(request["arch"])))  # fmt: skip
    summary: dict[str, Any] = {"variants": len(variants), "cache_dir": knobs.cache.dir,
                               "record_s": round(time.perf_counter() - start, 3),
                               "record_errors": errors}  # fmt: skip
    if not request.get("compile", True):
        summary["kernels"] = [{"kernel": v.describe()} for v in variants]
        return summary
    # longest first (the attention tiles) keeps the pool's last process short
    order = sorted(variants, key=lambda v: "tile_kernel" not in v.qualname)
    lock = _cache_lock(os.path.join(knobs.cache.dir, "phloem-prebuild.lock"))
    try:
        summary["lock_wait_s"] = round(time.perf_counter() - start - summary["record_s"], 3)
        summary["driver_helper"] = build_driver_helper()
        summary["kernels"] = compile_all(order, int(request.get("jobs", 1)))
    finally:
        lock.close()
    summary["seconds"] = round(time.perf_counter() - start, 3)
    return summary


def main() -> int:
    """Read the request on stdin, print the summary as JSON; exit 0 (a variant that failed is
    in the summary), or 1 when the prebuild itself failed (the error on stderr)."""
    request = json.loads(sys.stdin.read())
    try:
        summary = run(request)
    except Exception as e:
        print(f"Triton prebuild failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
