"""Tiny random-weight Llama / Mistral / Qwen2 / Qwen3 models against transformers in float32.

Each config is loaded twice: from the HF model's state_dict via `load_weights`, and through a temp
safetensors checkpoint directory via `load_model`. Both run over a paged KV cache with random block
tables: (a) three prompts of different lengths prefilled in one packed step, (b) chunked prefill
(3-token chunks) mixed with decode tokens, then greedy decode steps, with padding tokens in some
steps. Logits must match transformers' full-sequence forward at every computed position.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from paged_harness import PagedHarness

from phloem.models.loader import load_hf_config, load_model, resolve_model
from phloem.models.registry import get_model_class

torch.set_num_threads(1)

ATOL = 1e-4
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # wavelengths span all three llama3 regions
}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "llama3_rope_tied_headdim_bias": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_parameters=LLAMA3_ROPE,
        tie_word_embeddings=True,
        head_dim=32,
        attention_bias=True,
    ),
    "mistral": lambda: transformers.MistralConfig(
        **{**COMMON, "num_key_value_heads": 1}, sliding_window=None, head_dim=24
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_parameters={"rope_theta": 1e6}),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
}


def make_hf_model(name: str) -> torch.nn.Module:
    config = CONFIGS[name]()
    config.architectures = [config.model_type.capitalize() + "ForCausalLM"]
    torch.manual_seed(len(name))
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.config.architectures = [type(hf).__name__]
    with torch.no_grad():  # non-trivial norms and biases, so loading them is tested
        for pname, p in hf.named_parameters():
            p.copy_(
                1.0 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p)
            )
    return hf.eval()


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    """(transformers model, ours via load_weights, ours via a safetensors dir and load_model)."""
    hf = make_hf_model(request.param)
    direct = get_model_class(hf.config.architectures)(hf.config, torch.float32)
    direct.load_weights(hf.state_dict().items())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    source = resolve_model(str(path))
    assert source.kind == "hf_dir"
    loaded = load_model(source, load_hf_config(source), torch.float32, "cpu")
    return hf, direct.eval(), loaded


def test_weights_identical_both_ways(models) -> None:
    _, direct, loaded = models
    a, b = direct.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_packed_prefill_matches_hf(models) -> None:
    hf, _, model = models
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 13, 2)]
    harness = PagedHarness(model, block_size=4, seed=1)
    outs = harness.step(list(enumerate(prompts)), num_pad=3)
    for prompt, out in zip(prompts, outs):
        torch.testing.assert_close(out, hf_logits(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4])
def test_chunked_prefill_and_decode_match_hf(models, block_size: int) -> None:
    hf, direct, model = models
    gen = torch.Generator().manual_seed(2)
    seqs = {
        s: torch.randint(0, 256, (n,), generator=gen).tolist() for s, n in (("a", 10), ("b", 4))
    }
    prompt_lens = {s: len(t) for s, t in seqs.items()}
    harness = PagedHarness(
        direct if block_size == 1 else model, num_blocks=96, block_size=block_size
    )
    computed = dict.fromkeys(seqs, 0)
    got: dict[str, list[torch.Tensor]] = {s: [] for s in seqs}
    for step in range(8):
        chunks = []
        for s, tokens in seqs.items():
            if computed[s] < prompt_lens[s]:  # prefill in chunks of 3
                chunk = tokens[computed[s] : min(computed[s] + 3, prompt_lens[s])]
            else:  # decode the token appended greedily after the previous step
                chunk = tokens[computed[s] :]
            chunks.append((s, chunk))
            computed[s] += len(chunk)
        outs = harness.step(chunks, num_pad=step % 2)
        for (s, _), out in zip(chunks, outs):
            got[s].append(out)
            if computed[s] >= prompt_lens[s]:
                seqs[s].append(int(out[-1].argmax()))
    for s, tokens in seqs.items():
        ours = torch.cat(got[s])
        assert len(tokens) > prompt_lens[s] + 3  # several decode steps happened
        torch.testing.assert_close(ours, hf_logits(hf, tokens)[: len(ours)], atol=ATOL, rtol=0)


def test_model_attributes(models) -> None:
    hf, model, _ = models
    cfg = hf.config
    assert model.num_layers == cfg.num_hidden_layers
    assert model.num_kv_heads == cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert model.head_dim == head_dim
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape[0] == head_dim * (
        cfg.num_attention_heads + 2 * cfg.num_key_value_heads
    )
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_load_weights_rejects_unknown_and_missing() -> None:
    hf = make_hf_model("llama")
    model = get_model_class(["LlamaForCausalLM"])(hf.config, torch.float32)
    state = dict(hf.state_dict())
    with pytest.raises(ValueError, match="no parameter for checkpoint tensor 'model.extra.weight'"):
        model.load_weights([*state.items(), ("model.extra.weight", torch.zeros(1))])
    del state["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match="qkv_proj"):
        model.load_weights(state.items())
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))], strict=False)
    loaded = model.load_weights(
        [*hf.state_dict().items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))]
    )
    assert loaded == {n for n, _ in model.named_parameters()}
