"""Tensor-parallel layers without processes: each rank's weight loaders read only their slices of
a checkpoint (column-, row- and vocab-parallel, fused q/k/v with replicated KV heads), and random
("dummy") weights give every TP size shards of one model."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from phloem.distributed.parallel_state import tensor_parallel_layout, tp_rank, tp_size
from phloem.layers.embedding import LMHead, VocabEmbedding
from phloem.layers.linear import (
    CheckpointSlice,
    ColumnParallelLinear,
    MergedColumnLinear,
    QKVLinear,
    RowParallelLinear,
)
from phloem.models.llama import LlamaForCausalLM
from phloem.models.loader import init_dummy_weights


class RecordingSlice:
    """A safetensors-like lazy slice that records every index it is read at."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.reads: list[tuple] = []

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        self.reads.append(index)
        return self.tensor[index]


def load(layer, param, full: torch.Tensor, shard_id=None) -> RecordingSlice:
    lazy = RecordingSlice(full)
    param.weight_loader(param, CheckpointSlice(lazy), shard_id)
    return lazy


@pytest.mark.parametrize("rank", [0, 1])
def test_column_row_and_vocab_loaders_read_only_their_slice(rank):
    w = torch.randn(8, 6)
    with tensor_parallel_layout(rank, 2):
        col = ColumnParallelLinear(6, 8, bias=True)
        row = RowParallelLinear(8, 6, bias=True)
        emb = VocabEmbedding(7, 6)  # 7 rows over 2 ranks: 4 + 3 and a padding row
    lazy = load(col, col.weight, w)
    assert lazy.reads == [(slice(4 * rank, 4 * rank + 4),)]
    assert torch.equal(col.weight, w[4 * rank : 4 * rank + 4])
    lazy = load(row, row.weight, w.T.contiguous())
    assert lazy.reads == [(slice(None), slice(4 * rank, 4 * rank + 4))]
    assert torch.equal(row.weight, w.T[:, 4 * rank : 4 * rank + 4])
    bias = load(row, row.bias, torch.arange(6.0))  # replicated: read whole
    assert bias.reads == [(Ellipsis,)] and torch.equal(row.bias, torch.arange(6.0))
    table = torch.randn(7, 6)
    lazy = load(emb, emb.weight, table)
    rows = (0, 4) if rank == 0 else (4, 7)
    assert lazy.reads == [(slice(*rows),)]
    assert torch.equal(emb.weight[: rows[1] - rows[0]], table[slice(*rows)])
    assert (emb.vocab_start, emb.vocab_end) == rows
    if rank == 1:
        assert torch.equal(emb.weight[3], torch.zeros(6))  # padding


@pytest.mark.parametrize(("num_kv_heads", "kv_rows"), [(2, {0: (0, 2), 1: (2, 4)}),
                                                       (1, {0: (0, 2), 1: (0, 2)})])  # fmt: skip
def test_qkv_loader_splits_heads_and_replicates_kv(num_kv_heads, kv_rows):
    hidden, head_dim, heads = 4, 2, 4
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(num_kv_heads * head_dim, hidden)
    for rank in (0, 1):
        with tensor_parallel_layout(rank, 2):
            qkv = QKVLinear(hidden, head_dim, heads, num_kv_heads)
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        assert load(qkv, qkv.weight, q, "q").reads == [(slice(4 * rank, 4 * rank + 4),)]
        lazy = load(qkv, qkv.weight, k, "k")
        assert lazy.reads == [(slice(*kv_rows[rank]),)]
        assert torch.equal(qkv.weight[:4], q[4 * rank : 4 * rank + 4])
        assert torch.equal(qkv.weight[4:6], k[slice(*kv_rows[rank])])


def test_merged_column_loader_splits_each_part():
    gate, up = torch.randn(6, 3), torch.randn(6, 3)
    with tensor_parallel_layout(1, 2):
        merged = MergedColumnLinear(3, [6, 6])
    assert load(merged, merged.weight, gate, 0).reads == [(slice(3, 6),)]
    assert load(merged, merged.weight, up, 1).reads == [(slice(3, 6),)]
    assert torch.equal(merged.weight, torch.cat([gate[3:], up[3:]]))


def test_checkpoint_slice_reads_a_safetensors_file(tmp_path):
    w = torch.randn(6, 4)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        lazy = CheckpointSlice(f.get_slice("w"))
        assert lazy.shape == w.shape and lazy.dim() == 2
        assert torch.equal(lazy.narrow(1, 2, 2), w[:, 2:4])
        assert torch.equal(lazy.full(), w)


def test_layout_is_restored_and_defaults_to_one_rank():
    with tensor_parallel_layout(1, 4):
        assert (tp_rank(), tp_size()) == (1, 4)
        head = LMHead(8, 2)
    assert (tp_rank(), tp_size()) == (0, 1)
    assert head.weight.shape == (2, 2)


def _config(num_kv_heads: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=32,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )  # fmt: skip


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_dummy_weights_are_shards_of_the_one_model(num_kv_heads):
    config = _config(num_kv_heads)
    full = LlamaForCausalLM(config)
    init_dummy_weights(full)
    whole = dict(full.named_parameters())
    attn = full.model.layers[0].self_attn.qkv_proj
    q_size, kv_size = attn.q_size, attn.kv_size
    for rank in (0, 1):
        with tensor_parallel_layout(rank, 2):
            shard = LlamaForCausalLM(config)
        init_dummy_weights(shard)
        part = dict(shard.named_parameters())
        prefix = "model.layers.0."
        assert torch.equal(
            part["model.embed_tokens.weight"],
            whole["model.embed_tokens.weight"][15 * rank : 15 * rank + 15],
        )
        assert torch.equal(
            part["lm_head.weight"], whole["lm_head.weight"][15 * rank : 15 * rank + 15]
        )
        o = whole[prefix + "self_attn.o_proj.weight"]
        assert torch.equal(part[prefix + "self_attn.o_proj.weight"], o[:, 8 * rank : 8 * rank + 8])
        qkv, qkv_full = (
            part[prefix + "self_attn.qkv_proj.weight"],
            whole[prefix + "self_attn.qkv_proj.weight"],
        )
        assert torch.equal(
            qkv[: q_size // 2], qkv_full[q_size // 2 * rank : q_size // 2 * (rank + 1)]
        )
        kv_rank = rank if num_kv_heads == 2 else 0
        k_rows = qkv_full[q_size : q_size + kv_size]
        assert torch.equal(
            qkv[q_size // 2 : q_size // 2 + 4], k_rows[4 * kv_rank : 4 * kv_rank + 4]
        )
        gate_up = part[prefix + "mlp.gate_up_proj.weight"]
        up_full = whole[prefix + "mlp.gate_up_proj.weight"][24:]
        assert torch.equal(gate_up[12:], up_full[12 * rank : 12 * rank + 12])
