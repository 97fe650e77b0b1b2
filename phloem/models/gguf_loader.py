"""GGUF checkpoints (llama.cpp format): config from the metadata, tensors dequantized to float.

The file is parsed once per process (`read_gguf`: metadata, tokenizer arrays and the tensor table;
tensor data stays memory-mapped). Tensors are dequantized in torch for Q4_0/Q4_1/Q8_0 and with
`gguf.quants.dequantize` (vectorized numpy) for other types, renamed from llama.cpp names to HF names, and for the "llama" architecture the q/k rows
are un-permuted. GGUF shapes are listed innermost-first ([576, 49152] in GGUF is a torch
[49152, 576]); the reader's numpy arrays are already in torch order.

llama.cpp's converter permutes q_proj/k_proj rows (weights and biases) of llama-arch models so that
its rope can rotate adjacent pairs: within each head of size d, HF row (half a, index i) moves to
GGUF row 2*i + a, i.e.

    gguf = hf.reshape(n_head, 2, d/2, ...).swapaxes(1, 2).reshape(hf.shape)   (llama.cpp `permute`)
    hf   = gguf.reshape(n_head, d/2, 2, ...).swapaxes(1, 2).reshape(gguf.shape)  (`unpermute_qk`)

with n_head = the KV head count for k. qwen2/qwen3 GGUFs are not permuted.
"""

from __future__ import annotations

import functools
import os
import re
import struct
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# GGUF general.architecture -> (HF architecture, transformers config class name, q/k permuted)
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", True),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", False),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# GGUF metadata value types of fixed width (struct format); 8 is a string, 9 an array.
_KV_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
              11: "<q", 12: "<d"}  # fmt: skip
# string arrays kept in full (the tokenizer's); other string arrays are read as their length
_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
_GGUF_VERSIONS = (2, 3)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, torch-order shape, ggml type and raw bytes.

    Attributes:
        name: the llama.cpp name ("blk.0.attn_q.weight").
        shape: torch order (outermost first; GGUF lists dims innermost first).
        tensor_type: the `gguf.GGMLQuantizationType`.
        data: a read-only numpy view into the mapped file: float values for F32/F16/BF16
            ([*shape], BF16 as int16 bits), else uint8 blocks [rows, bytes per row].
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its metadata and tensors (data memory-mapped, not read).

    Attributes:
        path: the file.
        fields: metadata key -> value (ints, floats, strings, lists; string arrays other than
            the tokenizer's tokens and merges are given as their length).
        tensors: in file order.
    """

    path: str
    fields: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]


class _Cursor:
    """Reads little-endian GGUF values from a mapped file; a read past the end raises ValueError
    naming the file (a truncated download)."""

    def __init__(self, path: str, buf: Any) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(
                f"{self.path} is truncated: its header ends at byte {len(self.buf)} "
                f"(reading offset {self.pos}); download it again"
            )
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.take("<Q")
        end = self.pos + length
        if end > len(self.buf):
            self.take(f"<{length}s")  # raises the truncation error
        text = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int, keep_strings: bool) -> Any:
        if value_type in _KV_FORMAT:
            return self.take(_KV_FORMAT[value_type])
        if value_type == 8:
            return self.string()
        if value_type != 9:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")
        element_type, count = self.take("<IQ")
        if element_type in _KV_FORMAT:
            fmt = _KV_FORMAT[element_type]
            return list(self.take(f"<{count}{fmt[1]}")) if count else []
        if element_type == 8 and keep_strings:
            return [self.string() for _ in range(count)]
        if element_type == 8:
            for _ in range(count):
                self.pos += 8 + self.take("<Q")
            return count
        return [self.value(element_type, keep_strings) for _ in range(count)]


def _tensor_view(path: str, buf: np.ndarray, start: int, shape: tuple[int, ...], qtype: Any):
    """The numpy view of one tensor's bytes (see `GGUFTensor.data`). Raises ValueError naming
    the file when the tensor runs past its end."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    numel = int(np.prod(shape)) if shape else 1
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    nbytes = numel // block_elems * block_bytes
    if start + nbytes > len(buf):
        raise ValueError(
            f"{path} is truncated: a tensor ends at byte {start + nbytes} but the file has "
            f"{len(buf)} bytes; download it again"
        )
    raw = buf[start : start + nbytes]
    floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    if qtype in floats:
        return raw.view(floats[qtype]).reshape(shape)
    if qtype == GGMLQuantizationType.BF16:
        return raw.view(np.int16).reshape(shape)
    row_bytes = shape[-1] // block_elems * block_bytes
    return raw.reshape(-1, row_bytes)


def _parse_gguf(path: str) -> GGUFFile:
    from gguf import GGMLQuantizationType

    if os.path.getsize(path) < 24:
        raise ValueError(f"{path} is truncated or empty ({os.path.getsize(path)} bytes); not GGUF")
    buf = np.memmap(path, mode="r", dtype=np.uint8)
    cur = _Cursor(path, buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} does not start with the GGUF magic; not a GGUF file")
    cur.pos = 4
    version, num_tensors, num_fields = cur.take("<IQQ")
    if version not in _GGUF_VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; phloem reads versions 2 and 3")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cur.string()
        fields[key] = cur.value(cur.take("<I"), keep_strings=key in _STRING_ARRAYS)
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = cur.take(f"<{cur.take('<I')}Q")
        dims = (dims,) if isinstance(dims, int) else dims
        qtype, offset = cur.take("<IQ")
        if qtype not in GGMLQuantizationType._value2member_map_:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {qtype}")
        infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset))
    alignment = int(fields.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = tuple(
        GGUFTensor(name, shape, qtype, _tensor_view(path, buf, data_start + off, shape, qtype))
        for name, shape, qtype, off in infos
    )
    return GGUFFile(path, fields, tensors)


@functools.lru_cache(maxsize=2)
def _read_gguf_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return _parse_gguf(path)


def read_gguf(path: str) -> GGUFFile:
    """The parsed GGUF file at `path` (metadata, tensor table, memory-mapped data), parsed once
    per process for a given size and modification time, so config, tokenizer and weight loading
    share one parse (the parse walks every vocabulary entry of the metadata).

    Raises:
        ValueError: naming the file, when it is not GGUF, of an unknown version, or truncated
            (its header or a tensor runs past the end of the file).
    """
    stat = os.stat(path)
    return _read_gguf_cached(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def gguf_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The value of metadata field `key` (scalar, string or list), or `default` if absent."""
    return reader.fields.get(key, default)


def load_gguf_tokenizer(path: str) -> Any:
    """The fast tokenizer described by the GGUF file's metadata (vocabulary, merges, special
    tokens, chat template), built by transformers without loading the model config (which
    would parse the whole file again)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(os.path.abspath(path)),
        gguf_file=os.path.basename(path),
        local_files_only=True,
        trust_remote_code=False,
    )


def _gguf_rope_parameters(get: Callable[..., Any], head_dim: int) -> dict[str, Any]:
    """The HF `rope_parameters` dict from the `<arch>.rope.*` metadata that `get(key, default)`
    reads: theta (default 1e4), linear scaling's factor, and `partial_rotary_factor` when the
    rotary dimension is below `head_dim`.

    Raises:
        NotImplementedError: for a scaling type other than none or linear.
    """
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e4))}
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling not in ("none", None):
        raise NotImplementedError(f"GGUF rope scaling {scaling!r} is not supported")
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        rope["partial_rotary_factor"] = rotary_dim / head_dim
    return rope


def hf_config_from_gguf(path: str) -> Any:
    """Build a transformers config (with `architectures` set) from GGUF metadata.

    Raises:
        NotImplementedError: for an unsupported GGUF architecture or RoPE variant.
    """
    import transformers

    reader = read_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHS)}"
        )
    hf_arch, config_class, _ = _ARCHS[arch]
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise NotImplementedError(
            "GGUF with a rope_freqs tensor (Llama-3.1-style RoPE scaling) is not supported yet; "
            "load the HF safetensors checkpoint instead"
        )

    def get(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"])
    rope = _gguf_rope_parameters(get, head_dim)
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=gguf_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [hf_arch]
    return config


def gguf_to_hf_name(name: str) -> str:
    """llama.cpp tensor name -> HF parameter name, e.g. "blk.3.ffn_up.weight" ->
    "model.layers.3.mlp.up_proj.weight". Raises ValueError for a name with no mapping."""
    match = _BLOCK_RE.fullmatch(name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no HF equivalent in phloem")


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (see module docstring).

    Args:
        weight: [n_head * head_dim, ...] (weight rows or a bias) in GGUF row order.
        n_head: query heads for q, KV heads for k.
    Returns:
        the same rows in HF order (a new contiguous tensor).
    """
    half = weight.shape[0] // n_head // 2
    rest = weight.shape[1:]
    return weight.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at bytes start:start+2 of each block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _dequantize_torch(data: np.ndarray, type_name: str) -> torch.Tensor | None:
    """float32 [rows, cols] for Q4_0 / Q4_1 / Q8_0 (bit-identical to `gguf.quants.dequantize`, in
    whole-tensor torch ops); None for other types."""
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}.get(type_name)
    if block_bytes is None:
        return None
    rows = data.shape[0]
    with warnings.catch_warnings():  # the file is mapped read-only; the bytes are only read
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(np.ascontiguousarray(data)).view(-1, block_bytes)
    d = _f16(blocks, 0)
    if type_name == "Q4_0":
        values = d * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()
    elif type_name == "Q4_1":
        values = d * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)
    else:
        values = d * blocks[:, 2:].contiguous().view(torch.int8).float()
    return values.view(rows, -1)


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """A `gguf.ReaderTensor` as a float32 CPU tensor in torch shape order (a copy, writable).

    Raises:
        NotImplementedError: for a quantization type `gguf` cannot dequantize.
    """
    from gguf.quants import dequantize

    if tensor.tensor_type.name == "BF16":  # int16 bits (see `GGUFTensor.data`)
        bits = torch.from_numpy(np.array(tensor.data, dtype=np.int16))
        return bits.view(torch.bfloat16).float()
    fast = _dequantize_torch(tensor.data, tensor.tensor_type.name)
    if fast is not None:
        return fast
    array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return torch.from_numpy(array)


def iter_gguf_weights(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 CPU tensor) for every tensor of the GGUF file at `path`.

    Raises:
        ValueError: for a tensor name with no HF mapping.
        NotImplementedError: for a quantization type `gguf` cannot dequantize.
    """
    reader = read_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    permuted = _ARCHS.get(arch, ("", "", False))[2]
    heads = {
        "attn_q": hf_config.num_attention_heads,
        "attn_k": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
    }
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        weight = dequantize_tensor(tensor)
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if permuted and part in heads:
            weight = unpermute_qk(weight, heads[part])
        yield name, weight


def is_gguf_file(path: str) -> bool:
    """True if `path` is an existing file that starts with the GGUF magic."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
