"""ReferenceAttention against the float64 naive paged attention, over a grid of shapes.

Each case draws fresh random inputs: a step mixing decode tokens (q_len 1), whole prompts
(q_len == seq_len) and prefill chunks (q_len < seq_len), random non-contiguous block tables, and
padding tokens at the end of the step (slot -1, not in any sequence).
"""

import math
import random

import pytest
import torch

from phloem.ops.attention import AttentionMetadata, get_attention_backend
from phloem.ops.attention.reference import (
    DECODE_CHUNK_ELEMENTS,
    ReferenceAttention,
    _decode_chunks,
    paged_attention_reference,
)
from phloem.ops.kv_store import write_kv

torch.set_num_threads(1)

NUM_KV_HEADS = 2


def make_step(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    num_pad: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query/cache/new K,V and metadata for sequences given as (q_len, seq_len)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    slots, qsl = [], [0]
    for b, ((q_len, seq_len), nb) in enumerate(zip(seqs, blocks_per_seq)):
        ids = [free.pop() for _ in range(nb)]
        block_tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + q_len)
    slots += [-1] * num_pad
    num_tokens = len(slots)
    shape = (num_blocks, 2, block_size, NUM_KV_HEADS, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)
    # Slots outside every sequence hold NaN: a kernel that reads them would poison its output.
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for ids, (_, seq_len) in zip(block_tables.tolist(), seqs):
        for pos in range(seq_len):
            used[ids[pos // block_size] * block_size + pos % block_size] = True
    kv_cache.masked_fill_(~used.view(num_blocks, 1, block_size, 1, 1), float("nan"))
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    seq_lens = [s for _, s in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        block_size=block_size,
        max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return query, kv_cache, key, value, meta


def random_seqs(rng: random.Random) -> list[tuple[int, int]]:
    seqs = [(1, rng.randint(1, 40)) for _ in range(rng.randint(1, 4))]  # decode
    seqs += [(n, n) for n in (rng.randint(2, 20),)]  # whole prompt
    for _ in range(rng.randint(1, 2)):  # chunk after cached tokens
        q_len = rng.randint(2, 9)
        seqs.append((q_len, q_len + rng.randint(1, 30)))
    rng.shuffle(seqs)
    return seqs


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_matches_naive_float64(block_size: int, group: int, head_dim: int) -> None:
    seed = block_size * 100 + group * 10 + head_dim
    seqs = random_seqs(random.Random(seed))
    num_heads = NUM_KV_HEADS * group
    query, kv_cache, key, value, meta = make_step(
        seqs, block_size, num_heads, head_dim, torch.float32, seed
    )
    write_kv(kv_cache, key, value, meta.slot_mapping)
    scale = head_dim**-0.5
    out = ReferenceAttention().forward(query, kv_cache, meta, scale)
    expected = paged_attention_reference(query, kv_cache, meta, scale)
    assert out.dtype == torch.float32 and out.shape == query.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)
    assert torch.all(out[meta.query_start_loc_cpu[-1] :] == 0)  # padding tokens

    out64 = ReferenceAttention().forward(query.double(), kv_cache.double(), meta, scale)
    torch.testing.assert_close(out64, expected, atol=1e-12, rtol=1e-12)


def test_decode_chunks_split_in_order_within_the_budget() -> None:
    seq_lens = [100, 5000, 4000, 9000, 1, 1, 20000, 3]
    seqs = [0, 1, 2, 4, 5, 3, 6, 7]  # a step's decode sequences, not all of them
    chunks = _decode_chunks(seq_lens, seqs, row_elements=32)
    assert [b for chunk in chunks for b in chunk] == seqs
    for chunk in chunks:
        padded = len(chunk) * max(seq_lens[b] for b in chunk) * 32
        assert len(chunk) == 1 or padded <= DECODE_CHUNK_ELEMENTS
    assert [6] in chunks  # too long to share a chunk: alone
    assert len(chunks) < len(seqs)  # short neighbours share one
    assert _decode_chunks(seq_lens, [], row_elements=32) == []


def test_reference_decode_in_several_chunks() -> None:
    """Decode sequences long enough to span several gathers (and a prefill chunk beside them)
    against the float64 naive attention, with NaN in every slot no sequence owns."""
    tokens_per_chunk = DECODE_CHUNK_ELEMENTS // (NUM_KV_HEADS * 16)
    lens = [tokens_per_chunk // 2 + 7, 9, tokens_per_chunk // 3, tokens_per_chunk + 5, 40]
    seqs = [(1, n) for n in lens] + [(5, 30)]
    query, kv_cache, key, value, meta = make_step(seqs, 16, 6, 16, torch.float32, seed=5)
    assert len(_decode_chunks(meta.seq_lens_cpu, list(range(len(lens))), NUM_KV_HEADS * 16)) >= 3
    write_kv(kv_cache, key, value, meta.slot_mapping)
    out = ReferenceAttention().forward(query, kv_cache, meta, 0.25)
    expected = paged_attention_reference(query, kv_cache, meta, 0.25)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


def test_reference_reads_a_head_major_cache() -> None:
    """An HND cache (same logical contents, head-major memory) gives bit-identical outputs."""
    from phloem.ops.kv_store import allocate_kv_cache

    seqs = random_seqs(random.Random(11))
    query, kv_cache, key, value, meta = make_step(seqs, 4, 6, 16, torch.float32, seed=11)
    write_kv(kv_cache, key, value, meta.slot_mapping)
    hnd = allocate_kv_cache(kv_cache.shape[0], 4, NUM_KV_HEADS, 16, torch.float32, "cpu", "HND")
    hnd.copy_(kv_cache)
    assert not hnd.is_contiguous()
    out = ReferenceAttention().forward(query, kv_cache, meta, 0.25)
    assert torch.equal(ReferenceAttention().forward(query, hnd, meta, 0.25), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_half_precision(dtype: torch.dtype) -> None:
    seqs = random_seqs(random.Random(7))
    query, kv_cache, key, value, meta = make_step(seqs, 4, 8, 64, dtype, seed=7)
    write_kv(kv_cache, key, value, meta.slot_mapping)
    out = get_attention_backend("reference").forward(query, kv_cache, meta, 0.125)
    expected = paged_attention_reference(query, kv_cache, meta, 0.125)
    assert out.dtype == dtype
    # Only the final rounding to the half dtype differs from float64.
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=1e-2)


def test_reference_sees_new_kv_and_is_causal() -> None:
    """A query must not change when a later token's K/V changes, but must when an earlier one does."""
    seqs = [(6, 10), (1, 5)]
    query, kv_cache, key, value, meta = make_step(seqs, 4, 4, 16, torch.float32, seed=3)
    write_kv(kv_cache, key, value, meta.slot_mapping)
    backend = ReferenceAttention()
    out = backend.forward(query, kv_cache, meta, 0.25)
    value2 = value.clone()
    value2[3] += 1.0  # token 3 of sequence 0 = position 7
    write_kv(kv_cache, key, value2, meta.slot_mapping)
    out2 = backend.forward(query, kv_cache, meta, 0.25)
    assert torch.equal(out[:3], out2[:3])  # positions 4..6 do not see position 7
    assert not torch.allclose(out[3:6], out2[3:6])
    assert torch.equal(out[6:], out2[6:])  # the other sequence


def test_reference_rejects_bad_metadata() -> None:
    query, kv_cache, _, _, meta = make_step([(3, 5)], 4, 4, 16, torch.float32, seed=0)
    meta.seq_lens_cpu = [2]
    with pytest.raises(ValueError, match="q_len"):
        ReferenceAttention().forward(query, kv_cache, meta, 0.25)
    query, kv_cache, _, _, meta = make_step([(3, 5)], 4, 3, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ReferenceAttention().forward(query, kv_cache, meta, 0.25)
