"""Which quantization a model runs: the user's `quantization` setting and the checkpoint's
`quantization_config` (config.json) resolved into one `QuantizationConfig`, and the check that
an FP8 checkpoint holds every tensor the config promises, made on the safetensors headers before
any weight is read.

Checkpoint formats read (dequantize-free: FP8 weights stay FP8, `fp8.py` converts the scales):
- `quant_method: "fp8"`: HF transformers' FP8 (`activation_scheme` "dynamic" or "static";
  `weight_block_size` [bn, bk] with `weight_scale_inv` block scales, as DeepSeek-V3 and Qwen3
  FP8 checkpoints; without it one `weight_scale` per tensor, as AutoFP8's), skipping
  `modules_to_not_convert`.
- `quant_method: "compressed-tensors"`, format "float-quantized" (llm-compressor's FP8,
  FP8_DYNAMIC, FP8_BLOCK): parsed by the `compressed-tensors` package; weights 8-bit float with
  strategy channel, tensor or block; input activations dynamic per token or static per tensor
  (`input_scale`); `ignore` lists modules kept dense (names or "re:" patterns).
Anything else (INT4/INT8, NVFP4, MXFP4, GPTQ, AWQ, ...) is refused naming the scheme.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from phloem.layers.quantization.base import LinearMethod, QuantizationConfig
from phloem.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme

logger = logging.getLogger(__name__)

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores
FP8_CHECKPOINT_METHODS = ("fp8", "compressed-tensors")
_ATTN_SCALE = re.compile(r"\.(q_scale|prob_scale)$")


class Fp8Config(QuantizationConfig):
    """FP8 W8A8 over every linear layer the checkpoint quantizes.

    Args:
        scheme: what each quantized layer holds (online quantization: `Fp8Scheme()`).
        ignored: HF module name -> True when that module stays dense.
        source: where the config came from (for messages), e.g. "quantization='fp8'".
    """

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme, ignored=None, source: str = "quantization='fp8'"):
        self.scheme = scheme
        self.ignored = ignored or (lambda name: False)
        self.source = source

    def get_method(self, module_name: str, hf_names: list[str]) -> LinearMethod | None:
        dense = [self.ignored(n) for n in hf_names]
        if all(dense):
            return None
        if any(dense):
            raise ValueError(
                f"{self.source}: {module_name} fuses {hf_names}, of which only some are "
                "quantized; phloem needs all or none of a fused layer's parts in FP8"
            )
        return Fp8LinearMethod(self.scheme)

    def check_device(self, capability: tuple[int, int] | None) -> None:
        if capability is not None and tuple(capability) < FP8_MIN_CAPABILITY:
            need = ".".join(map(str, FP8_MIN_CAPABILITY))
            raise ValueError(
                f"{self.source} needs FP8 tensor cores: a CUDA GPU of compute capability >= "
                f"{need} (Ada, Hopper or newer); this GPU has {capability[0]}.{capability[1]}"
            )

    def skip_checkpoint_tensor(self, name: str) -> bool:
        if _ATTN_SCALE.search(name):
            return True  # FP8 attention-input scales: q stays in the model dtype (not read)
        return name.endswith(".input_scale") and not self.scheme.static_input


def resolve_quantization(
    requested: str | None, hf_config: Any, load_format: str = "auto"
) -> QuantizationConfig | None:
    """The quantization of a model: `requested` (the `quantization` setting, None or "fp8")
    against the checkpoint's `quantization_config`. With dummy weights the checkpoint's FP8
    format becomes online FP8 (random weights are drawn dense, then quantized).

    Raises:
        ValueError: naming the field and value, for an unknown `quantization`, a checkpoint
            quantization phloem cannot run (naming the scheme), or a `quantization` that
            contradicts the checkpoint's.
    """
    if requested not in (None, "fp8"):
        raise ValueError(f"quantization must be one of [None, 'fp8'], got {requested!r}")
    hf_quant = getattr(hf_config, "quantization_config", None)
    if hf_quant is not None and not isinstance(hf_quant, dict):
        hf_quant = hf_quant.to_dict()
    if not hf_quant:
        return Fp8Config(Fp8Scheme()) if requested == "fp8" else None
    method = hf_quant.get("quant_method")
    if method not in FP8_CHECKPOINT_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} of this checkpoint is not supported; "
            f"phloem loads FP8 e4m3 checkpoints ({list(FP8_CHECKPOINT_METHODS)}) and "
            "bf16/fp16/fp32 ones (quantization='fp8' quantizes those at load)"
        )
    config = _fp8_format(hf_quant) if method == "fp8" else _compressed_tensors(hf_quant)
    if load_format == "dummy":
        return Fp8Config(Fp8Scheme(), config.ignored, config.source)
    return config


def _fp8_format(cfg: dict) -> Fp8Config:
    """HF `quant_method: "fp8"` -> Fp8Config. Raises ValueError naming an unsupported field."""
    source = "quantization_config (quant_method 'fp8')"
    fmt = cfg.get("fmt", "e4m3")
    activation = cfg.get("activation_scheme", "dynamic")
    if fmt != "e4m3" or activation not in ("dynamic", "static"):
        raise ValueError(
            f"{source}: fmt {fmt!r} / activation_scheme {activation!r} is not supported "
            "(fmt 'e4m3', activation_scheme 'dynamic' or 'static')"
        )
    block = cfg.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"{source}: weight_block_size must be [rows, cols], got {block!r}")
    if block is not None and activation == "static":
        raise ValueError(f"{source}: static activation scales with block weights: not supported")
    scheme = Fp8Scheme(
        serialized=True,
        weight_strategy="block" if block else "tensor",
        block_size=tuple(block) if block else None,
        weight_scale_name="weight_scale_inv" if block else "weight_scale",
        static_input=activation == "static",
    )
    skip = list(cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or [])
    return Fp8Config(scheme, lambda name: any(s in name for s in skip), source)


def _describe(args: Any) -> str:
    """A quantization-args object of compressed-tensors in a few words (for messages)."""
    if args is None:
        return "none"
    bits = f"{args.type}{args.num_bits}"
    detail = f" group_size {args.group_size}" if args.group_size else ""
    return f"{bits} {args.strategy}{detail}{' dynamic' if args.dynamic else ''}"


def _compressed_tensors(cfg: dict) -> Fp8Config:
    """compressed-tensors `quantization_config` -> Fp8Config, parsed by the package.

    Raises:
        ValueError: naming the scheme (weights / input activations) or format it cannot run.
    """
    from compressed_tensors.quantization import QuantizationConfig as CTConfig
    from compressed_tensors.utils import match_name

    ct = CTConfig.model_validate(cfg)
    source = "quantization_config (quant_method 'compressed-tensors')"
    schemes = list(ct.config_groups.values())
    if not schemes:
        raise ValueError(f"{source}: config_groups is empty")
    parsed = {_ct_scheme(s, source) for s in schemes}
    if ct.format not in ("float-quantized", None):
        raise ValueError(f"{source}: format {ct.format!r} is not supported ('float-quantized')")
    if len(parsed) != 1:
        raise ValueError(f"{source}: config groups with different FP8 schemes are not supported")
    targets = [t for s in schemes for t in s.targets]
    ignore = list(ct.ignore or [])

    def ignored(name: str) -> bool:
        if any(match_name(name, t) for t in ignore):
            return True
        return not any(t == "Linear" or match_name(name, t) for t in targets)

    return Fp8Config(parsed.pop(), ignored, source)


def _ct_scheme(scheme: Any, source: str) -> Fp8Scheme:
    """One compressed-tensors config group -> Fp8Scheme; ValueError naming it otherwise."""
    w, a = scheme.weights, scheme.input_activations
    name = f"weights {_describe(w)}, input_activations {_describe(a)}"
    w_ok = (w is not None and w.type == "float" and w.num_bits == 8 and w.symmetric
            and not w.dynamic and w.strategy in ("channel", "tensor", "block"))  # fmt: skip
    a_ok = (a is not None and a.type == "float" and a.num_bits == 8 and a.symmetric
            and ((a.dynamic is True and a.strategy == "token")
                 or (a.dynamic is False and a.strategy == "tensor")))  # fmt: skip
    if not (w_ok and a_ok) or scheme.output_activations is not None:
        raise ValueError(
            f"{source}: scheme ({name}) is not supported; phloem runs FP8 e4m3 W8A8: weights "
            "float8 channel/tensor/block, input activations float8 per token (dynamic) or per "
            "tensor (static)"
        )
    block = tuple(w.block_structure) if w.strategy == "block" else None
    return Fp8Scheme(
        serialized=True,
        weight_strategy=w.strategy,
        block_size=block,
        static_input=not a.dynamic,
    )


def check_checkpoint(
    config: QuantizationConfig,
    layers: list[tuple[list[str], list[tuple[int, int]]]],
    header: dict[str, tuple[str, tuple[int, ...]]],
) -> None:
    """Check an FP8 checkpoint against the layers that will read it, from its headers only.

    Args:
        layers: per quantized linear layer, its HF module names and each one's full weight
            shape (rows, cols).
        header: checkpoint tensor name -> (safetensors dtype, e.g. "F8_E4M3", shape).
    Raises:
        ValueError: naming the tensor, when a quantized layer's FP8 weight or scale is
            missing, has the wrong dtype or shape, or an FP8 tensor belongs to no FP8 layer.
    """
    if not isinstance(config, Fp8Config) or not config.scheme.serialized:
        return
    scheme = config.scheme
    expected: set[str] = set()
    for hf_names, shapes in layers:
        for hf, (rows, cols) in zip(hf_names, shapes):
            weight, scale = f"{hf}.weight", f"{hf}.{scheme.weight_scale_name}"
            expected.add(weight)
            _expect(header, weight, (rows, cols), "F8_E4M3", f"the FP8 weight of {hf}")
            want = scheme.scale_shape(rows, cols)
            allowed = {want, (rows, 1)} if scheme.weight_strategy == "channel" else {want}
            if scheme.weight_strategy == "tensor":
                allowed |= {()}
            _expect(header, scale, allowed, None, f"the weight scale of {hf}")
            if scheme.static_input:
                _expect(header, f"{hf}.input_scale", {(), (1,)}, None,
                        f"the static input scale of {hf}")  # fmt: skip
    stray = sorted(n for n, (dtype, _) in header.items()
                   if dtype == "F8_E4M3" and n not in expected)  # fmt: skip
    if stray:
        raise ValueError(
            f"checkpoint tensor {stray[0]!r} is FP8 but its module is not an FP8 linear layer "
            f"under {config.source} ({len(stray)} such tensors)"
        )


def _expect(header, name: str, shapes, dtype: str | None, what: str) -> None:
    """ValueError naming `name` unless the header has it with one of `shapes` and `dtype`."""
    shapes = shapes if isinstance(shapes, set) else {shapes}
    if name not in header:
        raise ValueError(f"FP8 checkpoint lacks tensor {name!r} ({what})")
    got_dtype, got_shape = header[name]
    if tuple(got_shape) not in shapes or (dtype is not None and got_dtype != dtype):
        raise ValueError(
            f"FP8 checkpoint tensor {name!r} ({what}) has shape {list(got_shape)} and dtype "
            f"{got_dtype}; expected shape {' or '.join(str(list(s)) for s in sorted(shapes))}"
            + (f" and dtype {dtype}" if dtype else "")
        )
