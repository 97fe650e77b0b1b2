"""FP8 e4m3 W8A8 linear layers: weights in float8 with fp32 scales, activations quantized in the
step (Micikevicius et al., arXiv 2209.05433; the scheme of vLLM's `quantization="fp8"` and
llm-compressor's FP8_DYNAMIC).

Two sources of FP8 weights:
- online (`LLM(quantization="fp8")` on a bf16/fp16/fp32 checkpoint, or dummy weights): the
  layer loads its dense weight, then `process_weights_after_loading` quantizes it with one scale
  per output channel. A row-parallel shard holds part of each row, so its row maxima are
  combined over the TP ranks first: every TP size quantizes to the same numbers.
- a checkpoint (`formats.py`): the FP8 weight is kept as stored (never dequantized on the CPU)
  and its scales are converted, as they load, into what the GEMM reads: a per-tensor scale is
  broadcast over its part's rows (exact), per-channel scales are taken as they are, and block
  scales [ceil(N/bn), ceil(K/bk)] are expanded over rows to [N, ceil(K/bk)] (exact; the CPU path
  dequantizes with them). The CUDA path has no block-scaled GEMM here, so on CUDA block-scaled
  weights are dequantized and requantized per output channel once at load (lossy: a second
  rounding to e4m3, ~2^-4 relative on the elements whose block scale was not the row's).

Activations: per token, dynamic (scale = max |x| over the token / 448), or one static scale
from the checkpoint (`input_scale`; a fused layer takes the largest of its parts'). A
row-parallel layer's input is split over the TP ranks; its per-token maxima are combined over
the ranks (one all-gather of T floats per layer and step), so every TP size rounds the same
numbers and TP = N computes what TP = 1 does, up to the order of the fp32 sums. GEMM: on
CUDA, `torch._scaled_mm` with row-wise scales when N and K are multiples of 16; else (and on the
CPU) `fp8_linear_reference`, exact with respect to the same quantized operands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from phloem.distributed.communication import tp_all_gather
from phloem.layers.quantization import fp8_math
from phloem.layers.quantization.base import LinearMethod

if TYPE_CHECKING:
    from phloem.layers.linear import LinearBase, Loaded, WeightShardId


@dataclass(frozen=True)
class Fp8Scheme:
    """What an FP8 layer holds and how its activations are scaled.

    Attributes:
        serialized: the checkpoint holds FP8 weights and scales (False: quantize at load).
        weight_strategy: "channel" (scale per output row), "tensor" (one per checkpoint
            tensor) or "block" (one per `block_size` tile); checkpoints only.
        block_size: (rows bn, columns bk) of a block ("block" only).
        weight_scale_name: the checkpoint name of the scale ("weight_scale", or
            "weight_scale_inv" in DeepSeek-style block checkpoints: a multiplier despite the name).
        static_input: activations use the checkpoint's per-tensor `input_scale` (False: per
            token, dynamic).
    """

    serialized: bool = False
    weight_strategy: Literal["channel", "tensor", "block"] = "channel"
    block_size: tuple[int, int] | None = None
    weight_scale_name: str = "weight_scale"
    static_input: bool = False

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The checkpoint shape of the weight scale of a [rows, cols] FP8 tensor (channel scales
        may also be [rows, 1]; tensor scales may be [] or [1])."""
        if self.weight_strategy == "block" and self.block_size is not None:
            bn, bk = self.block_size
            return (-(-rows // bn), -(-cols // bk))
        return (rows,) if self.weight_strategy == "channel" else (1,)


def _loaded_tensor(loaded: Loaded) -> torch.Tensor:
    """The whole checkpoint tensor (a scale is small: every rank reads all of it)."""
    from phloem.layers.linear import CheckpointSlice

    return loaded.full() if isinstance(loaded, CheckpointSlice) else loaded


class Fp8LinearMethod(LinearMethod):
    """FP8 W8A8 for one linear layer (one instance per layer: it records the layer's block
    width). Parameters after loading: `weight` fp8 [N, K], `weight_scale` fp32 [N] (or, for a
    block-scaled checkpoint on the CPU, the scheme's scale name, fp32 [N, ceil(K / bk)]) and,
    with static activations, `input_scale` fp32 []."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self.block_k: int | None = None  # set while the weight keeps block scales

    # -- parameters -----------------------------------------------------------------------------

    def create_weights(self, layer: LinearBase) -> None:
        scheme = self.scheme
        if not scheme.serialized:
            return  # the dense weight loads as built; process_weights_after_loading quantizes
        rows, cols = layer.weight.shape
        device = layer.weight.device
        layer.set_parameter("weight", torch.empty(rows, cols, dtype=fp8_math.FP8_DTYPE,
                                                  device=device))  # fmt: skip
        if scheme.weight_strategy == "block":
            assert scheme.block_size is not None
            bk = scheme.block_size[1]
            if layer.input_is_sharded and layer.tp_size > 1 and cols % bk:
                raise ValueError(
                    f"weight_block_size {list(scheme.block_size)}: a row-parallel layer's "
                    f"{cols} input features per TP rank must be a multiple of the block width {bk}"
                )
            self.block_k = bk
            shape: tuple[int, ...] = (rows, -(-cols // bk))
        else:
            shape = (rows,)
        scale = torch.empty(shape, dtype=torch.float32, device=device)
        layer.set_parameter(scheme.weight_scale_name, scale, self._scale_loader(layer))
        if scheme.static_input:
            parts = len(layer.part_shapes())
            layer.set_parameter("input_scale", torch.zeros(parts, device=device),
                                self._input_scale_loader(layer))  # fmt: skip

    def _part(self, layer: LinearBase, shard_id: WeightShardId) -> tuple[int, tuple[int, ...]]:
        """(index, full shape) of checkpoint part `shard_id` of `layer`'s weight."""
        for i, (sid, shape) in enumerate(layer.part_shapes()):
            if sid == shard_id:
                return i, shape
        raise ValueError(f"{type(layer).__name__} has no checkpoint part {shard_id!r}")

    def _scale_loader(self, layer: LinearBase):
        """A loader that turns a checkpoint scale into per-row form over its part's full rows,
        then shards and fuses it with the layer's own loader."""

        def load(param: torch.nn.Parameter, loaded: Loaded, shard_id: WeightShardId = None):
            _, (rows, cols) = self._part(layer, shard_id)
            scale = _loaded_tensor(loaded).float()
            expected = self.scheme.scale_shape(rows, cols)
            what = f"{self.scheme.weight_scale_name} of {type(layer).__name__} part {shard_id!r}"
            if self.scheme.weight_strategy == "block":
                assert self.scheme.block_size is not None
                if tuple(scale.shape) != expected:
                    raise ValueError(f"{what}: shape {tuple(scale.shape)}, expected {expected}")
                scale = scale.repeat_interleave(self.scheme.block_size[0], dim=0)[:rows]
            elif scale.numel() == 1 and self.scheme.weight_strategy == "tensor":
                scale = scale.reshape(1).expand(rows)
            elif tuple(scale.shape) in ((rows,), (rows, 1)):
                scale = scale.reshape(rows)
            else:
                raise ValueError(f"{what}: shape {tuple(scale.shape)}, expected {expected}")
            layer.weight_loader(param, scale.contiguous(), shard_id)

        return load

    def _input_scale_loader(self, layer: LinearBase):
        """A loader that puts part `shard_id`'s scalar activation scale in its slot."""

        def load(param: torch.nn.Parameter, loaded: Loaded, shard_id: WeightShardId = None):
            index, _ = self._part(layer, shard_id)
            value = _loaded_tensor(loaded)
            if value.numel() != 1:
                raise ValueError(
                    f"input_scale of {type(layer).__name__} part {shard_id!r}: shape "
                    f"{tuple(value.shape)}, expected one value (a per-tensor scale)"
                )
            param.data[index] = value.float().reshape(())

        return load

    # -- after loading --------------------------------------------------------------------------

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        scheme = self.scheme
        if not scheme.serialized:
            self._requantize(layer, layer.weight.data)
        elif self.block_k is not None and layer.weight.is_cuda:
            scale = getattr(layer, scheme.weight_scale_name)
            dense = fp8_math.dequantize_weight(layer.weight.data, scale.data, self.block_k)
            delattr(layer, scheme.weight_scale_name)
            self.block_k = None
            self._requantize(layer, dense)
        if scheme.static_input:
            layer.set_parameter("input_scale", layer.input_scale.data.amax())

    def _requantize(self, layer: LinearBase, dense: torch.Tensor) -> None:
        """Replace the weight by `dense` [N, K] quantized per output channel (row maxima over
        every TP rank's columns for a row-parallel layer)."""
        amax = dense.abs().amax(dim=1).float()
        if layer.input_is_sharded and layer.tp_size > 1:
            amax = tp_all_gather(amax, dim=0).view(layer.tp_size, -1).amax(dim=0)
        weight, scale = fp8_math.quantize_per_channel(dense, amax)
        layer.set_parameter("weight", weight)
        layer.set_parameter("weight_scale", scale)

    # -- forward --------------------------------------------------------------------------------

    @staticmethod
    def _sharded_token_scales(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """fp32 [T, 1] per-token scales of a row-parallel layer's input x [..., K / tp] (this
        rank's slice): the token's max |x| over every rank's slice (one all-gather of T floats),
        so each rank quantizes its slice exactly as one GPU quantizes the whole row."""
        local = fp8_math.row_scales(x.reshape(-1, x.shape[-1]))  # max |x| / 448 per token
        return tp_all_gather(local, dim=1).amax(dim=1, keepdim=True)

    def weight_scale(self, layer: LinearBase) -> torch.Tensor:
        """The loaded weight scale: fp32 [N], or [N, ceil(K / bk)] while block-scaled."""
        name = self.scheme.weight_scale_name if self.block_k is not None else "weight_scale"
        return getattr(layer, name)

    def accepts_fp8_input(self, layer: LinearBase) -> bool:
        """Dynamic per-token activations whose row is whole on this rank: not a static scale,
        not a row-parallel layer's slice under TP (its scales span the ranks' slices)."""
        return not self.scheme.static_input and not (layer.input_is_sharded and layer.tp_size > 1)

    def apply(
        self, layer: LinearBase, x: torch.Tensor | fp8_math.Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., K] (model dtype, or an `Fp8Activation` where `accepts_fp8_input`) ->
        [..., N] in x's dtype.

        Raises:
            ValueError: for an `Fp8Activation` this layer cannot take.
        """
        if isinstance(x, fp8_math.Fp8Activation):
            if not self.accepts_fp8_input(layer):
                raise ValueError(
                    f"{type(layer).__name__} quantizes its own input (static scale or a TP "
                    "slice): it takes no pre-quantized Fp8Activation"
                )
            input_scale: torch.Tensor | None = None
        elif self.scheme.static_input:
            input_scale = layer.input_scale
        elif layer.input_is_sharded and layer.tp_size > 1:
            input_scale = self._sharded_token_scales(layer, x)
        else:
            input_scale = None  # per token, in the GEMM function
        scale = self.weight_scale(layer)
        if self.block_k is None and fp8_math.scaled_mm_supported(layer.weight):
            return fp8_math.fp8_linear_scaled_mm(x, layer.weight, scale, input_scale, bias)
        return fp8_math.fp8_linear_reference(
            x, layer.weight, scale, input_scale, bias, self.block_k
        )
