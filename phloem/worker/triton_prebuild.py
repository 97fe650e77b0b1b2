"""phloem's Triton kernels compiled before their first launch, in parallel processes (issue 19).

Triton compiles a kernel variant (a kernel with its argument types, its 16-byte pointer
alignments, the integers it specializes on and its constexprs) at the first launch that needs
it, in the launching thread, writing it to its on-disk cache (TRITON_CACHE_DIR). On a fresh GPU
machine the engine's start-up therefore compiled its kernels one after another in its main
thread: the fused RoPE + KV write, SiLU-and-mul and the FP8 quantizers at the memory profile,
the shared-prefix attention kernels at the attention warm-up (112 s on an H200 host,
benchmarks/results/2026-11-26b-h200x2-serving; the small-decode kernel there too), and the
sampler's kernels (grammar mask, seeded rows' noise) stalled the first request that needed
them. Here, at the start of the
worker and before the weights load, one process (`python -m phloem.worker.triton_prebuild`):

1. records the variants the engine will launch: with a compile-only Triton driver (the target
   GPU's architecture, no device) and Triton's `jit_cache_hook` returning "do not compile",
   each op module's `compile_variants` hook calls its kernel's launch wrapper on small CPU
   tensors laid out as the model's; the launch goes through `JITFunction.run` exactly as on
   the GPU (binder, specialization, options) and the hook keeps Triton's serialized
   specialization of each new variant, launching nothing;
2. compiles them N at a time in forked worker processes, each through
   `JITFunction.preload(specialization)`, the path Triton's own runtime compiles through, so
   the cache key it writes is the one the engine's first launch computes (a CPU test checks
   the two keys agree for every variant).

The engine `wait()`s for it before its first forward pass; every launch then finds its kernel
in the cache. A failed prebuild (or a variant it missed) is logged, and the first launch
compiles as before. Only one prebuild runs per cache directory at a time (a file lock): the
tensor-parallel ranks and data-parallel replicas of one machine compile each variant once.
`phloem prebuild-kernels` runs the same process ahead of time, on a GPU machine or on a CPU
one given `--cuda-arch`.

    |-- start: prebuild process: record variants | compile them, N processes at once ---|
    |-- main:  load weights ----------------------------------------|-- wait --|-- profile ...
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

logger = logging.getLogger(__name__)

ENV_SWITCH = "PHLOEM_TRITON_PREBUILD"  # "0": no prebuild (every kernel compiles at first use)
ENV_JOBS = "PHLOEM_TRITON_PREBUILD_JOBS"  # compile processes (default: the usable CPUs)


@dataclass(frozen=True)
class TritonShapes:
    """What decides the variants of phloem's Triton kernels an engine launches (one
    tensor-parallel rank's geometry).

    Attributes:
        num_heads / num_kv_heads / head_dim: this rank's attention geometry.
        rotary_dim: the rotated part of each head (RoPE).
        hidden_size / intermediate_size: the model's width and this rank's MLP width.
        dtype / kv_dtype: torch dtype names of the activations and of the KV cache.
        block_size: tokens per KV block; kv_layout: "NHD" or "HND".
        fp8_quant: "" (dense linear layers), "fused" (FP8 W8A8, dynamic per-token scales,
            norms and activations quantize their own output) or "per_token" (the same with
            PHLOEM_FP8_FUSED_QUANT=0: each FP8 layer quantizes its input).
        tp_size: tensor-parallel ranks (a row-parallel layer's slice quantizes in torch).
        shared_prefix: the shared-prefix Triton kernels run (the attention backend wraps them).
        cuda_graphs: decode steps are captured, the shared-prefix graph variant among them.
        small_decode: the small-decode attention kernel runs (`small_decode_rule`: by default
            over FlashInfer; one variant for every batch size, length and graph).
        skinny_gemm: which dense projections' decode-sized calls run the skinny-GEMM kernel
            (`layers.quantization.base.skinny_gemm_mode`): "0" none, "auto" the shapes its
            table measured faster than cuBLAS, "1" all.
        fused_qkv_rope: the qkv projection's decode-sized calls run RoPE and the KV write in
            its skinny GEMM (PHLOEM_FUSED_QKV_ROPE, default 1; `phloem.ops.skinny_rope`).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    hidden_size: int
    intermediate_size: int
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    block_size: int = 16
    kv_layout: str = "NHD"
    fp8_quant: str = ""
    tp_size: int = 1
    shared_prefix: bool = True
    cuda_graphs: bool = True
    small_decode: bool = True
    skinny_gemm: str = "0"
    fused_qkv_rope: bool = False

    def __post_init__(self) -> None:
        if self.skinny_gemm not in ("0", "auto", "1"):
            raise ValueError(f"skinny_gemm must be '0', 'auto' or '1', got {self.skinny_gemm!r}")
        if self.fp8_quant not in ("", "fused", "per_token"):
            raise ValueError(
                f"fp8_quant must be '', 'fused' or 'per_token', got {self.fp8_quant!r}"
            )
        for name in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def launch_all(shapes: TritonShapes) -> list[str]:
    """Call every op module's `compile_variants` hook that an engine of `shapes` launches
    (only under `CompileOnlyDriver`: they launch on CPU tensors), each on its own: one that
    raises leaves the others' variants recorded. Returns the failures, one line each."""
    errors = []
    for name, call in _hooks(shapes):
        try:
            call()
        except Exception as e:  # reported: that op's kernels compile at first use
            errors.append(f"{name}: {type(e).__name__}: {e}")
    return errors


def _hooks(s: TritonShapes) -> list[tuple[str, Any]]:
    """(name, call) of each `compile_variants` hook an engine of `s` launches."""
    import torch

    from phloem.ops import (
        activation,
        fp8_fused_quant,
        fp8_quant,
        rope_kv,
        seeded_noise_triton,
        token_bitmask_triton,
    )
    from phloem.ops.attention import shared_prefix_variants, small_decode
    from phloem.worker.kernel_prebuild import comm_triton_hooks

    dtype, kv_dtype = getattr(torch, s.dtype), getattr(torch, s.kv_dtype)
    hooks = [("rope_kv", partial(rope_kv.compile_variants, s.num_heads, s.num_kv_heads,
              s.head_dim, s.rotary_dim, s.block_size, dtype, kv_dtype, s.kv_layout))]  # fmt: skip
    # the down projection takes the activation pre-quantized only when its input is whole
    fused_down = s.fp8_quant == "fused" and s.tp_size == 1
    if not fused_down:
        hooks.append(("activation", partial(activation.compile_variants, s.intermediate_size,
                                            dtype)))  # fmt: skip
    if s.fp8_quant == "fused":
        down = s.intermediate_size if fused_down else None
        hooks.append(("fp8_fused_quant", partial(fp8_fused_quant.compile_variants,
                                                 s.hidden_size, down, dtype)))  # fmt: skip
    widths = {"fused": [s.num_heads * s.head_dim] if s.tp_size == 1 else [],  # o_proj's input
              "per_token": [s.hidden_size] + ([s.num_heads * s.head_dim, s.intermediate_size]
                                              if s.tp_size == 1 else [])}  # fmt: skip
    for width in widths.get(s.fp8_quant, []):
        hooks.append(("fp8_quant", partial(fp8_quant.compile_variants, width, dtype)))
    if s.skinny_gemm != "0":  # the dense projections' decode-sized calls
        hooks.extend(_skinny_hook(s, dtype, kv_dtype))
    hooks.extend(comm_triton_hooks(s.hidden_size, s.tp_size, dtype))  # PHLOEM_TP_ALLREDUCE
    # the sampler's grammar mask (structured outputs): any engine may get a constrained request
    hooks.append(("token_bitmask", partial(token_bitmask_triton.compile_variants, dtype)))
    # the sampler's seeded rows' noise: any engine may get a request with a seed
    hooks.append(("seeded_noise", seeded_noise_triton.compile_variants))
    if s.shared_prefix:
        hooks.append(("shared_prefix", partial(shared_prefix_variants.compile_variants, s.num_heads,
                      s.num_kv_heads, s.head_dim, s.block_size, dtype, kv_dtype, s.cuda_graphs,
                      kv_layout=s.kv_layout)))  # fmt: skip
    if s.small_decode:
        hooks.append(("small_decode", partial(small_decode.compile_variants, s.num_heads,
                      s.num_kv_heads, s.head_dim, s.block_size, dtype, kv_dtype, s.kv_layout)))  # fmt: skip
    return hooks


def pin_cache_dir() -> str:
    """Set TRITON_CACHE_DIR to Triton's default (~/.triton/cache) when it is unset, and return
    it. Without this the engine's kernels would land in one of two directories by the order of
    first launches: inductor (torch.compile) sets TRITON_CACHE_DIR to its own directory when it
    loads its first kernel, if unset, and every later Triton compile follows it."""
    from triton import knobs

    os.environ.setdefault("TRITON_CACHE_DIR", knobs.cache.dir)
    return os.environ["TRITON_CACHE_DIR"]


def default_jobs() -> int:
    """Compile processes: PHLOEM_TRITON_PREBUILD_JOBS, else the CPUs this process may use.

    Raises:
        ValueError: naming PHLOEM_TRITON_PREBUILD_JOBS when it is not a positive integer.
    """
    value = os.environ.get(ENV_JOBS)
    if value is None:
        return len(os.sched_getaffinity(0))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV_JOBS} must be a positive integer, got {value!r}")
    return int(value)


class TritonPrebuild:
    """The prebuild process (`phloem.worker.triton_variants`), started at once; `wait()` for it
    before the first launch of a phloem Triton kernel. Nothing starts without `shapes`.

    Args:
        shapes: what the engine launches (None: nothing to prebuild).
        arch: the GPU's compute capability (major, minor).
        jobs: compile processes. record_only: list the variants, compile none (a dry run).
        command: the process to run (tests); default `python -m phloem.worker.triton_variants`.
        timeout_s: how long `wait()` waits before it stops the process [s].
    """

    def __init__(
        self,
        shapes: TritonShapes | None,
        arch: tuple[int, int] = (9, 0),
        jobs: int = 1,
        record_only: bool = False,
        command: list[str] | None = None,
        timeout_s: float = 900.0,
    ) -> None:
        self.shapes = shapes
        self.summary: dict[str, Any] = {}
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        if shapes is None:
            return
        request = {"shapes": asdict(shapes), "arch": list(arch), "jobs": jobs,
                   "compile": not record_only}  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # the child imports this phloem (the kernels' source is part of their cache key)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        # files, not pipes: the engine reads nothing until wait(), and a full pipe would stall it
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self._start = time.perf_counter()
        try:
            self._proc = subprocess.Popen(
                command or [sys.executable, "-m", "phloem.worker.triton_variants"],
                stdin=subprocess.PIPE, stdout=self._out, stderr=self._err, env=env,
            )  # fmt: skip
        except OSError as e:
            logger.warning("Triton prebuild not started (%s); kernels compile at first use", e)
            return
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(request).encode())
            self._proc.stdin.close()
        except BrokenPipeError:  # it ended already: wait() reports how
            pass

    def wait(self) -> float:
        """Block until the prebuild ends; returns the seconds since it started (0.0 when none
        ran). Its summary lands in `summary` ("kernels": one report per variant). A failure,
        of the process or of a variant, is logged as a warning, not raised: what was not
        compiled compiles at its first launch, as without a prebuild."""
        if self._proc is None:
            return 0.0
        try:
            code = self._proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()  # this prebuild's own process (its pool exits once it is gone)
            code = self._proc.wait()
        seconds = time.perf_counter() - self._start
        self._proc = None
        self._out.seek(0)
        self._err.seek(0)
        out, err = (
            self._out.read().decode(errors="replace"),
            self._err.read().decode(errors="replace"),
        )
        self._out.close()
        self._err.close()
        try:
            if code != 0:
                raise ValueError(f"exit {code}")
            self.summary = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError) as e:  # a failed process, or no summary from it
            logger.warning("Triton prebuild failed (%s); kernels compile at first use: %s",
                           e, err.strip()[-2000:])  # fmt: skip
            return seconds
        _log_summary(self.summary, seconds)
        return seconds


def _log_summary(summary: dict[str, Any], seconds: float) -> None:
    for error in summary.get("record_errors", []):
        logger.warning("Triton prebuild could not list the variants of %s (they compile at "
                       "first use)", error)  # fmt: skip
    kernels = summary.get("kernels", [])
    failed = [k for k in kernels if "error" in k]
    for k in failed:
        logger.warning("Triton prebuild of %s failed (it compiles at first use): %s",
                       k["kernel"], k["error"])  # fmt: skip
    if "seconds" not in summary:  # recorded only (a dry run)
        logger.info("Triton kernel variants planned: %d", summary.get("variants", 0))
        return
    cached = sum(bool(k.get("cached")) for k in kernels)
    logger.info(
        "Triton kernels ready in %.1f s: %d variants (%d compiled, %d cached, %d failed) in %s",
        seconds, summary.get("variants", 0), len(kernels) - cached - len(failed), cached,
        len(failed), summary.get("cache_dir"),
    )  # fmt: skip


def _skinny_hook(s: TritonShapes, dtype, kv_dtype) -> list[tuple[str, Any]]:
    """The skinny-GEMM hook for one rank's qkv, o, gate_up and down projections (no bias),
    and with `fused_qkv_rope` the qkv projection's RoPE + KV-write-fused launches."""
    from phloem.ops import skinny_gemm as skinny
    from phloem.ops import skinny_rope

    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes = [(q + 2 * kv, s.hidden_size), (s.hidden_size, q),
              (2 * s.intermediate_size, s.hidden_size), (s.hidden_size, s.intermediate_size)]  # fmt: skip
    measured = s.skinny_gemm == "auto"
    hooks = [("skinny_gemm", partial(skinny.compile_variants, shapes, dtype, measured))]
    if s.fused_qkv_rope and s.rotary_dim == s.head_dim:
        hooks.append(("skinny_rope", partial(skinny_rope.compile_variants, s.num_heads,
                      s.num_kv_heads, s.head_dim, s.hidden_size, s.block_size, dtype, kv_dtype,
                      s.kv_layout, measured)))  # fmt: skip
    return hooks


def shapes_for_engine(
    model_config, cache_config, hf_config, dtype: str, tp_size: int = 1,
    flashinfer: bool | None = None,
) -> TritonShapes:  # fmt: skip
    """The `TritonShapes` of an engine: the model's geometry on one of `tp_size` ranks, its
    dtypes and KV cache, its FP8 scheme, whether the shared-prefix kernels run (the rule
    of `ops.attention.get_attention_backend`: "shared_prefix", or "auto" over FlashInfer)
    and are captured in CUDA graphs, and whether the small-decode kernel runs (`_small_decode`).

    Args:
        model_config / cache_config: the engine's configs. hf_config: the model's config.
        dtype: the resolved activation dtype's torch name ("bfloat16").
        flashinfer: whether FlashInfer is installed where the engine runs (None: here).
    Raises:
        ValueError: a quantization the checkpoint contradicts (`resolve_quantization`), or a
            malformed PHLOEM_SMALL_DECODE_* value.
    """
    from phloem.layers.quantization.base import FUSED_QKV_ROPE_ENV, skinny_gemm_mode
    from phloem.layers.quantization.formats import Fp8Config, resolve_quantization
    from phloem.layers.rotary import rope_parameters_from_hf
    from phloem.ops.attention import FLASHINFER_HEAD_DIMS
    from phloem.worker.kernel_prebuild import FP8_KV, head_dim_of, importable

    head_dim = head_dim_of(hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    quant = resolve_quantization(model_config.quantization, hf_config, model_config.load_format)
    fp8 = ""
    if isinstance(quant, Fp8Config) and not quant.scheme.static_input:
        fp8 = "per_token" if os.environ.get("PHLOEM_FP8_FUSED_QUANT", "1") == "0" else "fused"
    backend = model_config.attention_backend
    if flashinfer is None:
        flashinfer = importable("flashinfer")
    flashinfer = flashinfer and head_dim in FLASHINFER_HEAD_DIMS
    shared = backend == "shared_prefix" or (backend == "auto" and flashinfer)
    skinny = skinny_gemm_mode() if quant is None and dtype in ("bfloat16", "float16") else "0"
    num_heads, num_kv_heads = heads // tp_size, max(1, kv_heads // tp_size)
    rope = rope_parameters_from_hf(hf_config)
    return TritonShapes(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size // tp_size,
        dtype=dtype,
        kv_dtype=FP8_KV if cache_config.kv_cache_dtype == "fp8" else dtype,
        block_size=cache_config.block_size,
        kv_layout=cache_config.kv_layout,
        fp8_quant=fp8,
        tp_size=tp_size,
        shared_prefix=shared,
        # the graph variant needs a fallback that captures (FlashInfer) and GQA <= 16 rows
        cuda_graphs=not model_config.enforce_eager
        and flashinfer
        and num_heads // num_kv_heads <= 16,
        small_decode=_small_decode(backend, flashinfer),
        skinny_gemm=skinny,
        fused_qkv_rope=skinny != "0" and os.environ.get(FUSED_QKV_ROPE_ENV, "1") == "1",
    )


def _small_decode(backend: str, flashinfer: bool) -> bool:
    """Whether an engine of attention backend `backend` on CUDA wraps its plain backend
    (FlashInfer where `flashinfer` and the name is not "reference") in the small-decode
    kernel (`small_decode_rule.SmallDecodeSettings.enabled`). Raises ValueError for a
    malformed PHLOEM_SMALL_DECODE_* value."""
    from phloem.ops.attention.small_decode_rule import SmallDecodeSettings

    plain = "flashinfer" if flashinfer and backend != "reference" else "reference"
    return SmallDecodeSettings.from_env().enabled("cuda", plain)


def prebuild_for_engine(
    model_config, cache_config, hf_config, device, dtype, tp_size: int = 1
) -> TritonPrebuild:
    """The Triton prebuild of an engine's worker, started; nothing on a CPU, without Triton,
    under TRITON_INTERPRET or with PHLOEM_TRITON_PREBUILD=0. On CUDA it first pins
    TRITON_CACHE_DIR (`pin_cache_dir`), so the prebuild and the engine's launches share one
    cache. A configuration it cannot plan is logged and left to first use.

    Args:
        model_config / cache_config: the worker's configs. hf_config: the model's config.
        device: its torch device. dtype: its resolved torch dtype. tp_size: ranks.
    """
    from phloem.worker.kernel_prebuild import importable

    if device.type != "cuda" or not importable("triton"):
        return TritonPrebuild(None)
    pin_cache_dir()
    if os.environ.get(ENV_SWITCH) == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return TritonPrebuild(None)
    import torch

    try:
        name = str(dtype).removeprefix("torch.")
        shapes = shapes_for_engine(model_config, cache_config, hf_config, name, tp_size)
        jobs = default_jobs()
    except (ValueError, AttributeError) as e:
        logger.warning("no Triton prebuild (%s); kernels compile at first use", e)
        return TritonPrebuild(None)
    return TritonPrebuild(shapes, torch.cuda.get_device_capability(device), jobs)
