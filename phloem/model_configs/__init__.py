"""Configs of real architectures shipped with phloem (config.json only, no weights), so that
`load_format="dummy"` can build them by name: `LLM("llama-3.1-8b", load_format="dummy")`.

The files are the public Hugging Face `config.json` of each checkpoint.
"""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent


def available_model_configs() -> list[str]:
    """Names of the shipped configs, sorted (e.g. "llama-3.1-8b")."""
    return sorted(p.parent.name for p in _ROOT.glob("*/config.json"))


def model_config_dir(name: str) -> Path | None:
    """The directory holding `config.json` for a shipped config name (case-insensitive), or
    None when `name` is not one (so callers can try it as a path next)."""
    path = _ROOT / name.lower() / "config.json"
    return path.parent if path.is_file() else None


def synthetic_tokenizer(vocab_size: int, eos_token_id: int | None = None):
    """A word-level tokenizer whose token i is the word "t<i>" (for random-weight models, whose
    workloads are token ids): decoding works for every id in [0, vocab_size) and no tokenizer
    files need downloading. Returns a transformers `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = None if eos_token_id is None else f"t{eos_token_id}"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token="t0")


def materialize(name_or_dir: str, dest: str | Path, **overrides) -> Path:
    """Write a loadable random-weight model directory: the config (a shipped name or a directory
    with config.json), with `overrides` applied (e.g. num_hidden_layers=2), plus a
    `synthetic_tokenizer`. Returns `dest`. Raises FileNotFoundError for an unknown name."""
    import json

    src = model_config_dir(name_or_dir) or Path(name_or_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(
            f"{name_or_dir!r} is neither a shipped config ({available_model_configs()}) nor a "
            "directory with config.json"
        )
    config = json.loads((src / "config.json").read_text())
    config.update(overrides)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    synthetic_tokenizer(config["vocab_size"], eos).save_pretrained(dest)
    return dest
