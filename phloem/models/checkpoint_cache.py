"""The converted-checkpoint cache: a GGUF model written once as a standard HF directory.

Parsing a GGUF file, building its tokenizer and dequantizing its tensors costs seconds at every
start; reading an HF directory (config.json, tokenizer.json, memory-mapped safetensors) does not.
So the first start from a GGUF file (the embedded model or any `--model x.gguf`) writes

    <cache dir>/checkpoints/<gguf stem>-<sha256 of the file, 24 hex>-<dtype>-c<CONVERTER_VERSION>/
        config.json            the full transformers config (every field, defaults included)
        tokenizer.json, tokenizer_config.json, chat_template.jinja   (the fast tokenizer)
        model.safetensors      the dequantized weights in the dtype the engine runs, HF names
        phloem_manifest.json   written last: source, key, and the size of every file above

and later starts load that directory. The key is a hash of the file's content (size and mtime
play no part), so a changed file gets a new directory; `CONVERTER_VERSION` changes whenever the
conversion's output would.

Atomicity: the directory is built under a temporary name in the same parent and renamed into
place (`os.rename` of a directory is atomic on POSIX); when two processes race, the second rename
fails, and the loser keeps the winner's directory. A directory without a valid manifest, or with a
file whose size differs from the manifest's, is never loaded: it is moved aside and rebuilt. The
check is by size and header, not by content hash (hashing 540 MB of weights would cost more than
the start it saves), so a same-size overwrite of the weights is not detected.

The cache root is, first to last: the `cache_dir` argument (CLI `--cache-dir`), the environment
variable `PHLOEM_CACHE_DIR`, `$XDG_CACHE_HOME/phloem`, `~/.cache/phloem`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
CACHE_DIR_ENV = "PHLOEM_CACHE_DIR"
MANIFEST = "phloem_manifest.json"
WEIGHTS = "model.safetensors"
ABANDONED_AFTER_S = 3600.0  # a temp dir this old [s] belongs to a killed conversion
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def default_cache_dir() -> str:
    """The cache root when none is given: $PHLOEM_CACHE_DIR, else $XDG_CACHE_HOME/phloem, else
    ~/.cache/phloem (not created here)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(xdg), "phloem")


def file_sha256(path: str) -> str:
    """Hex SHA-256 of the file's content (one streaming pass over the file)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_key(gguf_path: str, dtype: torch.dtype) -> str:
    """The cache directory name of `gguf_path` converted to `dtype`: the file's stem, a content
    hash, the dtype and the converter version. Raises ValueError for an unsupported dtype."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"the checkpoint cache stores float32, bfloat16 or float16, not {dtype}")
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    digest = file_sha256(gguf_path)[:24]
    return f"{stem}-{digest}-{_DTYPE_NAMES[dtype]}-c{CONVERTER_VERSION}"


def is_complete(directory: str) -> bool:
    """True when `directory` holds a finished conversion: a readable manifest of this converter
    version whose every listed file exists with the listed size, and a safetensors header that
    covers every tensor it lists. Reads only the manifest, the file sizes and the weights' header."""
    from phloem.models.loader import check_safetensors_file

    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("converter_version") != CONVERTER_VERSION:
            return False
        files = manifest["files"]
        if WEIGHTS not in files or "config.json" not in files:
            return False
        for name, size in files.items():
            if os.path.getsize(os.path.join(directory, name)) != size:
                return False
        check_safetensors_file(os.path.join(directory, WEIGHTS))
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_checkpoint(gguf_path: str, dtype: torch.dtype, directory: str, key: str) -> None:
    """Convert `gguf_path` into the (empty, private) `directory`; the manifest is written last."""
    from safetensors.torch import save_file

    from phloem.models.gguf_loader import (
        hf_config_from_gguf,
        iter_gguf_weights,
        load_gguf_tokenizer,
    )

    config = hf_config_from_gguf(gguf_path)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        f.write(config.to_json_string(use_diff=False))
    tokenizer = load_gguf_tokenizer(gguf_path)
    for loading_only in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(loading_only, None)
    tokenizer.save_pretrained(directory)
    weights = {name: w.to(dtype).contiguous() for name, w in iter_gguf_weights(gguf_path, config)}
    save_file(weights, os.path.join(directory, WEIGHTS), metadata={"format": "pt"})
    files = {
        name: os.path.getsize(os.path.join(directory, name))
        for name in sorted(os.listdir(directory))
    }
    manifest = {
        "converter_version": CONVERTER_VERSION,
        "key": key,
        "source": os.path.abspath(gguf_path),
        "dtype": _DTYPE_NAMES[dtype],
        "files": files,
    }
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)


def _remove_stale(path: str) -> None:
    """Move an incomplete directory aside (atomically) and delete it; a concurrent process may
    have done so already."""
    aside = f"{path}.stale-{os.getpid()}-{time.monotonic_ns()}"
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)


def _remove_abandoned(root: str, key: str) -> None:
    """Delete temp dirs of `key` left by killed conversions: those untouched for
    `ABANDONED_AFTER_S` (a conversion takes seconds, so a live one is never that old)."""
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(f".{key}.tmp-") or name.startswith(f"{key}.stale-"):
            with contextlib.suppress(FileNotFoundError):
                if now - os.stat(path).st_mtime > ABANDONED_AFTER_S:
                    shutil.rmtree(path, ignore_errors=True)


def converted_checkpoint(gguf_path: str, dtype: torch.dtype, cache_dir: str | None = None) -> str:
    """The HF checkpoint directory of `gguf_path` in `dtype`, converting it on first use.

    Args:
        gguf_path: the GGUF file.
        dtype: the dtype the engine runs the model in (the weights are stored so).
        cache_dir: the cache root; None for `default_cache_dir()`.
    Returns:
        the complete directory (see the module docstring for its files).
    Raises:
        ValueError: the GGUF file is truncated, not GGUF, or of an unsupported architecture
            (NotImplementedError for an unsupported RoPE or quantization type).
        OSError: the cache root cannot be created or written.
    """
    root = os.path.join(cache_dir or default_cache_dir(), "checkpoints")
    key = cache_key(gguf_path, dtype)
    final = os.path.join(root, key)
    if is_complete(final):
        return final
    if os.path.exists(final):
        logger.warning("checkpoint cache %s is incomplete or corrupt; rebuilding it", final)
        _remove_stale(final)
    os.makedirs(root, exist_ok=True)
    _remove_abandoned(root, key)
    start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root)
    try:
        _write_checkpoint(gguf_path, dtype, tmp, key)
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its copy into place first
            if not is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1f s", gguf_path, final, time.perf_counter() - start)
    return final


class CachedConfig(types.SimpleNamespace):
    """A converted directory's model config: every field of its config.json as an attribute
    (nested objects stay dicts), read without transformers; `to_dict()` gives them back."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def load_cached_config(directory: str) -> CachedConfig:
    """The model config of a converted directory. config.json holds every field (written with
    `use_diff=False`), so no architecture config class is needed to fill in defaults, and
    transformers is not imported (its import is most of a second start).

    Raises:
        ValueError: config.json is not a JSON object.
    """
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        values = json.load(f)
    if not isinstance(values, dict):
        raise ValueError(f"{directory}/config.json must hold a JSON object")
    return CachedConfig(**values)
