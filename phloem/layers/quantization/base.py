"""The seam between linear layers and quantization: a `LinearMethod` owns a layer's weight
parameters and its matmul; a `QuantizationConfig` says which method each linear layer gets.

Life of a quantized linear layer (vLLM's `LinearMethodBase` life cycle):
    1. the model builds the layer (dense, in the model dtype);
    2. `LinearBase.set_quant_method(method)` (from `phloem.models.loader`, before any weight is
       read): the method replaces the layer's parameters with the ones the checkpoint holds
       (`create_weights`), each with a `weight_loader` that fuses and shards like the layer's own;
    3. the checkpoint (or dummy weights) fills them through those loaders;
    4. `process_weights_after_loading(layer)`: the method turns them into what its GEMM reads
       (e.g. quantizes model-dtype weights to FP8, or converts checkpoint scales);
    5. every forward calls `apply(layer, x, bias)`; where `accepts_fp8_input(layer)`, the layer
       producing x may hand it over already quantized per token (`fp8_math.Fp8Activation`,
       `phloem/worker/fusion.py` pairs them).
"""

from __future__ import annotations

import functools
import importlib
import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from phloem.layers.linear import LinearBase
    from phloem.layers.quantization.fp8_math import Fp8Activation
    from phloem.ops.skinny_rope import RopeKv


class LinearMethod(ABC):
    """How one linear layer stores its weight and computes y = x W^T + b."""

    @abstractmethod
    def create_weights(self, layer: LinearBase) -> None:
        """Replace `layer`'s parameters (registered on it) with the ones the checkpoint fills,
        each carrying `weight_loader` and `checkpoint_parts`. Mutates `layer`."""

    @abstractmethod
    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turn the loaded parameters into what `apply` reads (mutates `layer`).

        Raises:
            ValueError: naming the layer, for loaded values the method cannot use.
        """

    @abstractmethod
    def apply(
        self, layer: LinearBase, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] in x's dtype (this rank's part: a
        row-parallel layer's caller sums it over the ranks). x is an `Fp8Activation` only where
        `accepts_fp8_input(layer)`."""

    def apply_silu_and_mul(
        self, layer: LinearBase, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`apply(layer, silu(gate) * up, bias)` for gate_up [..., 2 * input_size] = [gate | up]
        (a gated MLP's gate_up output) with the activation computed inside the GEMM's kernel,
        where the method has such a kernel for this call; None where it has not (the caller then
        runs the activation and `apply`). Default: None."""
        return None

    def apply_rms_norm(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(apply(layer, RMSNorm(h), bias), h), h = x + residual (x without one), with the
        residual add and the norm computed inside the GEMM's kernel, where the method has such a
        kernel for this call; None where it has not (the caller runs the norm, then `apply`).
        Default: None."""
        return None

    def takes_qkv_rope_kv(self, layer: LinearBase, x: torch.Tensor, rope: RopeKv) -> bool:
        """Whether `apply_qkv_rope_kv(layer, x, bias, rope, None)` runs a fused kernel for this
        call (a QKV projection's, x its input). Default: False."""
        return False

    def apply_qkv_rope_kv(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        rope: RopeKv,
        norm: tuple[torch.Tensor | None, torch.Tensor, float] | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, h): the QKV projection of x (of RMSNorm(h) with `norm` = (residual or None,
        norm_weight, eps), h = x + residual or x; else of x itself, h = x) with RoPE applied to
        its q and k heads and k and v written into `rope.kv_cache` at `rope.slot_mapping`, in
        one kernel (`phloem.ops.skinny_rope`); q rotated, [T, num_heads, head_dim]. None where
        the method has no such kernel for this call (the caller runs the norm, `apply` and the
        RoPE + KV write apart); never None without `norm` where `takes_qkv_rope_kv` said yes.
        Default: None."""
        return None

    def accepts_fp8_input(self, layer: LinearBase) -> bool:
        """Whether `apply` takes its input already quantized to e4m3 per token, dynamically
        (max |x| / 448 over the token's whole row), as an `Fp8Activation`: then the layer that
        produces x may quantize it in its own kernel. Default: no."""
        return False

    def weight_bytes(self, layer: LinearBase) -> int:
        """Bytes this layer's weight and its scales occupy [bytes]."""
        return sum(p.numel() * p.element_size() for n, p in layer.named_parameters()
                   if n != "bias")  # fmt: skip


SKINNY_GEMM_ENV = "PHLOEM_SKINNY_GEMM"
SKINNY_GEMM_CONFIGS_ENV = "PHLOEM_SKINNY_GEMM_CONFIGS"
FUSED_SILU_DOWN_ENV = "PHLOEM_FUSED_SILU_DOWN"
FUSED_RMSNORM_ENV = "PHLOEM_FUSED_RMSNORM"
FUSED_QKV_ROPE_ENV = "PHLOEM_FUSED_QKV_ROPE"


@functools.cache
def skinny_gemm_mode() -> str:
    """PHLOEM_SKINNY_GEMM, read once per process (tensor-parallel ranks inherit the
    environment): "auto" (unset: the skinny-GEMM kernel for the shapes its measured table
    `skinny_gemm.CONFIGS` gives a config, where Triton imports), "1" (every decode-sized call,
    unmeasured shapes by the kernel's rule of thumb) or "0" (cuBLAS only).

    Raises:
        ValueError: naming PHLOEM_SKINNY_GEMM for another value.
    """
    value = os.environ.get(SKINNY_GEMM_ENV, "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"{SKINNY_GEMM_ENV} must be 0, 1 or auto, got {value!r}")
    return value


@functools.cache
def skinny_gemm_module():
    """`phloem.ops.skinny_gemm`, or None when `skinny_gemm_mode()` is "0" or is "auto" where
    Triton does not import; read once per process (the first dense forward on CUDA, the
    engine's start-up pass). PHLOEM_SKINNY_GEMM_CONFIGS=FILE adds the config table
    benchmarks/skinny_gemm.py wrote (`--configs-out`) to the kernel's, once.

    Raises:
        ValueError: a bad PHLOEM_SKINNY_GEMM (`skinny_gemm_mode`); naming the file for a bad
            config table.
        ImportError: PHLOEM_SKINNY_GEMM=1 where Triton does not import.
    """
    mode = skinny_gemm_mode()
    if mode == "0":
        return None
    try:
        from phloem.ops import skinny_gemm
    except ImportError:
        if mode == "1":
            raise
        return None
    table = os.environ.get(SKINNY_GEMM_CONFIGS_ENV)
    if table:
        skinny_gemm.load_configs(table)
    return skinny_gemm


@functools.cache
def skinny_gated_module():
    """`phloem.ops.skinny_gated` (SiLU-and-mul fused into the skinny down GEMM), or None when
    PHLOEM_FUSED_SILU_DOWN is "0" (default "1": on) or `skinny_gemm_module()` is None; read
    once per process, like PHLOEM_SKINNY_GEMM.

    Raises:
        ValueError: naming PHLOEM_FUSED_SILU_DOWN for a value other than 0 or 1; those of
            `skinny_gemm_module`.
    """
    return _fusion_module(FUSED_SILU_DOWN_ENV, "phloem.ops.skinny_gated")


@functools.cache
def skinny_norm_module():
    """`phloem.ops.skinny_norm` (residual add + RMSNorm fused into the skinny GEMM that reads the
    norm's output), or None when PHLOEM_FUSED_RMSNORM is "0" (default "1": on) or
    `skinny_gemm_module()` is None; read once per process, like PHLOEM_SKINNY_GEMM.

    Raises:
        ValueError: naming PHLOEM_FUSED_RMSNORM for a value other than 0 or 1; those of
            `skinny_gemm_module`.
    """
    return _fusion_module(FUSED_RMSNORM_ENV, "phloem.ops.skinny_norm")


@functools.cache
def skinny_rope_module():
    """`phloem.ops.skinny_rope` (RoPE + the KV write fused into the QKV projection's skinny
    GEMM), or None when PHLOEM_FUSED_QKV_ROPE is "0" (default "1": on, measured faster at 1-16
    rows on an H200, benchmarks/results/2026-11-27e-h200) or `skinny_gemm_module()` is None;
    read once per process, like PHLOEM_SKINNY_GEMM.

    Raises:
        ValueError: naming PHLOEM_FUSED_QKV_ROPE for a value other than 0 or 1; those of
            `skinny_gemm_module`.
    """
    return _fusion_module(FUSED_QKV_ROPE_ENV, "phloem.ops.skinny_rope")


def _fusion_module(env: str, name: str):
    """Module `name` (a skinny-GEMM fusion) when the switch `env` is on (default "1") and the
    skinny GEMM runs (`skinny_gemm_module`), else None; ValueError from either switch."""
    if not _switched_on(env) or skinny_gemm_module() is None:
        return None
    return importlib.import_module(name)


def _switched_on(env: str) -> bool:
    """The on/off switch `env` ("1" or "0", "1" when unset); ValueError naming it otherwise."""
    value = os.environ.get(env, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{env} must be 0 or 1, got {value!r}")
    return value == "1"


class UnquantizedLinearMethod(LinearMethod):
    """The dense layer: W in the model dtype, `F.linear`; calls of 1..16 rows in bf16/fp16 on
    CUDA (decode steps) go through one Triton kernel that streams W once
    (`phloem.ops.skinny_gemm`) for the shapes it measured faster than cuBLAS
    (`skinny_gemm_mode`: PHLOEM_SKINNY_GEMM=0 turns it off, =1 takes every shape). A down
    projection's call through `apply_silu_and_mul` that the kernel takes also computes the
    MLP's SiLU-and-mul in it (`phloem.ops.skinny_gated`; PHLOEM_FUSED_SILU_DOWN=0: apart), and
    a call through `apply_rms_norm` the residual add + RMSNorm before it
    (`phloem.ops.skinny_norm`; PHLOEM_FUSED_RMSNORM=0: apart).

    On the CPU the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1, the tests),
    read once here at construction so that `apply` does no environment lookup per call."""

    def __init__(self) -> None:
        self.triton_interpret = os.environ.get("TRITON_INTERPRET") == "1"

    def create_weights(self, layer: LinearBase) -> None:
        """Nothing to do: `LinearBase` builds the dense weight itself."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Nothing to do."""

    def apply(
        self, layer: LinearBase, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        assert isinstance(x, torch.Tensor), "a dense layer takes no Fp8Activation"
        mode = skinny_gemm_mode()
        # on the CPU only under Triton's interpreter (tests): no Triton import otherwise
        if mode != "0" and (x.is_cuda or self.triton_interpret):
            skinny = skinny_gemm_module()
            if skinny is not None and skinny.takes(x, layer.weight, measured_only=mode == "auto"):
                return skinny.skinny_linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def apply_silu_and_mul(
        self, layer: LinearBase, gate_up: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The skinny GEMM's SiLU-and-mul-fused launch where `apply` would send silu(gate) * up
        to the skinny GEMM (the same rows, shapes and flags), else None."""
        mode = skinny_gemm_mode()
        if mode == "0" or not (gate_up.is_cuda or self.triton_interpret):
            return None
        gated = skinny_gated_module()
        if gated is None or not gated.takes(gate_up, layer.weight, measured_only=mode == "auto"):
            return None
        return gated.silu_and_mul_linear(gate_up, layer.weight, bias)

    def apply_rms_norm(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The skinny GEMM's launch with the residual add + RMSNorm fused, where `apply` would
        send the norm's output to the skinny GEMM (the same rows, shapes and flags), else None."""
        mode = skinny_gemm_mode()
        if mode == "0" or not (x.is_cuda or self.triton_interpret):
            return None
        fused = skinny_norm_module()
        measured = mode == "auto"
        if fused is None or not fused.takes(x, residual, norm_weight, layer.weight, measured):
            return None
        return fused.rms_norm_linear(x, residual, norm_weight, eps, layer.weight, bias)

    def takes_qkv_rope_kv(self, layer: LinearBase, x: torch.Tensor, rope: RopeKv) -> bool:
        """Whether the skinny GEMM's RoPE + KV-write-fused launch takes x (where `apply` would
        send x to the skinny GEMM: the same rows, shapes and flags; `skinny_rope.takes`)."""
        mode = skinny_gemm_mode()
        if mode == "0" or not (x.is_cuda or self.triton_interpret):
            return False
        fused = skinny_rope_module()
        measured = mode == "auto"
        return fused is not None and fused.takes(x, layer.weight, rope, False, measured)

    def apply_qkv_rope_kv(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        rope: RopeKv,
        norm: tuple[torch.Tensor | None, torch.Tensor, float] | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE + KV-write-fused launch (with `norm`, the residual add + RMSNorm fused too,
        where `apply_rms_norm` would fuse it), else None."""
        if not self.takes_qkv_rope_kv(layer, x, rope):
            return None
        fused = skinny_rope_module()
        if norm is None:
            return fused.qkv_rope_kv(x, layer.weight, bias, rope), x
        residual, norm_weight, eps = norm
        normed, measured = skinny_norm_module(), skinny_gemm_mode() == "auto"
        if normed is None or not (
            fused.takes(x, layer.weight, rope, True, measured)
            and normed.takes(x, residual, norm_weight, layer.weight, measured)
        ):
            return None
        rows_x = x.contiguous()
        res = None if residual is None else residual.contiguous()
        res_out = rows_x if res is None else torch.empty_like(rows_x)
        args = fused.sk.NormArgs(res, norm_weight, float(eps), res_out)
        return fused.qkv_rope_kv(rows_x, layer.weight, bias, rope, args), res_out


class QuantizationConfig(ABC):
    """The quantization of a model: its name and each linear layer's method."""

    name: str

    @abstractmethod
    def get_method(self, module_name: str, hf_names: list[str]) -> LinearMethod | None:
        """The method of the linear layer `module_name` (phloem's name, e.g.
        "model.layers.0.self_attn.qkv_proj"), whose checkpoint modules are `hf_names` (e.g. the
        q_proj, k_proj and v_proj it fuses); None leaves it dense.

        Raises:
            ValueError: naming the layer, when its fused parts are quantized differently.
        """

    @abstractmethod
    def check_device(self, capability: tuple[int, int] | None) -> None:
        """Raise ValueError naming the requirement when a CUDA device of compute
        `capability` (None: not CUDA) cannot run this quantization."""

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` is read by nothing (e.g. static activation
        scales of a scheme that quantizes activations dynamically). Default: none is skipped."""
        return False
