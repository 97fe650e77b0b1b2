"""GGUF loading: dequantization fast paths, the q/k un-permutation, tiny written GGUF files
(llama with permuted q/k and Q8_0/Q4_1/Q4_0/F16 tensors; qwen2 with biases; qwen3 with q/k
norms), and the embedded SmolLM2 model against transformers' own GGUF loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from paged_harness import PagedHarness

from phloem.models.gguf_loader import dequantize_tensor, gguf_to_hf_name, unpermute_qk
from phloem.models.loader import load_hf_config, load_model, load_tokenizer, resolve_model

torch.set_num_threads(1)

Q = GGMLQuantizationType


def llamacpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim in spirit."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


class _FakeTensor:
    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType) -> None:
        self.data, self.tensor_type = data, qtype


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32])
def test_dequantize_matches_gguf(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    data = quantize(values, qtype)
    ours = dequantize_tensor(_FakeTensor(data, qtype))
    expected = dequantize(data, qtype)
    assert ours.shape == (6, 96) and ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(np.asarray(expected, dtype=np.float32)))


@pytest.mark.parametrize("n_head", [1, 3, 4])
def test_unpermute_inverts_llamacpp_permute(n_head: int) -> None:
    w = np.random.default_rng(n_head).standard_normal((n_head * 16, 5)).astype(np.float32)
    permuted = llamacpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    assert torch.equal(unpermute_qk(torch.from_numpy(permuted), n_head), torch.from_numpy(w))
    bias = w[:, 0].copy()
    assert torch.equal(unpermute_qk(torch.from_numpy(llamacpp_permute(bias, n_head)), n_head),
                       torch.from_numpy(bias))  # fmt: skip


def test_gguf_names() -> None:
    assert gguf_to_hf_name("blk.12.ffn_up.weight") == "model.layers.12.mlp.up_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_to_hf_name("rope_freqs.weight")


_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_QTYPES = [Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.F16, Q.F32]


_TOKENIZER_FIELDS = {
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.chat_template": "add_chat_template",
}


def write_tiny_gguf(
    hf: torch.nn.Module, arch: str, path: str, tokenizer_fields: dict | None = None
) -> None:
    """Write `hf` as llama.cpp would (permuting q/k for llama), quantizing the 2-D tensors with a
    mix of types; `hf`'s weights are replaced by their dequantized values so both sides agree.
    `tokenizer_fields`: GGUF tokenizer metadata to include (e.g. the embedded model's)."""
    cfg = hf.config
    writer = GGUFWriter(path, arch)
    for key, value in (tokenizer_fields or {}).items():
        getattr(writer, _TOKENIZER_FIELDS[key])(value)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for i, (name, param) in enumerate(hf.state_dict().items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
        else:
            base = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
            gguf_name = base.get(name.rsplit(".", 1)[0], "output") + "." + name.rsplit(".", 1)[1]
        array = param.numpy()
        qtype = _QTYPES[i % len(_QTYPES)] if array.ndim == 2 else Q.F32
        data = quantize(array, qtype)
        param.copy_(torch.from_numpy(np.asarray(dequantize(data, qtype), dtype=np.float32)))
        if arch == "llama" and ("attn_q." in gguf_name or "attn_k." in gguf_name):
            n_head = cfg.num_attention_heads if "attn_q." in gguf_name else cfg.num_key_value_heads
            data = llamacpp_permute(data, n_head)  # quantized rows permute like float rows
        writer.add_tensor(gguf_name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "arch,config",
    [
        ("llama", transformers.LlamaConfig(tie_word_embeddings=False)),
        ("llama", transformers.LlamaConfig(tie_word_embeddings=True, attention_bias=True)),
        ("qwen2", transformers.Qwen2Config(tie_word_embeddings=False)),
        ("qwen3", transformers.Qwen3Config(tie_word_embeddings=True)),
    ],
)
@torch.no_grad()
def test_tiny_gguf_matches_hf(arch: str, config, tmp_path) -> None:
    for key, value in dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    ).items():
        setattr(config, key, value)
    config.head_dim = 16
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for pname, p in hf.named_parameters():
        p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p))
    (tmp_path / "m").mkdir()
    write_tiny_gguf(hf, arch, str(tmp_path / "m" / "tiny.gguf"))

    source = resolve_model(str(tmp_path / "m"))  # a directory holding one .gguf
    assert (source.kind, source.gguf_file) == ("gguf", "tiny.gguf")
    ours_cfg = load_hf_config(source)
    assert ours_cfg.architectures == [type(hf).__name__]
    assert ours_cfg.tie_word_embeddings == config.tie_word_embeddings
    model = load_model(source, ours_cfg, torch.float32, "cpu")
    prompts = [[5, 9, 2, 77, 3, 1, 100], [8, 8, 1]]
    outs = PagedHarness(model, block_size=4).step(list(enumerate(prompts)))
    for prompt, out in zip(prompts, outs):
        expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def embedded_hf_model():
    """transformers' own load of the embedded GGUF (float32), shared by this file's references."""
    source = resolve_model(None)
    return transformers.AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32, local_files_only=True
    ).eval()


@pytest.mark.slow
@torch.no_grad()
def test_embedded_model_matches_transformers(embedded_hf_model) -> None:
    source = resolve_model(None)
    config = load_hf_config(source)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings and config.architectures == ["LlamaForCausalLM"]
    model = load_model(source, config, torch.float32, "cpu")
    tokenizer = load_tokenizer(source)
    prompt = tokenizer("The capital of France is")["input_ids"]
    harness = PagedHarness(model, num_blocks=16, block_size=16)
    tokens = list(prompt)
    logits = harness.step([(0, tokens)])[0]
    steps = [logits]
    for _ in range(3):  # greedy decode
        tokens.append(int(steps[-1][-1].argmax()))
        steps.append(harness.step([(0, tokens[-1:])])[0])
    expected = embedded_hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat(steps), expected, atol=1e-3, rtol=0)
    assert tokenizer.decode(tokens[len(prompt) :]).strip().startswith("Paris")


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why do cats purr?"},
    ],
]


@pytest.mark.slow
def test_greedy_matches_transformers_on_gguf(embedded_llm, embedded_hf_model) -> None:
    """The session's engine (through the converted cache) greedy-decodes chats token for token
    as transformers does on the GGUF file."""
    from phloem import SamplingParams

    max_tokens = 24
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = embedded_llm.chat(CHATS, params, use_tqdm=False)
    tokenizer = embedded_llm.get_tokenizer()
    for conversation, output in zip(CHATS, outputs):
        _, prompt_ids = embedded_llm.encode_chat(conversation)
        assert output.prompt_token_ids == prompt_ids
        with torch.no_grad():
            ref = embedded_hf_model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )[0, len(prompt_ids) :].tolist()
        got = output.outputs[0].token_ids
        assert got == ref, (tokenizer.decode(got), tokenizer.decode(ref))
        assert output.outputs[0].text.strip(), "empty text"
