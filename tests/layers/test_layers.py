"""Layers against transformers' modules or plain formulas: fused linear loaders, RMSNorm, SiLU-and-mul,
rotary embedding (default / linear / llama3 / partial), the paged Attention layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from phloem.forward_context import ForwardContext, forward_context
from phloem.layers.activation import SiluAndMul
from phloem.layers.attention import Attention
from phloem.layers.linear import MergedColumnLinear, QKVLinear, RowParallelLinear
from phloem.layers.norm import RMSNorm
from phloem.layers.rotary import RotaryEmbedding, rope_parameters_from_hf
from phloem.ops.attention import AttentionMetadata
from phloem.ops.attention.reference import ReferenceAttention, paged_attention_reference

torch.set_num_threads(1)


@pytest.mark.parametrize("bias", [False, True])
def test_qkv_linear_fuses_separate_projections(bias: bool) -> None:
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads = 32, 8, 6, 2
    q, k, v = (
        torch.nn.Linear(hidden, n * head_dim, bias=bias) for n in (heads, kv_heads, kv_heads)
    )
    layer = QKVLinear(hidden, head_dim, heads, kv_heads, bias=bias)
    for shard, ref in zip("qkv", (q, k, v)):
        layer.weight.weight_loader(layer.weight, ref.weight.detach(), shard)
        if bias:
            layer.bias.weight_loader(layer.bias, ref.bias.detach(), shard)
    x = torch.randn(5, hidden)
    got_q, got_k, got_v = layer.split(layer(x))
    for got, ref in zip((got_q, got_k, got_v), (q, k, v)):
        torch.testing.assert_close(got, ref(x), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="shard id"):
        layer.weight.weight_loader(layer.weight, q.weight.detach(), "x")
    with pytest.raises(ValueError, match="shape"):
        layer.weight.weight_loader(layer.weight, q.weight.detach(), "k")


def test_merged_column_and_row_linear() -> None:
    torch.manual_seed(1)
    gate, up, down = torch.nn.Linear(16, 24), torch.nn.Linear(16, 24), torch.nn.Linear(24, 16)
    merged = MergedColumnLinear(16, [24, 24], bias=True)
    for i, ref in enumerate((gate, up)):
        merged.weight.weight_loader(merged.weight, ref.weight.detach(), i)
        merged.bias.weight_loader(merged.bias, ref.bias.detach(), i)
    row = RowParallelLinear(24, 16, bias=True)
    row.weight.weight_loader(row.weight, down.weight.detach())
    row.bias.weight_loader(row.bias, down.bias.detach())
    x = torch.randn(3, 16)
    expected = down(F.silu(gate(x)) * up(x))
    torch.testing.assert_close(row(SiluAndMul()(merged(x))), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="part index"):
        merged.weight.weight_loader(merged.weight, gate.weight.detach(), 2)
    with pytest.raises(ValueError, match="no shard id"):
        row.weight.weight_loader(row.weight, down.weight.detach(), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    hf = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(48))
    ours = RMSNorm(48, eps=1e-5, dtype=dtype)
    ours.weight.data.copy_(hf.weight)
    x, residual = torch.randn(7, 48).to(dtype), torch.randn(7, 48).to(dtype)
    assert torch.equal(ours(x), hf(x))
    normed, new_residual = ours(x, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, hf(residual + x))


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


@pytest.mark.parametrize("rope_name", sorted(ROPES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_matches_hf(rope_name: str, head_dim: int) -> None:
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters=dict(ROPES[rope_name]),
    )
    rope = rope_parameters_from_hf(config)
    assert rope["rope_type"] == rope_name
    ours = RotaryEmbedding(head_dim, head_dim, 4096, rope)
    hf = LlamaRotaryEmbedding(config)
    torch.manual_seed(3)
    positions = torch.randint(0, 4096, (9,))
    q, k = torch.randn(9, 4, head_dim), torch.randn(9, 2, head_dim)
    cos, sin = hf(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q.reshape(9, -1), k.reshape(9, -1))
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_partial_rotary_and_legacy_config() -> None:
    """rotary_dim < head_dim rotates the first rotary_dim dims only (neox halves within them)."""
    ours = RotaryEmbedding(8, 4, 16, {"rope_type": "default", "rope_theta": 100.0})
    x = torch.randn(3, 2, 8)
    positions = torch.tensor([0, 5, 11])
    got, _ = ours(positions, x, x)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 4, 2).float() / 4))
    angle = positions[:, None, None].float() * inv_freq  # [3, 1, 2]
    x1, x2 = x[..., :2], x[..., 2:4]
    expected = torch.cat(
        [x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin(), x[..., 4:]], -1
    )
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)

    class Legacy:  # transformers 4 style attributes
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}
        max_position_embeddings = 64

    assert rope_parameters_from_hf(Legacy()) == {
        "type": "linear",
        "factor": 2.0,
        "rope_theta": 1234.0,
        "rope_type": "linear",
    }
    with pytest.raises(NotImplementedError, match="yarn"):
        RotaryEmbedding(8, 8, 16, {"rope_type": "yarn", "rope_theta": 1.0})


def test_attention_layer_writes_cache_and_attends() -> None:
    torch.manual_seed(4)
    heads, kv_heads, head_dim, block_size = 4, 2, 8, 4
    layer = Attention(heads, kv_heads, head_dim, 0.3, layer_idx=1)
    caches = [torch.zeros(6, 2, block_size, kv_heads, head_dim) for _ in range(2)]
    # one sequence, 5 tokens in blocks [3, 0] (positions 0..3 in block 3, 4 in block 0)
    slots = torch.tensor([12, 13, 14, 15, 0])
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.tensor([[3, 0]], dtype=torch.int32),
        block_size=block_size,
        max_query_len=5,
        max_seq_len=5,
        query_start_loc_cpu=[0, 5],
        seq_lens_cpu=[5],
    )
    q = torch.randn(5, heads * head_dim)
    k, v = torch.randn(5, kv_heads * head_dim), torch.randn(5, kv_heads * head_dim)
    with pytest.raises(RuntimeError, match="forward_context"):
        layer(q, k, v)
    with forward_context(ForwardContext(meta, caches, ReferenceAttention())):
        out = layer(q, k, v)
    assert out.shape == (5, heads * head_dim)
    assert torch.equal(caches[1][3, 0].reshape(4, -1), k[:4])
    assert torch.equal(caches[1][0, 1, 0].reshape(-1), v[4])
    assert torch.count_nonzero(caches[0]) == 0  # other layers untouched
    expected = paged_attention_reference(q.view(5, heads, head_dim), caches[1], meta, 0.3)
    torch.testing.assert_close(out.double(), expected.reshape(5, -1), atol=1e-6, rtol=1e-6)


def test_attention_layer_rope_paths_agree(monkeypatch, triton_kernels) -> None:
    """With a RotaryEmbedding, the layer's fused RoPE + KV-write kernel (CUDA; forced here under
    the Triton interpreter) and its torch path (the module, then write_kv) give the same output
    and the same cache, from strided q/k/v views of one QKV tensor as the model passes them."""
    import phloem.layers.attention as attention_layer

    rope_and_write_kv = triton_kernels("phloem.ops.rope_kv", "_rope_kv_kernel").rope_and_write_kv
    torch.manual_seed(5)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, kv_heads, head_dim, block_size = 4, 2, 8, 4
    rope = RotaryEmbedding(head_dim, head_dim, 64, {"rope_theta": 100.0, "rope_type": "default"})
    rope = rope.to(dev)
    layer = Attention(heads, kv_heads, head_dim, 0.3, layer_idx=0)
    slots = torch.tensor([12, 13, 14, 15, 0])
    meta = AttentionMetadata(
        slot_mapping=slots.to(dev),
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([5], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([[3, 0]], dtype=torch.int32, device=dev),
        block_size=block_size,
        max_query_len=5,
        max_seq_len=5,
        query_start_loc_cpu=[0, 5],
        seq_lens_cpu=[5],
    )
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, device=dev)
    positions = torch.tensor([7, 3, 40, 0, 63], device=dev)
    results = []
    for kernel in (None, rope_and_write_kv):
        monkeypatch.setattr(attention_layer, "_rope_kv_kernel", lambda q, kernel=kernel: kernel)
        cache = torch.zeros(6, 2, block_size, kv_heads, head_dim, device=dev)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        with forward_context(ForwardContext(meta, [cache], ReferenceAttention())):
            results.append((layer(q, k, v, positions, rope), cache))
    (want, want_cache), (got, got_cache) = results
    assert torch.count_nonzero(want_cache) == 5 * 2 * kv_heads * head_dim
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
