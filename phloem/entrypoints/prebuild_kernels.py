"""`phloem prebuild-kernels`: compile the GPU kernels a model and its engine settings will load, now,
so that later starts compile none of them (issue 19): FlashInfer's modules, built side by side,
into FlashInfer's JIT cache (`phloem.worker.kernel_prebuild`), and phloem's Triton kernel
variants, in parallel processes, into Triton's cache (TRITON_CACHE_DIR, default
~/.triton/cache; `phloem.worker.triton_prebuild`). The engine does the same at start-up, while
the weights load; this command does it ahead of time (after `pip install`, in an image build).
With --cuda-arch it plans for that GPU; the Triton kernels then compile on a machine without
one (FlashInfer's need nvcc).

    phloem prebuild-kernels --model /models/llama-3.1-8b [--kv-cache-dtype fp8] [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
import time


def register(subparsers) -> None:
    """Add `phloem prebuild-kernels` to the CLI."""
    from phloem.entrypoints.cli import add_engine_args

    p = subparsers.add_parser(
        "prebuild-kernels",
        help="compile the GPU kernels a model needs (FlashInfer modules, Triton kernels) now, not at its first start",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--cuda-arch",
        default=None,
        help="compute capability to plan for, e.g. 9.0 (default: the visible GPU's)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list the modules and kernels; build none"
    )
    add_engine_args(p)
    p.set_defaults(func=run)


def _capability(cuda_arch: str | None) -> tuple[int, int] | None:
    """(major, minor) of --cuda-arch, else of the visible GPU; None without either.

    Raises:
        ValueError: naming --cuda-arch when it is not MAJOR.MINOR.
    """
    if cuda_arch is not None:
        major, dot, minor = cuda_arch.partition(".")
        if not (major.isdigit() and dot and minor.isdigit()):
            raise ValueError(f"--cuda-arch must be MAJOR.MINOR (e.g. 9.0), got {cuda_arch!r}")
        return int(major), int(minor)
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def _engine(args: argparse.Namespace):
    """(EngineArgs, EngineConfig, the model's transformers config, the activation dtype's torch
    name on a GPU) of the parsed flags.

    Raises:
        ValueError: an invalid engine setting. FileNotFoundError: no model there.
    """
    import torch

    from phloem.engine_args import EngineArgs
    from phloem.models.loader import load_hf_config, resolve_model
    from phloem.worker.worker import resolve_dtype

    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    hf_config = load_hf_config(resolve_model(engine_args.model))
    dtype = str(resolve_dtype(config.model.dtype, torch.device("cuda"))).removeprefix("torch.")
    return engine_args, config, hf_config, dtype


def plan_modules(args: argparse.Namespace, engine=None) -> list:
    """The `FlashInferModule`s an engine of the parsed flags (or of `engine`, `_engine`'s
    tuple) loads on the GPU of --cuda-arch (or the visible one); empty without a GPU.

    Raises:
        ValueError: an invalid engine setting or --cuda-arch. FileNotFoundError: no model there.
    """
    from phloem.worker.kernel_prebuild import (
        FP8_KV,
        gqa_group_of,
        head_dim_of,
        importable,
        required_modules,
    )

    engine_args, config, hf_config, dtype = engine or _engine(args)
    kv_dtype = FP8_KV if config.cache.kv_cache_dtype == "fp8" else dtype
    return required_modules(
        config.model.attention_backend,
        head_dim_of(hf_config),
        dtype,
        kv_dtype,
        _capability(args.cuda_arch),
        importable("triton"),
        gqa_group_of(hf_config, engine_args.tensor_parallel_size),
        config.cache.block_size,
    )


def run(args: argparse.Namespace) -> int:
    """List the FlashInfer modules and the Triton kernel variants, then (without --dry-run)
    build them; exit 0, or 1 when FlashInfer is not installed or a build fails (the Triton
    kernels are left alone when FlashInfer's build failed)."""
    engine = _engine(args)
    return _flashinfer(args, plan_modules(args, engine)) or _triton(
        args, _capability(args.cuda_arch), engine
    )


def _flashinfer(args: argparse.Namespace, modules: list) -> int:
    """List and (without --dry-run) build the FlashInfer `modules`; the exit code."""
    from phloem.worker.kernel_prebuild import build_modules

    if not modules:
        print("no FlashInfer module to build (no GPU, or these settings use none); pass "
              "--cuda-arch to plan for a GPU")  # fmt: skip
        return 0
    for m in modules:
        print(f"FlashInfer module: {m.describe()}")
    if args.dry_run:
        return 0
    start = time.perf_counter()
    try:
        build_modules(modules)
    except ImportError as e:
        print(
            f"error: FlashInfer is not installed ({e}): pip install 'phloem[gpu]'", file=sys.stderr
        )
        return 1
    except Exception as e:  # a compile failed: ninja's output above says which
        print(f"error: building the modules failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"built {len(modules)} modules in {time.perf_counter() - start:.1f} s")
    return 0


def _triton(args: argparse.Namespace, capability: tuple[int, int] | None, engine) -> int:
    """List and (without --dry-run) compile phloem's Triton kernel variants for the GPU of
    `capability` into Triton's cache, for `engine` (`_engine`'s tuple); the exit code (1 when
    a variant failed). FlashInfer is assumed on that GPU, as `plan_modules` assumes it."""
    from phloem.worker.kernel_prebuild import importable

    if capability is None or not importable("triton"):
        print("no Triton kernel to compile (no GPU or no Triton); pass --cuda-arch")
        return 0
    from triton import knobs

    from phloem.worker.triton_prebuild import TritonPrebuild, default_jobs, shapes_for_engine

    engine_args, config, hf_config, dtype = engine
    shapes = shapes_for_engine(config.model, config.cache, hf_config, dtype,
                               engine_args.tensor_parallel_size, flashinfer=True)  # fmt: skip
    cache = knobs.cache.dir  # TRITON_CACHE_DIR, else Triton's default (what the engine uses)
    prebuild = TritonPrebuild(shapes, capability, default_jobs(), record_only=args.dry_run)
    seconds = prebuild.wait()
    kernels = prebuild.summary.get("kernels")
    if kernels is None:
        print("error: the Triton prebuild failed (see the log above)", file=sys.stderr)
        return 1
    for k in kernels:
        took = k.get("error") or (f"{k['seconds']:.1f} s" if "seconds" in k else "")
        print(f"Triton kernel: {k['kernel']}" + (f": {took}" if took else ""))
    if not args.dry_run:
        print(f"compiled {len(kernels)} Triton kernel variants in {seconds:.1f} s into {cache}")
    return 1 if any("error" in k for k in kernels) else 0
