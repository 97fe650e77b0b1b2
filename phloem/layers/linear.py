"""Linear layers that load HF checkpoints through a per-parameter `weight_loader`.

Every parameter carries `param.weight_loader(param, loaded_weight, shard_id=None)`, so a model's
`load_weights` only maps names; fusing (q,k,v into one matrix, gate/up into one) and
tensor-parallel sharding (Megatron-LM, Shoeybi et al. 2019, §3) live here. Column-parallel layers
hold a slice of the output features, row-parallel ones a slice of the input features and sum
their partial outputs over the ranks (one all-reduce per layer). The rank and size are read from
`phloem.distributed.parallel_state` when a layer is built; every loader narrows the checkpoint
tensor to this rank's shard. A checkpoint tensor is a `torch.Tensor` or a `CheckpointSlice` (not
read yet): a loader then reads only its shard from the file.

Each parameter also carries `param.checkpoint_parts(param)`: the checkpoint tensors (shard id,
full shape) that fill it, which random ("dummy") weights draw at full size and load through the
same loader, so every TP size holds shards of the same model.

Weights are [out_features, in_features] like `nn.Linear`; parameters are created uninitialized
(`torch.empty`) because loading (or the dummy init in `phloem.models.loader`) overwrites them.

Quantization plugs in through one declared seam: every layer computes through its
`quant_method` (`phloem.layers.quantization.base.LinearMethod`; dense by default), and
`set_quant_method` hands a layer to another method before its weights load. The method's
parameters (an FP8 weight, its scales) load through the same loaders, so they fuse and shard
like the dense weight: a per-output-channel scale [out] is sharded like a bias (sliced by
column-parallel layers, whole in row-parallel ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phloem.distributed.communication import tp_all_reduce
from phloem.distributed.parallel_state import tp_rank, tp_size
from phloem.layers.quantization.base import LinearMethod, UnquantizedLinearMethod
from phloem.layers.quantization.fp8_math import Fp8Activation

if TYPE_CHECKING:
    from phloem.layers.norm import RMSNorm
    from phloem.ops.skinny_rope import RopeKv

WeightShardId = str | int | None
CheckpointParts = list[tuple[WeightShardId, tuple[int, ...]]]


class CheckpointSlice:
    """A checkpoint tensor not read yet (a safetensors lazy slice, `safe_open().get_slice`):
    weight loaders `narrow` it to their shard, which reads only that part of the file.

    Attributes:
        shape: the tensor's full shape.
    """

    def __init__(self, lazy: Any) -> None:
        self._lazy = lazy
        self.shape = torch.Size(lazy.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Elements [start, start + length) along `dim` (all of the other dims), read now."""
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._lazy[index]

    def full(self) -> torch.Tensor:
        """The whole tensor, read now (`[...]`: also a 0-dim one, e.g. a per-tensor scale, which
        `[:]` cannot slice)."""
        return self._lazy[...]


Loaded = torch.Tensor | CheckpointSlice


def _tensor(loaded: Loaded) -> torch.Tensor:
    """The whole checkpoint tensor (read now when it is a `CheckpointSlice`)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.full()


def _tp_world() -> tuple[int, int]:
    """(tp_rank, tp_size) of this process (`phloem.distributed.parallel_state`)."""
    return tp_rank(), tp_size()


def _check_shape(param: torch.Tensor, loaded: Loaded, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"parameter expects {tuple(param.shape)}"
        )


def _per_rank(size: int, what: str) -> int:
    """`size` split evenly over the TP ranks; ValueError naming `what` when it does not divide."""
    _, ranks = _tp_world()
    if size % ranks:
        raise ValueError(f"{what} {size} not divisible by tp_size {ranks}")
    return size // ranks


def _check_no_shard(module: nn.Module, shard_id: WeightShardId) -> None:
    if shard_id is not None:
        raise ValueError(f"{type(module).__name__} takes no shard id, got {shard_id!r}")


def _shard(loaded: Loaded, dim: int, rank: int, size: int, total: int, what: str) -> torch.Tensor:
    """Rank `rank`'s slice [rank*size, (rank+1)*size) of `loaded` along `dim`, after checking
    that the checkpoint tensor has the full (unsharded) extent `total` there (only that slice
    is read from a `CheckpointSlice`)."""
    if loaded.dim() <= dim or loaded.shape[dim] != total:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {total} "
            f"along dim {dim}"
        )
    return loaded.narrow(dim, rank * size, size)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: Loaded, shard_id: WeightShardId = None
) -> None:
    """Copy a checkpoint tensor of exactly the parameter's shape (dtype/device converted): a
    parameter replicated on every TP rank.

    Raises:
        ValueError: for a shard id or a shape mismatch.
    """
    if shard_id is not None:
        raise ValueError(f"this parameter takes no shard id, got {shard_id!r}")
    _check_shape(param, loaded_weight, "parameter")
    param.data.copy_(_tensor(loaded_weight))


def default_checkpoint_parts(param: nn.Parameter) -> CheckpointParts:
    """A replicated parameter is one checkpoint tensor of its own shape."""
    return [(None, tuple(param.shape))]


class LinearBase(nn.Module):
    """y = x W^T + b with W [output_size, input_size] (this rank's shard), uninitialized.

    Attributes:
        input_is_sharded: True when the input features are split over the TP ranks (the
            row-parallel layers): a weight's per-output-channel statistics then span ranks.
        quant_method: how the weight is stored and multiplied (`UnquantizedLinearMethod`
            unless `set_quant_method` was called).
    """

    input_is_sharded = False

    def __init__(
        self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = _tp_world()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), False)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(output_size, dtype=dtype), False
            )
        else:
            self.register_parameter("bias", None)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
                param.checkpoint_parts = self.checkpoint_parts  # type: ignore[attr-defined]
        self.quant_method: LinearMethod = UnquantizedLinearMethod()

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size], in x's dtype. x is an `Fp8Activation`
        (already quantized per token) only where `quant_method.accepts_fp8_input(self)`."""
        return self.quant_method.apply(self, x, self.bias)

    def forward_silu_and_mul(
        self, gate_up: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor | Fp8Activation]
    ) -> torch.Tensor:
        """self(act_fn(gate_up)) for gate_up [..., 2 * input_size] = [gate | up] and `act_fn` its
        SiLU-and-mul (`SiluAndMul`), with the activation computed inside the GEMM where
        `quant_method.apply_silu_and_mul` takes the call (decode-sized calls of the skinny GEMM:
        one kernel instead of two), else the two apart."""
        out = self.quant_method.apply_silu_and_mul(self, gate_up, self.bias)
        return self(act_fn(gate_up)) if out is None else out

    def forward_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x, residual)[0]), x + residual), or (self(norm(x)), x) without a residual,
        for `norm` the RMSNorm whose output only this layer reads (a decoder layer's qkv and
        gate_up projections): the residual add and the norm computed inside the GEMM where
        `quant_method.apply_rms_norm` takes the call (decode-sized calls of the skinny GEMM: one
        kernel instead of two) and the layer's input is whole on this rank and the norm has no
        all-reduce of its own to run (`RMSNorm.reduces_input`); else the norm's own path."""
        if not (self.input_is_sharded or norm.reduces_input):
            fused = self.quant_method.apply_rms_norm(
                self, x, residual, norm.weight, norm.eps, self.bias
            )
            if fused is not None:
                return fused
        if residual is None:
            return self(norm(x)), x
        normed, residual = norm(x, residual)
        return self(normed), residual

    def set_quant_method(self, method: LinearMethod) -> None:
        """Compute through `method` from now on; it replaces the weight parameters with its own
        (`LinearMethod.create_weights`). Call before the weights load. Mutates the layer."""
        self.quant_method = method
        method.create_weights(self)

    def set_parameter(self, name: str, data: torch.Tensor, weight_loader: Any = None) -> None:
        """Register (or replace) parameter `name` holding `data` (no grad), loaded by
        `weight_loader` (default: the layer's own, which fuses and shards along dim 0 like the
        weight's rows) and described by the layer's `checkpoint_parts`."""
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = weight_loader or self.weight_loader  # type: ignore[attr-defined]
        param.checkpoint_parts = self.checkpoint_parts  # type: ignore[attr-defined]
        setattr(self, name, param)

    def part_shapes(self) -> CheckpointParts:
        """The checkpoint tensors (shard id, full unsharded shape) the weight is made of, in
        order: [(None, (out, in))] for an unfused layer, one per part for a fused one."""
        return self.checkpoint_parts(self.weight)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Loaded, shard_id: WeightShardId = None
    ) -> None:
        """Copy a whole (unsharded-in-TP-sense) tensor into `param`; converts dtype and device."""
        _check_no_shard(self, shard_id)
        _check_shape(param, loaded_weight, type(self).__name__)
        param.data.copy_(_tensor(loaded_weight))

    def checkpoint_parts(self, param: nn.Parameter) -> CheckpointParts:
        """The checkpoint tensors (shard id, full shape) that fill `param`, stacked along dim 0."""
        return default_checkpoint_parts(param)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """The full matrix on every TP rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split over TP ranks (rank r holds rows r*out/tp .. (r+1)*out/tp)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, _per_rank(output_size, "output_size"), bias, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Loaded, shard_id: WeightShardId = None
    ) -> None:
        _check_no_shard(self, shard_id)
        size, what = param.shape[0], type(self).__name__
        loaded_weight = _shard(loaded_weight, 0, self.tp_rank, size, size * self.tp_size, what)
        _check_shape(param, loaded_weight, what)
        param.data.copy_(loaded_weight)

    def checkpoint_parts(self, param: nn.Parameter) -> CheckpointParts:
        return [(None, (param.shape[0] * self.tp_size, *param.shape[1:]))]


class RowParallelLinear(LinearBase):
    """Input features split over TP ranks; the partial outputs are summed over the ranks (one
    all-reduce) before the bias, which is replicated, is added once."""

    input_is_sharded = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(_per_rank(input_size, "input_size"), output_size, bias, dtype)

    # True: the output is this rank's partial sum; the RMSNorm that consumes it all-reduces
    # (`LlamaModel.defer_all_reduces_to_norms`; only for layers without a bias)
    defers_all_reduce = False

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """x [..., input_size / tp] (this rank's slice) -> [..., output_size], summed over the
        ranks (in place, one all-reduce; none at tp_size 1, nor when `defers_all_reduce`)."""
        if self.tp_size == 1 or self.defers_all_reduce:
            return self.quant_method.apply(self, x, self.bias)
        return self._all_reduce(self.quant_method.apply(self, x, None))

    def forward_silu_and_mul(
        self, gate_up: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor | Fp8Activation]
    ) -> torch.Tensor:
        """`LinearBase.forward_silu_and_mul`, summed over the ranks as `forward` sums (gate_up:
        this rank's [gate | up] slices)."""
        local = self.tp_size == 1 or self.defers_all_reduce
        out = self.quant_method.apply_silu_and_mul(self, gate_up, self.bias if local else None)
        if out is None:
            return self(act_fn(gate_up))
        return out if local else self._all_reduce(out)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial output summed over the ranks (in place), then the bias."""
        out = tp_all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Loaded, shard_id: WeightShardId = None
    ) -> None:
        _check_no_shard(self, shard_id)
        if param.dim() == 2:
            size, what = param.shape[1], type(self).__name__
            loaded_weight = _shard(loaded_weight, 1, self.tp_rank, size, size * self.tp_size, what)
        _check_shape(param, loaded_weight, type(self).__name__)
        param.data.copy_(_tensor(loaded_weight))

    def checkpoint_parts(self, param: nn.Parameter) -> CheckpointParts:
        if param.dim() == 2:
            return [(None, (param.shape[0], param.shape[1] * self.tp_size))]
        return default_checkpoint_parts(param)


class MergedColumnLinear(ColumnParallelLinear):
    """Several column-parallel matrices with the same input fused along the output (gate/up).

    Args:
        output_sizes: the full output size of each part, e.g. [intermediate, intermediate].
    Shard ids are the part indices 0, 1, ...; each part is split over TP ranks on its own.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        for i, size in enumerate(self.output_sizes):
            _per_rank(size, f"MergedColumnLinear part {i} output_size")
        super().__init__(input_size, sum(output_sizes), bias, dtype)

    def checkpoint_parts(self, param: nn.Parameter) -> CheckpointParts:
        return [(i, (size, *param.shape[1:])) for i, size in enumerate(self.output_sizes)]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Loaded, shard_id: WeightShardId = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"MergedColumnLinear needs a part index in [0, {len(self.output_sizes)}), "
                f"got {shard_id!r}"
            )
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset, size = sum(sizes[:shard_id]), sizes[shard_id]
        what = f"MergedColumnLinear part {shard_id}"
        total = self.output_sizes[shard_id]
        loaded_weight = _shard(loaded_weight, 0, self.tp_rank, size, total, what)
        target = param.data.narrow(0, offset, size)
        _check_shape(target, loaded_weight, what)
        target.copy_(loaded_weight)


class QKVLinear(ColumnParallelLinear):
    """Fused q, k, v projections: output rows [q (H*D) | k (H_kv*D) | v (H_kv*D)] of this rank.

    Loads HF's separate q_proj / k_proj / v_proj tensors (weights and biases) with shard ids
    "q", "k", "v". Under TP each rank holds H/tp query heads and max(1, H_kv/tp) KV heads (KV heads
    are replicated when tp > H_kv).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        _, ranks = _tp_world()
        if num_heads % ranks or (num_kv_heads % ranks and ranks % num_kv_heads):
            raise ValueError(
                f"heads ({num_heads} q, {num_kv_heads} kv) cannot be split over tp_size {ranks}"
            )
        self.head_dim = head_dim
        self.num_heads = num_heads // ranks
        self.num_kv_heads = max(1, num_kv_heads // ranks)
        self.kv_replicas = max(1, ranks // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # Total over ranks so ColumnParallelLinear's per-rank division lands on q_size + 2*kv_size.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * ranks, bias, dtype)

    def checkpoint_parts(self, param: nn.Parameter) -> CheckpointParts:
        rest = tuple(param.shape[1:])
        kv_total = self.kv_size * self.tp_size // self.kv_replicas
        return [("q", (self.q_size * self.tp_size, *rest)), ("k", (kv_total, *rest)),
                ("v", (kv_total, *rest))]  # fmt: skip

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Loaded, shard_id: WeightShardId = None
    ) -> None:
        kv_rank = self.tp_rank // self.kv_replicas
        kv_total = self.kv_size * self.tp_size // self.kv_replicas
        if shard_id == "q":
            offset, size, rank, total = 0, self.q_size, self.tp_rank, self.q_size * self.tp_size
        elif shard_id == "k":
            offset, size, rank, total = self.q_size, self.kv_size, kv_rank, kv_total
        elif shard_id == "v":
            offset, size, rank, total = self.q_size + self.kv_size, self.kv_size, kv_rank, kv_total
        else:
            raise ValueError(f"QKVLinear shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        what = f"QKVLinear shard {shard_id!r}"
        loaded_weight = _shard(loaded_weight, 0, rank, size, total, what)
        target = param.data.narrow(0, offset, size)
        _check_shape(target, loaded_weight, what)
        target.copy_(loaded_weight)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q_size + 2*kv_size] -> views q [T, q_size], k [T, kv_size], v [T, kv_size]."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def forward_rope_kv(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, rope: RopeKv
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, h): the projection of norm(h) (h = x + residual, or x without one; `norm` the
        decoder layer's input RMSNorm) with RoPE on its q and k heads and k and v written into
        `rope.kv_cache`, where `quant_method.takes_qkv_rope_kv` takes the call (decode-sized
        calls of the skinny GEMM unless PHLOEM_FUSED_QKV_ROPE=0: `phloem.ops.skinny_rope`); the norm
        fused too where `forward_rms_norm` would fuse it, else run apart first. q: rotated,
        [T, num_heads, head_dim]. None, with nothing run, where the call is not taken (the
        caller runs `forward_rms_norm`, then RoPE and the KV write). The qkv shard is
        column-parallel: its heads and its input are whole on this rank under TP.
        """
        method = self.quant_method
        if not method.takes_qkv_rope_kv(self, x, rope):
            return None
        if not norm.reduces_input:
            fused = method.apply_qkv_rope_kv(self, x, self.bias, rope, (residual, norm.weight,
                                                                       norm.eps))  # fmt: skip
            if fused is not None:
                return fused
        if residual is None:
            normed, residual = norm(x), x
        else:
            normed, residual = norm(x, residual)
        out = method.apply_qkv_rope_kv(self, normed, self.bias, rope, None)
        assert out is not None, "takes_qkv_rope_kv said the kernel takes these rows"
        return out[0], residual
