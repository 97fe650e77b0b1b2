"""Tiny random-weight HF checkpoints (Llama, Qwen2, Qwen3) written to disk for engine tests."""

from __future__ import annotations

import shutil

import torch

VOCAB = 49152  # the embedded tokenizer's vocabulary, so its tokenizer files can be reused


def tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=10000.0)
    raise ValueError(arch)


def write_tiny_model(
    arch: str, path, tokenizer_dir, seed: int = 0, num_kv_heads: int | None = None
):
    """Save a seeded random `arch` model (float32, safetensors) plus tokenizer files to `path`
    (`num_kv_heads`: instead of the config's 2).

    Returns the transformers model (float32, eval) as the reference.
    """
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(arch)
    if num_kv_heads is not None:
        config.num_key_value_heads = num_kv_heads
    config.architectures = [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
            arch
        ]
    ]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init: sharper, tie-free logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return model


def tiny_model_dir(tmp_path_factory, tokenizer_dir, arch: str, name: str, seed: int):
    """`write_tiny_model` into a fresh temporary folder named `name` (torch on 2 threads, as
    in CI); returns the folder. For module-scoped fixtures."""
    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp(name)
    write_tiny_model(arch, path, tokenizer_dir, seed=seed)
    return path


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation with transformers (full forward each step, no cache)."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]
