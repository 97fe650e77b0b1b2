"""Prefix-shared (cascade) attention against plain paged attention, on fresh random steps.

Each step mixes: prefix groups whose members share the physical prefix blocks (decode tokens right
at the prefix boundary -- no own token before this step --, decode tokens after own blocks, first
suffix prefill chunks starting at the boundary, later chunks), a group leader whose queries are
still inside the prefix (must not be grouped), sequences without a group, padding tokens, random
non-contiguous block ids, and NaN in every slot no sequence owns (a kernel reading one fails).
The Triton kernel runs under TRITON_INTERPRET=1 on the CPU at tiny shapes (skipped without triton).
"""

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
import torch

from phloem.ops.attention import AttentionMetadata, _importable, tile_plan
from phloem.ops.attention.prefill_split import PrefillSplit
from phloem.ops.attention.prefix_groups import build_shared_prefix_metadata, pad_groups
from phloem.ops.attention.reference import ReferenceAttention, paged_attention_reference
from phloem.ops.attention.shared_prefix import (
    SharedPrefixAttention,
    shared_prefix_attention_triton,
)
from phloem.ops.attention.shared_prefix_reference import (
    merge_attention_states,
    shared_prefix_attention_reference,
    shared_prefix_partials_reference,
)
from phloem.ops.attention.sharing_rule import SharingRule
from phloem.ops.kv_store import allocate_kv_cache

torch.set_num_threads(1)

BLOCK_SIZE = 16


def make_shared_step(
    groups: list[tuple[int, list[tuple[int, int]]]],
    singles: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    leaders: list[tuple[int, int, int]] = (),
    num_pad: int = 2,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """A random step: (query, kv_cache, meta, prefix_lens).

    Args:
        groups: (prefix_len, members) with members as (q_len, own_len): the sequence's KV is
            prefix_len + own_len tokens and its q_len queries are the last ones (q_len <= own_len).
        singles: (q_len, seq_len) of sequences without a group.
        leaders: (group index, q_len, seq_len): sequences whose table starts with the group's
            prefix blocks and whose prefix_lens entry is the prefix length, but whose queries
            start inside the prefix (seq_len - q_len < prefix_len).
    Sequences are shuffled, so group members are not contiguous in the step.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seqs = [(g, p, q, p + own) for g, (p, members) in enumerate(groups) for q, own in members]
    seqs += [(None, 0, q, n) for q, n in singles]
    seqs += [(g, groups[g][0], q, n) for g, q, n in leaders]
    rng.shuffle(seqs)
    num_prefix = [p // block_size for p, _ in groups]
    num_own = [max(0, math.ceil(n / block_size) - p // block_size) for _, p, _, n in seqs]
    num_blocks = sum(num_prefix) + sum(num_own) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix_ids = [[free.pop() for _ in range(n)] for n in num_prefix]
    tables, qsl, prefix_lens, seq_lens = [], [0], [], []
    for (g, p, q_len, n), n_own in zip(seqs, num_own):
        tables.append((prefix_ids[g] if g is not None else []) + [free.pop() for _ in range(n_own)])
        qsl.append(qsl[-1] + q_len)
        prefix_lens.append(p)
        seq_lens.append(n)
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for table, n in zip(tables, seq_lens):
        pos = torch.arange(n)
        used[torch.tensor(table)[pos // block_size] * block_size + pos % block_size] = True
    kv_cache.masked_fill_(~used.view(num_blocks, 1, block_size, 1, 1), float("nan"))
    query = torch.randn(qsl[-1] + num_pad, num_heads, head_dim, generator=gen)
    padded = torch.zeros(len(seqs), max(map(len, tables)) + 1, dtype=torch.int32)
    for b, table in enumerate(tables):
        padded[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((qsl[-1] + num_pad,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=padded,
        block_size=block_size,
        max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=tables,
    )
    return query.to(dtype), kv_cache.to(dtype), meta, prefix_lens


def random_members(rng: random.Random, n: int, max_own: int = 40) -> list[tuple[int, int]]:
    """n members: decode at the prefix boundary, decode after own blocks, suffix chunks."""
    kinds = [(1, 1), (1, BLOCK_SIZE + 1), (5, 5), (3, 2 * BLOCK_SIZE + 3)]  # always covered
    members = kinds[:n]
    while len(members) < n:
        own = rng.randint(1, max_own)
        members.append((1, own) if rng.random() < 0.7 else (rng.randint(1, own), own))
    rng.shuffle(members)
    return members


def random_case(seed: int, group_size: int, prefix_len: int, gqa: int):
    rng = random.Random(seed)
    max_own = 8 if prefix_len >= 1024 or group_size > 8 else 40
    groups = [(prefix_len, random_members(rng, group_size, max_own))]
    groups.append((BLOCK_SIZE, random_members(rng, 3)))  # a second, short-prefix group
    singles = [(1, rng.randint(1, 50)), (7, 7), (4, rng.randint(4, 60))]
    leaders = [(0, 5, prefix_len + 3), (0, BLOCK_SIZE, BLOCK_SIZE)]  # queries inside the prefix
    small = prefix_len >= 1024 or group_size > 8  # keep the CPU cost small
    num_kv_heads, head_dim = (1, 4) if small else (2, 8)
    return groups, singles, leaders, gqa * num_kv_heads, num_kv_heads, head_dim


GRID = [
    (1, 16, 1),
    (1, 64, 2),
    (2, 16, 4),
    (2, 272, 1),
    (5, 48, 2),
    (7, 128, 4),
    (16, 2048, 4),
    (64, 16, 2),
    (64, 512, 1),
    (64, 4096, 4),
    (3, 4096, 2),
]


# -- metadata ---------------------------------------------------------------------------------


def test_builder_groups_by_prefix_blocks():
    groups = [(32, [(1, 1), (2, 9), (1, 17)]), (16, [(1, 3)]), (48, [(4, 4), (1, 2)])]
    q, kv, meta, prefix_lens = make_shared_step(
        groups, [(1, 5), (3, 3)], 2, 1, 8, torch.float32, seed=1, leaders=[(0, 4, 20)]
    )
    sp = build_shared_prefix_metadata(meta, prefix_lens)  # min_group_size 2: the single drops
    assert sorted(sp.group_prefix_lens) == [32, 48]
    for g in range(sp.num_groups):
        p = sp.group_prefix_lens[g]
        for b, (start, end) in zip(sp.group_seq_ids[g], sp.group_query_ranges[g]):
            assert meta.block_tables_cpu[b][: p // BLOCK_SIZE] == sp.group_block_ids[g]
            assert (start, end) == tuple(meta.query_start_loc_cpu[b : b + 2])
            assert meta.seq_lens_cpu[b] - (end - start) >= p  # every query after the prefix
            assert sp.seq_group[b] == g and sp.seq_prefix_lens[b] == p
    assert sum(map(len, sp.group_seq_ids)) == 5  # the leader and the single are not grouped
    for b in range(meta.num_seqs):
        p, n = sp.seq_prefix_lens[b], meta.seq_lens_cpu[b]
        assert sp.suffix_lens[b] == n - p
        assert sp.suffix_block_ids[b] == meta.block_tables_cpu[b][p // 16 : math.ceil(n / 16)]
    assert sp.saved_kv_tokens == 2 * 32 + 1 * 48
    forced = build_shared_prefix_metadata(meta, prefix_lens, min_group_size=1)
    assert sorted(forced.group_prefix_lens) == [16, 32, 48]
    decode_only = build_shared_prefix_metadata(meta, prefix_lens, max_member_query_len=1)
    assert decode_only.group_prefix_lens == [32] and len(decode_only.group_seq_ids[0]) == 2


def test_builder_rejects_bad_prefix_lens():
    _, _, meta, prefix_lens = make_shared_step([(32, [(1, 1), (1, 2)])], [], 2, 1, 8,
                                               torch.float32, seed=0)  # fmt: skip
    with pytest.raises(ValueError, match="entries"):
        build_shared_prefix_metadata(meta, prefix_lens[:-1])
    with pytest.raises(ValueError, match="multiple of block size"):
        build_shared_prefix_metadata(meta, [p + 1 if p else 0 for p in prefix_lens])


# -- merge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_merge_equals_softmax_over_concatenation(seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_heads, head_dim, n1, n2 = 5, 3, 4, 7, 11
    scores = torch.randn(num_tokens, num_heads, n1 + n2, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(n1 + n2, head_dim, generator=gen, dtype=torch.float64)
    scores[0, 0, :n1] = float("-inf")  # an empty first set
    scores[1, 2, n1:] = float("-inf")  # an empty second set

    def part(s, v):
        lse = torch.logsumexp(s, dim=-1)
        o = torch.softmax(s, dim=-1) @ v
        return torch.where(torch.isneginf(lse)[..., None], float("nan"), o), lse  # garbage O

    o1, lse1 = part(scores[..., :n1], values[:n1])
    o2, lse2 = part(scores[..., n1:], values[n1:])
    o, lse = merge_attention_states(o1, lse1, o2, lse2)
    torch.testing.assert_close(o, torch.softmax(scores, -1) @ values, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=1e-12)
    # float32 in, float32 out; FlashInfer's base-2 LSE converts by * ln 2
    lse2_base2 = (lse2 / math.log(2)).float()
    o32, lse32 = merge_attention_states(
        o1.float(), lse1.float(), o2.float(), lse2_base2 * math.log(2)
    )
    assert o32.dtype == lse32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o, rtol=0, atol=1e-5)
    # both sets empty: zero output, -inf LSE
    inf = torch.full((1, 1), float("-inf"))
    o_e, lse_e = merge_attention_states(torch.ones(1, 1, 2), inf, torch.ones(1, 1, 2), inf)
    assert o_e.abs().sum() == 0 and torch.isneginf(lse_e).all()


# -- the reference cascade --------------------------------------------------------------------


@pytest.mark.parametrize("group_size,prefix_len,gqa", GRID)
def test_reference_cascade_matches_paged_attention(group_size, prefix_len, gqa):
    seed = group_size * 7919 + prefix_len * 31 + gqa
    groups, singles, leaders, num_heads, num_kv_heads, head_dim = random_case(
        seed, group_size, prefix_len, gqa
    )
    # float64 end to end against the float64 oracle: the cascade is exact up to rounding.
    q, kv, meta, prefix_lens = make_shared_step(
        groups, singles, num_heads, num_kv_heads, head_dim, torch.float64, seed, leaders
    )
    sp = build_shared_prefix_metadata(meta, prefix_lens, min_group_size=1)
    assert sorted(map(len, sp.group_seq_ids)) == sorted([group_size, 3])  # leaders not grouped
    scale = head_dim**-0.5
    oracle = paged_attention_reference(q, kv, meta, scale)
    out, lse = shared_prefix_attention_reference(q, kv, meta, sp, scale, return_lse=True)
    torch.testing.assert_close(out, oracle, rtol=0, atol=1e-10)
    assert torch.isfinite(lse[: meta.query_start_loc_cpu[-1]]).all()
    # float32 against the plain CPU backend
    q32, kv32 = q.float(), kv.float()
    plain = ReferenceAttention().forward(q32, kv32, meta, scale)
    shared = shared_prefix_attention_reference(q32, kv32, meta, sp, scale)
    torch.testing.assert_close(shared, plain, rtol=0, atol=2e-5)
    assert shared[meta.query_start_loc_cpu[-1] :].abs().sum() == 0  # padding tokens


def test_reference_partials_prefix_state_only_for_grouped_tokens():
    groups = [(32, [(1, 1), (2, 5)])]
    q, kv, meta, prefix_lens = make_shared_step(groups, [(3, 9)], 2, 2, 8, torch.float64, 3)
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    _, lse_pre, _, lse_suf = shared_prefix_partials_reference(q, kv, meta, sp, 0.5)
    grouped = set(sp.group_token_indices(0))
    for t in range(meta.query_start_loc_cpu[-1]):
        assert torch.isfinite(lse_pre[t]).all() == (t in grouped)
        assert torch.isfinite(lse_suf[t]).all()


# -- the backend and its cost rule ------------------------------------------------------------


def test_backend_cost_rule_counters_and_exactness():
    groups = [(64, [(1, 1), (1, 3), (2, 7), (1, 20)])]
    q, kv, meta, prefix_lens = make_shared_step(groups, [(1, 9), (4, 4)], 4, 2, 8,
                                                torch.float32, seed=5)  # fmt: skip
    plain = ReferenceAttention().forward(q, kv, meta, 0.35)
    # saved = 3 * 64 = 192 KV tokens for 5 grouped query tokens
    backend = SharedPrefixAttention(ReferenceAttention(), impl="reference",
                                    rule=SharingRule(min_saved_kv_tokens=192,
                                                     partial_cost_tokens=192 / 5))  # fmt: skip
    meta.prefix_lens_cpu = prefix_lens
    backend.begin_step(meta)
    torch.testing.assert_close(backend.forward(q, kv, meta, 0.35), plain, rtol=0, atol=2e-5)
    assert backend.last_path == "shared_prefix"
    backend.rule = dataclasses.replace(backend.rule, min_saved_kv_tokens=193)  # plain path
    backend.begin_step(meta)
    torch.testing.assert_close(backend.forward(q, kv, meta, 0.35), plain, rtol=0, atol=0)
    assert backend.last_path == "reference"
    backend.rule = SharingRule(min_saved_kv_tokens=0, partial_cost_tokens=192 / 5 + 0.1)  # ratio
    assert backend.plan(meta) is None
    step = dataclasses.replace(meta)  # a new step without prefix information: plain
    backend.forward(q, kv, step, 0.35)  # without begin_step the step plans itself
    backend.forward(q, kv, step, 0.35)  # same step, second layer: no new plan
    assert backend.stats() == {
        "attention_path_last": "reference",
        "shared_prefix_steps": 1,
        "plain_steps": 2,
        "cuda_graph_steps": 0,
        "shared_prefix_graph_steps": 0,
        "prefill_split_steps": 0,
        "plain_prefill_split_steps": 0,
        "shared_prefix_saved_kv_tokens": 192,
    }
    with pytest.raises(ValueError, match="CUDA graphs"):
        backend.prepare_replay(step)
    with pytest.raises(ValueError, match="variant"):
        backend.prepare_replay(step, "other")
    backend.reset_stats()
    assert set(backend.stats().values()) == {0, "reference"}


# -- the Triton kernel (interpreter on the CPU) -----------------------------------------------


@pytest.fixture(scope="module")
def triton_kernel(triton_kernels):
    """The Triton module; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    return triton_kernels("phloem.ops.attention.shared_prefix_triton", "tile_kernel")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


TRITON_GRID = [  # (group size, prefix_len, gqa, prefix_splits, block_m, narrow_block_m)
    (1, 16, 1, 1, 16, None),
    (3, 32, 2, 1, 16, None),
    (4, 48, 4, 3, 16, None),
    (6, 32, 2, 2, 32, None),
    (2, 96, 1, None, None, None),
    (5, 32, 2, 2, 32, 16),  # decode segments (<= 16 rows) in a second, narrow launch
    (3, 48, 4, None, None, 16),
]


@pytest.mark.parametrize("group_size,prefix_len,gqa,splits,block_m,narrow", TRITON_GRID)
def test_triton_matches_reference(
    triton_kernel, group_size, prefix_len, gqa, splits, block_m, narrow
):
    rng = random.Random(group_size * 100 + prefix_len + gqa)
    groups = [(prefix_len, random_members(rng, group_size, max_own=24)), (16, [(1, 2), (2, 3)])]
    singles = [(1, 21), (6, 6), (3, 19)]
    leaders = [(0, 4, prefix_len + 1)]
    q, kv, meta, prefix_lens = make_shared_step(
        groups, singles, 2 * gqa, 2, 8, torch.float32, seed=gqa + splits if splits else 0,
        leaders=leaders,
    )  # fmt: skip
    sp = build_shared_prefix_metadata(meta, prefix_lens, min_group_size=1)
    dev = device()
    # Two "layers" of one step: the second reuses the first's plan and partial-state buffers.
    for layer in range(2):
        if layer:
            q, kv = torch.randn_like(q), kv * -1.5 + 0.25  # NaN slots stay NaN
        oracle = paged_attention_reference(q, kv, meta, 0.4)
        out = shared_prefix_attention_triton(
            q.to(dev), kv.to(dev), meta, sp, 0.4, block_m=block_m, block_n=16,
            prefix_splits=splits, narrow_block_m=narrow,
        )  # fmt: skip
        torch.testing.assert_close(out.cpu().double(), oracle, rtol=0, atol=1e-5)
        assert out[meta.query_start_loc_cpu[-1] :].abs().sum() == 0
    assert len(sp.plan_cache) == 1
    plan = next(iter(sp.plan_cache.values()))
    assert [launch.narrow for launch in plan.launches] == ([False, True] if narrow else [False])
    assert all(launch.programs is None for launch in plan.launches)  # eager: a program a tile


@pytest.mark.parametrize(
    "block_size,block_n,layout", [(8, 16, "NHD"), (32, 16, "HND"), (64, 32, "NHD"), (16, 16, "HND")]
)
def test_triton_other_block_sizes_and_layouts(triton_kernel, block_size, block_n, layout):
    """KV blocks smaller and larger than the kernel's KV tile (`--block-size` is a user choice):
    the tile's rows map to (block, offset) per row either way; and a head-major (HND) cache,
    read through its strides."""
    p = 2 * block_size
    groups = [(p, [(1, 1), (1, block_size + 3), (4, 9), (2, 2 * block_size + 1)])]
    groups.append((block_size, [(1, 2), (3, 5)]))
    q, kv, meta, prefix_lens = make_shared_step(
        groups, [(1, 3 * block_size - 1), (5, 5)], 4, 2, 8, torch.float32, seed=block_size,
        leaders=[(0, 3, p + 2)], block_size=block_size,
    )  # fmt: skip
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    assert sp.num_groups == 2
    oracle = paged_attention_reference(q, kv, meta, 0.4)
    dev = device()
    cache = allocate_kv_cache(kv.shape[0], block_size, 2, 8, kv.dtype, dev, layout)
    cache.copy_(kv)
    out = shared_prefix_attention_triton(q.to(dev), cache, meta, sp, 0.4, block_n=block_n)
    torch.testing.assert_close(out.cpu().double(), oracle, rtol=0, atol=1e-5)


def test_triton_half_precision_and_head_dim_padding(triton_kernel):
    groups = [(32, [(1, 1), (2, 3), (1, 17)])]
    q, kv, meta, prefix_lens = make_shared_step(groups, [(1, 5)], 4, 2, 12, torch.float16, 11)
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    oracle = paged_attention_reference(q, kv, meta, 0.3)
    dev = device()
    out = shared_prefix_attention_triton(q.to(dev), kv.to(dev), meta, sp, 0.3, block_n=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.cpu().double(), oracle, rtol=0, atol=2e-3)


def test_backend_triton_path(triton_kernel):
    groups = [(48, [(1, 1), (1, 4), (3, 3)]), (16, [(1, 1), (1, 2)])]
    q, kv, meta, prefix_lens = make_shared_step(groups, [(2, 9)], 2, 1, 8, torch.float32, 13)
    meta.prefix_lens_cpu = prefix_lens
    backend = SharedPrefixAttention(ReferenceAttention(), impl="triton",
                                    rule=SharingRule(min_saved_kv_tokens=1, partial_cost_tokens=1),
                                    block_n=16)  # fmt: skip
    dev = device()
    out = backend.forward(q.to(dev), kv.to(dev), meta, 0.5)
    assert backend.last_path == "shared_prefix"
    oracle = paged_attention_reference(q, kv, meta, 0.5)
    torch.testing.assert_close(out.cpu().double(), oracle, rtol=0, atol=1e-5)


# -- GPU: realistic shapes, compiled Triton and the FlashInfer cascade baseline -----------------

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_step(dtype=torch.bfloat16, num_groups=4, degree=16, prefix_len=2048, seed=0):
    """Llama-3-8B attention shapes: decode members, suffix chunks, singles, a leader."""
    rng = random.Random(seed)
    groups = [(prefix_len, random_members(rng, degree, max_own=300)) for _ in range(num_groups)]
    singles = [(1, 700), (37, 37), (64, 900)]
    q, kv, meta, prefix_lens = make_shared_step(
        groups, singles, 32, 8, 128, dtype, seed, leaders=[(0, 100, prefix_len + 20)]
    )
    meta.prefix_lens_cpu = prefix_lens
    return q.cuda(), kv.cuda(), meta, prefix_lens


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("prefix_splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_triton_matches_reference(prefix_splits, dtype):
    pytest.importorskip("triton")
    q, kv, meta, prefix_lens = gpu_step(dtype)
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    scale = 128**-0.5
    want = ReferenceAttention().forward(q.float(), kv.float(), meta, scale)
    got = shared_prefix_attention_triton(q, kv, meta, sp, scale, prefix_splits=prefix_splits)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)


@pytest.mark.gpu
@requires_gpu
def test_gpu_triton_and_flashinfer_read_an_fp8_cache():
    """Llama-8B shapes, float8_e4m3fn cache, bf16 queries: our kernel and FlashInfer's (the
    plain fallback) against the float32 reference on the dequantized cache."""
    pytest.importorskip("triton")
    q, kv, meta, prefix_lens = gpu_step()
    kv8 = kv.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = 128**-0.5
    want = ReferenceAttention().forward(q.float(), kv8.float(), meta, scale)
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    for fp8_math in ("f16", "q"):
        got = shared_prefix_attention_triton(q, kv8, meta, sp, scale, fp8_math=fp8_math)
        torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)
    pytest.importorskip("flashinfer")
    from phloem.ops.attention import get_attention_backend

    plain = get_attention_backend(
        "flashinfer", num_heads=32, num_kv_heads=8, head_dim=128, scale=scale, dtype=q.dtype,
        kv_dtype=torch.float8_e4m3fn, device=q.device,
    )  # fmt: skip
    torch.testing.assert_close(plain.forward(q, kv8, meta, scale).float(), want, rtol=0, atol=2e-2)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("impl", ["triton", "flashinfer"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_backend_paths(impl, layout):
    if impl == "flashinfer":
        pytest.importorskip("flashinfer")
    pytest.importorskip("triton")
    from phloem.ops.attention import get_attention_backend

    q, kv, meta, _ = gpu_step()
    if layout == "HND":
        hnd = allocate_kv_cache(kv.shape[0], kv.shape[2], 8, 128, kv.dtype, kv.device, "HND")
        kv = hnd.copy_(kv)
    scale = 128**-0.5
    fallback = get_attention_backend(
        "auto", num_heads=32, num_kv_heads=8, head_dim=128, scale=scale, dtype=q.dtype,
        device=q.device, kv_layout=layout,
    )  # fmt: skip
    backend = SharedPrefixAttention(fallback, impl=impl)
    backend.begin_step(meta)
    got = backend.forward(q, kv, meta, scale)
    assert backend.last_path == "shared_prefix"
    want = ReferenceAttention().forward(q.float(), kv.float(), meta, scale)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)
    step = dataclasses.replace(meta, prefix_lens_cpu=None)  # no groups: the fallback runs
    backend.begin_step(step)
    plain = backend.forward(q, kv, step, scale)
    assert backend.last_path == fallback.name
    torch.testing.assert_close(plain.float(), want, rtol=0, atol=2e-2)


@pytest.mark.gpu
@requires_gpu
def test_gpu_shared_prefix_cuda_graph_replays_new_steps():
    """The shared-prefix graph variant, captured once on a padding-only step, replays decode
    steps of different group structure (and fewer real sequences than the batch) exactly."""
    pytest.importorskip("triton")
    batch, scale = 96, 128**-0.5
    backend = SharedPrefixAttention(
        ReferenceAttention(), impl="triton", num_heads=32, num_kv_heads=8, head_dim=128,
        device="cuda", rule=SharingRule(min_saved_kv_tokens=1, partial_cost_tokens=0),
    )  # fmt: skip
    steps = []
    for seed, (num_groups, degree, prefix_len, singles) in enumerate(
        [(4, 16, 2048, 10), (2, 8, 512, 3), (6, 12, 1024, 0)]
    ):
        rng = random.Random(seed)
        groups = [(prefix_len, [(1, rng.randint(1, 300)) for _ in range(degree)])
                  for _ in range(num_groups)]  # fmt: skip
        num_pad = batch - num_groups * degree - singles
        steps.append(_decode_step(groups, [(1, rng.randint(1, 900)) for _ in range(singles)],
                                  num_pad, seed, num_heads=32, num_kv_heads=8))  # fmt: skip
    # one cache holds every step's KV: capture needs fixed addresses (head_dim 8 -> 128 below)
    kv_all = torch.cat([kv for _, kv, *_ in steps]).nan_to_num(0.0)
    kv_all = kv_all.repeat_interleave(16, dim=-1).to(torch.bfloat16).cuda()
    offsets = list(itertools.accumulate([0] + [kv.shape[0] for _, kv, *_ in steps]))
    query = torch.zeros(batch, 32, 128, dtype=torch.bfloat16, device="cuda")
    capture_meta = _decode_step([], [], batch, 0, num_heads=32, num_kv_heads=8)[2]
    backend.prepare_replay(capture_meta, "shared_prefix")
    backend.forward(query, kv_all, capture_meta, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(query, kv_all, capture_meta, scale)
    for (q, _, meta, real, real_prefix_lens), off in zip(steps, offsets):
        tables = [[b + off for b in t] for t in meta.block_tables_cpu]
        meta = dataclasses.replace(meta, block_tables_cpu=tables,
                                   block_tables=meta.block_tables + off)  # fmt: skip
        real = dataclasses.replace(real, block_tables_cpu=meta.block_tables_cpu[: real.num_seqs])
        sp = build_shared_prefix_metadata(real, real_prefix_lens)
        backend.prepare_replay(meta, "shared_prefix", sp)
        query.copy_(q.repeat_interleave(16, dim=-1).to(torch.bfloat16))
        graph.replay()
        want = paged_attention_reference(query.float().cpu(), kv_all.float().cpu(), meta, scale)
        torch.testing.assert_close(out.float().cpu(), want.float(), rtol=0, atol=2e-2)


def test_triton_split_rule(triton_kernel, monkeypatch):
    """Few long prefixes on a 132-SM GPU split; many groups, or tiny prefixes, do not."""
    monkeypatch.setattr(tile_plan, "num_sms", lambda device: 132)

    def splits(num_groups, prefix_len, degree=16):
        groups = [(prefix_len, [(1, 201)] * degree) for _ in range(num_groups)]
        _, _, meta, prefix_lens = make_shared_step(groups, [], 4, 1, 4, torch.float32, 0, num_pad=0)
        sp = build_shared_prefix_metadata(meta, prefix_lens)
        rows = np.array([degree * 4] * num_groups)
        suffix_work = sum(sp.suffix_lens)  # one row tile (4 rows <= 64) per decode sequence
        num_grouped = num_groups * degree
        return tile_plan.split_counts(
            sp, rows, suffix_work, 8, num_grouped, 64, 32 * 129 * 4, "cpu", None
        )

    assert splits(4, 8192) == [5] * 4
    assert splits(64, 8192, degree=4) == [1] * 64
    assert splits(2, 256) == [1, 1]


# -- end to end: greedy outputs identical with the shared-prefix path on and off ------------------


def test_greedy_identical_with_shared_path(tmp_path, embedded_tokenizer_dir, monkeypatch):
    """A tiny Llama through LLM.generate (planned groups, chunked prefill mixed with decode): the
    model runner passes each sequence's group prefix length itself, and the shared-prefix
    backend (reference impl, always chosen) changes no greedy token; nor does its plain steps'
    prefill split (chunks of >= 4 queries on a second reference backend, `plan_plain`)."""
    from phloem import LLM, SamplingParams
    from tests.engine.test_prefix_sharing_e2e import workloads
    from tests.engine.tiny_models import write_tiny_model

    torch.set_num_threads(2)
    write_tiny_model("llama", tmp_path, embedded_tokenizer_dir, seed=1)
    prompts = [{"prompt_token_ids": p} for p in workloads()["many_groups"]]
    random.Random(0).shuffle(prompts)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = []
    for name in ("reference", "shared_prefix"):
        llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=24, attention_backend=name)
        runner = llm.llm_engine.executor.worker.model_runner
        if name == "shared_prefix":
            backend = runner.backend
            assert isinstance(backend, SharedPrefixAttention)
            backend.impl = "reference"
            backend.rule = SharingRule(min_saved_kv_tokens=0, partial_cost_tokens=0)
            backend.prefill = PrefillSplit(ReferenceAttention(), min_query_len=4)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]
    assert backend.num_shared_steps > 0 and backend.num_saved_kv_tokens > 0
    assert backend.num_plain_split_steps > 0


def test_plan_decode_for_the_cuda_graph_decision():
    rule = SharingRule(min_saved_kv_tokens=64, graph_min_saved_kv_tokens=64,
                       shared_graph_min_saved_kv_tokens=48)  # fmt: skip
    backend = SharedPrefixAttention(ReferenceAttention(), rule=rule)
    tables = [[7, 8, 1], [7, 8, 2], [7, 8, 3], [9, 4]]
    seq_lens = [33, 40, 35, 20]
    path, sp = backend.plan_decode(seq_lens, tables, [32, 32, 32, 0], block_size=16)
    assert path == "eager" and sp.group_seq_ids == [[0, 1, 2]] and sp.saved_kv_tokens == 64
    # 32 saved tokens < 64: the plain graph, with or without a shared-prefix graph
    assert backend.plan_decode(seq_lens, tables, [32, 32, 0, 0], 16) == ("graph", None)
    assert backend.plan_decode(seq_lens, tables, [32, 32, 0, 0], 16, True) == ("graph", None)
    assert backend.num_shared_steps == 0  # planning only: no counters
    # a step the eager rule accepts still replays the plain graph below the graph threshold...
    backend.rule = dataclasses.replace(backend.rule, graph_min_saved_kv_tokens=65)
    assert backend.plan_decode(seq_lens, tables, [32, 32, 32, 0], 16) == ("graph", None)
    # ...and the shared-prefix graph when the runner has one (threshold 48 <= 64)
    path, sp = backend.plan_decode(seq_lens, tables, [32, 32, 32, 0], 16, shared_graph=True)
    assert path == "shared_graph" and sp.group_seq_ids == [[0, 1, 2]]
    backend.rule = dataclasses.replace(backend.rule, shared_graph_min_saved_kv_tokens=65)
    assert backend.plan_decode(seq_lens, tables, [32, 32, 32, 0], 16, True) == ("graph", None)


def test_graph_variants_need_triton_on_cuda_and_geometry():
    cpu = SharedPrefixAttention(ReferenceAttention(), num_heads=8, num_kv_heads=2, head_dim=8,
                                device="cpu")  # fmt: skip
    assert cpu.graph_variants() == {"plain": 1}
    no_geometry = SharedPrefixAttention(ReferenceAttention(), device="cuda")
    assert no_geometry.graph_variants() == {"plain": 1}
    reference = SharedPrefixAttention(ReferenceAttention(), impl="reference", num_heads=8,
                                      num_kv_heads=2, head_dim=8, device="cuda")  # fmt: skip
    assert reference.graph_variants() == {"plain": 1}

    class Planning(ReferenceAttention):
        supports_cuda_graphs = True

    if _importable("triton"):
        gqa17 = SharedPrefixAttention(Planning(), num_heads=34, num_kv_heads=2, head_dim=8,
                                      device="cuda")  # fmt: skip
        assert gqa17.graph_variants() == {"plain": 1}  # 17 rows per token: no narrow tile
        ok = SharedPrefixAttention(Planning(), num_heads=32, num_kv_heads=8, head_dim=128,
                                   device="cuda")  # fmt: skip
        assert ok.graph_variants() == {"plain": 1, "shared_prefix": 16}


def _decode_step(groups, singles, num_pad, seed, num_heads=4, num_kv_heads=2):
    """A decode step as a CUDA-graph replay sees it: the real sequences (shuffled groups and
    singles, q_len 1), then `num_pad` padding sequences (1 KV token each, no group) at the end.
    Returns (query, kv, padded meta, real meta, real prefix_lens)."""
    q, kv, meta, prefix_lens = make_shared_step(
        groups, singles + [(1, 1)] * num_pad, num_heads, num_kv_heads, 8, torch.float32, seed,
        num_pad=0,
    )  # fmt: skip
    pad = [b for b, (n, p) in enumerate(zip(meta.seq_lens_cpu, prefix_lens)) if n == 1 and not p]
    pad = pad[len(pad) - num_pad :] if num_pad else []
    order = [b for b in range(meta.num_seqs) if b not in pad] + pad
    tables = [meta.block_tables_cpu[b] for b in order]
    seq_lens = [meta.seq_lens_cpu[b] for b in order]
    n = len(order)

    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def meta_of(k):
        return AttentionMetadata(
            slot_mapping=torch.full((k,), -1, dtype=torch.int64),
            query_start_loc=torch.arange(k + 1, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens[:k], dtype=torch.int32),
            block_tables=padded[:k],
            block_size=BLOCK_SIZE, max_query_len=1, max_seq_len=max(seq_lens[:k], default=0),
            query_start_loc_cpu=list(range(k + 1)), seq_lens_cpu=seq_lens[:k],
            block_tables_cpu=tables[:k],
        )  # fmt: skip

    real_prefix_lens = [prefix_lens[b] for b in order][: n - num_pad]
    return q[order], kv, meta_of(n), meta_of(n - num_pad), real_prefix_lens


@pytest.mark.parametrize("wide_programs", ["default", 1, 3, "off"])
def test_decode_graph_plan_matches_reference(triton_kernel, monkeypatch, wide_programs):
    """Shared-prefix graph steps (fixed-capacity tile tables, device-side tile and merge counts,
    fixed suffix slot) on two different steps through one set of buffers: the second has fewer
    groups, splits and sequences, so stale tiles, LSE slots or rows would show. The wide launch
    is persistent (one program striding over every tile, three, or the default count) or has a
    program per table row, the rows past the step's tiles no-ops ("off")."""
    monkeypatch.setattr(tile_plan, "num_sms", lambda device: 64)  # small shares: splits
    monkeypatch.setattr(tile_plan, "MIN_SPLIT_KV", 16)
    from phloem.ops.attention.decode_graph_plan import DecodeGraphPlan

    backend = SharedPrefixAttention(ReferenceAttention(), impl="triton", num_heads=4,
                                    num_kv_heads=2, head_dim=8, device=device(),
                                    block_n=16)  # fmt: skip
    options = {"off": dict(persistent_wide=False), "default": {}}.get(
        wide_programs, dict(wide_programs=wide_programs)
    )
    rng = random.Random(5)
    steps = [
        ([(64, [(1, rng.randint(1, 30)) for _ in range(5)]), (32, [(1, 3), (1, 17)])],
         [(1, 21), (1, 40)], 3),
        ([(16, [(1, 1), (1, 9)])], [(1, 5)], 1),
    ]  # fmt: skip
    dev = device()
    for i, (groups, singles, num_pad) in enumerate(steps):
        q, kv, meta, real, real_prefix_lens = _decode_step(groups, singles, num_pad, seed=i)
        sp = build_shared_prefix_metadata(real, real_prefix_lens)
        assert sp.num_groups == len(groups)
        if i == 0:  # the plan the first capture would make, with this test's wide launch
            backend._graph_plan = DecodeGraphPlan(
                meta.num_seqs, 4, 2, 8, dev, max_blocks=64 * meta.num_seqs, block_n=16, **options
            )
        backend.prepare_replay(meta, "shared_prefix", sp)
        out = backend.forward(q.to(dev), kv.to(dev), meta, 0.45)
        oracle = paged_attention_reference(q, kv, meta, 0.45)
        torch.testing.assert_close(out.cpu().double(), oracle, rtol=0, atol=1e-5)
        graph = backend._graph_plan
        if i == 0:
            assert graph.max_batch == meta.num_seqs
            launch = graph.plan_for(meta.num_seqs).launches[0]
            assert (launch.tiles.cpu()[:, 7] > 0).any(), "the first step should split a prefix"
            tiles = int(launch.count.item()) if launch.count is not None else None
            if wide_programs == "off":
                assert launch.programs is None
            else:
                assert tiles is not None and tiles > 3, "several tiles per program"
                assert launch.programs == {"default": meta.num_seqs}.get(
                    wide_programs, wide_programs
                )
        monkeypatch.undo()  # the second step: no splits
    assert backend.stats()["shared_prefix_graph_steps"] == 2
    assert backend.last_path == "shared_prefix"


def test_pad_groups_appends_lone_sequences():
    _, _, meta, real, real_prefix_lens = _decode_step([(32, [(1, 3), (1, 4)])], [(1, 7)], 2, 0)
    sp = build_shared_prefix_metadata(real, real_prefix_lens)
    padded = pad_groups(sp, meta)
    assert padded.seq_group == sp.seq_group + [-1, -1] and padded.group_seq_ids == sp.group_seq_ids
    assert padded.suffix_lens[-2:] == [1, 1] and padded.seq_prefix_lens[-2:] == [0, 0]
    assert padded.suffix_block_ids[-2:] == [meta.block_tables_cpu[-2], meta.block_tables_cpu[-1]]
    assert sp.suffix_lens == padded.suffix_lens[:3]  # the real plan is not mutated


def test_warmup_runs_one_shared_step_and_counts_nothing():
    backend = SharedPrefixAttention(ReferenceAttention())
    kv = torch.randn(3, 2, 16, 2, 8)
    backend.warmup(kv, num_heads=4, block_id=2, scale=0.3)
    assert backend.last_path == "shared_prefix"
    assert backend.num_shared_steps == backend.num_plain_steps == 0
    assert backend.num_saved_kv_tokens == 0


def test_warmup_with_a_prefill_split_counts_nothing(triton_kernel):
    """The warm-up step's prefill chunk goes to the prefill backend; no counter keeps it."""
    backend = SharedPrefixAttention(ReferenceAttention(), impl="triton",
                                    rule=SharingRule(min_saved_kv_tokens=16, partial_cost_tokens=1),
                                    prefill_backend=ReferenceAttention(), block_n=16)  # fmt: skip
    backend.warmup(torch.randn(3, 2, 16, 2, 8, device=device()), num_heads=4, block_id=2, scale=0.3)
    assert backend.last_path == "shared_prefix"
    assert set(backend.stats().values()) == {0, "shared_prefix"}


def test_a_deferred_prefill_backend_takes_chunks_only_once_ready(triton_kernel):
    """`defer_prefill_backend(ready)`: while ready() is False (fa3 still compiling on a cold
    start) the warm-up's prefill chunk stays on our kernel and the prefill backend plans nothing;
    from the first step after it turns True, the chunk goes to it."""
    planned = []

    class Recording(ReferenceAttention):
        def begin_step(self, sub):
            planned.append(sub.num_seqs)

    backend = SharedPrefixAttention(ReferenceAttention(), impl="triton",
                                    rule=SharingRule(min_saved_kv_tokens=16, partial_cost_tokens=1),
                                    prefill_backend=Recording(), block_n=16)  # fmt: skip
    ready = [False]
    backend.defer_prefill_backend(lambda: ready[0])
    kv = torch.randn(3, 2, 16, 2, 8, device=device())
    backend.warmup(kv, num_heads=4, block_id=2, scale=0.3)
    assert backend.last_path == "shared_prefix" and planned == []
    ready[0] = True
    backend.warmup(kv, num_heads=4, block_id=2, scale=0.3)
    assert planned == [1]


def test_builder_compares_whole_prefix():
    """Same length, first and last block, different middle block: two groups, not one."""
    tables = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 9, 3, 12], [1, 9, 3, 13], [1, 2, 3, 14]]
    n = len(tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.full((n,), 50, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        block_size=16, max_query_len=1, max_seq_len=50,
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=[50] * n, block_tables_cpu=None,
    )  # fmt: skip
    sp = build_shared_prefix_metadata(meta, [48] * n)
    assert sp.group_block_ids == [[1, 2, 3], [1, 9, 3]]
    assert sp.group_seq_ids == [[0, 1, 4], [2, 3]]
    assert sp.suffix_block_ids == [[10], [11], [12], [13], [14]]


@pytest.mark.parametrize("min_query_len", [3, 6])
def test_prefill_chunks_split_to_another_backend(triton_kernel, min_query_len):
    """Long ungrouped prefill chunks go to `prefill_backend` (planned for just them), the rest to
    our kernel; with min_query_len 6 one chunk qualifies (a token slice, written in place), with
    3 several do, scattered through the step (gathered and scattered by index)."""
    rng = random.Random(min_query_len)
    groups = [(32, random_members(rng, 5, max_own=20)), (16, [(1, 2), (1, 5)])]
    singles = [(1, 21), (6, 6), (3, 19), (4, 30)]
    q, kv, meta, prefix_lens = make_shared_step(groups, singles, 4, 2, 8, torch.float32, seed=3,
                                                leaders=[(0, 4, 35)])  # fmt: skip
    meta.prefix_lens_cpu = prefix_lens

    class Recording(ReferenceAttention):
        def begin_step(self, sub):
            self.planned = sub

        def forward(self, query, kv_cache, sub, scale, out=None, k_scale=1.0, v_scale=1.0):
            assert sub is self.planned
            res = super().forward(query, kv_cache, sub, scale, None, k_scale, v_scale)
            return res if out is None else out.copy_(res)

    prefill = Recording()
    backend = SharedPrefixAttention(ReferenceAttention(), impl="triton",
                                    rule=SharingRule(min_saved_kv_tokens=1, partial_cost_tokens=1),
                                    block_n=16, prefill_backend=prefill,
                                    prefill_min_query_len=min_query_len)  # fmt: skip
    dev = device()
    for _ in range(2):  # two layers of one step: the split is planned once
        out = backend.forward(q.to(dev), kv.to(dev), meta, 0.5)
        oracle = paged_attention_reference(q, kv, meta, 0.5)
        torch.testing.assert_close(out.cpu().double(), oracle, rtol=0, atol=1e-5)
    qsl = meta.query_start_loc_cpu
    long_lone = sorted(qsl[b + 1] - qsl[b] for b in range(meta.num_seqs)
                       if qsl[b + 1] - qsl[b] >= min_query_len
                       and backend._sp.seq_group[b] < 0)  # fmt: skip
    lens = prefill.planned.query_start_loc_cpu
    assert sorted(b - a for a, b in zip(lens, lens[1:])) == long_lone
    assert len(long_lone) == (1 if min_query_len == 6 else 4)
    assert isinstance(backend._split[1], slice) == (len(long_lone) == 1)
    assert backend.stats()["prefill_split_steps"] == 1


@pytest.mark.parametrize(
    "q_dtype,fp8_math,atol",
    [(torch.float16, "f16", 5e-3), (torch.bfloat16, "f16", 2e-2), (torch.float16, "q", 5e-3)],
)
def test_triton_reads_an_fp8_cache(triton_kernel, q_dtype, fp8_math, atol):
    """float8_e4m3fn KV (NaN kept in unowned slots) with 16-bit queries: our kernel converts on
    load (to float16 with the pre-scaled query, or to the query's dtype) and matches the float64
    math on the dequantized cache (tolerance: the output dtype's rounding). The interpreter
    cannot convert FP8 to bfloat16, so the "q" mode runs float16 queries here; the GPU tests
    cover bfloat16."""
    rng = random.Random(7)
    groups = [(32, random_members(rng, 4, max_own=20)), (16, [(1, 2), (2, 5)])]
    q, kv, meta, prefix_lens = make_shared_step(groups, [(1, 9), (5, 5)], 4, 2, 16,
                                                torch.float32, seed=3)  # fmt: skip
    kv8 = kv.clamp(-448, 448).to(torch.float8_e4m3fn)
    q16 = (q * 4).to(q_dtype)  # |q| up to ~16: the scores span a wide softmax range
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    dev = device()
    out = shared_prefix_attention_triton(q16.to(dev), kv8.to(dev), meta, sp, 0.4, block_n=16,
                                         fp8_math=fp8_math)  # fmt: skip
    assert out.dtype == q_dtype
    want = paged_attention_reference(q16.double(), kv8.double(), meta, 0.4)
    torch.testing.assert_close(out.cpu().double(), want, rtol=0, atol=atol)
