"""Model resolution and loading: errors for bad paths, pickled-only checkpoints, the dummy format,
sharded safetensors with an index file."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import save_file

from phloem.models.loader import (
    EMBEDDED_GGUF,
    ModelSource,
    load_hf_config,
    load_model,
    resolve_model,
)

torch.set_num_threads(1)


def tiny_llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        architectures=["LlamaForCausalLM"],
    )


def test_resolve_embedded_default() -> None:
    source = resolve_model(None)
    assert source.kind == "gguf" and source.gguf_file == EMBEDDED_GGUF
    assert os.path.isfile(source.gguf_path)
    assert resolve_model(source.gguf_path) == source


def test_resolve_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.txt"))
    tiny_llama_config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickled"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="HF checkpoint directory"):
        _ = ModelSource("hf_dir", str(tmp_path)).gguf_path


def test_config_without_architectures(tmp_path) -> None:
    config = tiny_llama_config()
    config.architectures = None
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="architectures"):
        load_hf_config(resolve_model(str(tmp_path)))


def test_dummy_format_and_missing_weights(tmp_path) -> None:
    tiny_llama_config().save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))  # config only: fine for "dummy"
    config = load_hf_config(source)
    model = load_model(source, config, torch.float32, "cpu", load_format="dummy")
    assert not model.training
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if name.endswith("norm.weight"):
            assert torch.all(param == 1)
        else:
            assert 0.01 < param.std() < 0.03, name
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(source, config, torch.float32, "cpu")
    with pytest.raises(ValueError, match="load_format"):
        load_model(source, config, torch.float32, "cpu", load_format="pt")


def test_sharded_safetensors_with_index(tmp_path) -> None:
    """Only files named by the index are read (a stray consolidated file would have bad names)."""
    config = tiny_llama_config()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k].to(torch.bfloat16) for k in keys}, tmp_path / file)
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"tok_embeddings.weight": torch.zeros(2)}, tmp_path / "consolidated.safetensors")
    config.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    model = load_model(source, load_hf_config(source), torch.bfloat16, "cpu")
    ours = model.state_dict()
    assert ours["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(ours["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16))
    qkv = ours["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(
        qkv[-16:], state["model.layers.1.self_attn.v_proj.weight"].to(torch.bfloat16)
    )
