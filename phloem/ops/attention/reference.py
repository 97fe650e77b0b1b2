"""Plain-torch paged attention: the CPU backend and the oracle every fast kernel is tested against.

Layout and step packing are described in `metadata.py`. For each sequence b of a step:

    |------------------- seq_lens[b] = L (KV after this step) -------------------|
    |---- already cached: L - q_len ----|------ q_len query tokens (this step) ---|
    query i (0-based) sits at position L - q_len + i and attends to KV positions 0 .. L - q_len + i.

`ReferenceAttention` batches the decode sequences (q_len == 1) of a step into padded gathers of at
most `DECODE_CHUNK_ELEMENTS` K elements, each one `scaled_dot_product_attention` call with the GQA
group as the query length, and runs prefill chunks (q_len > 1) one by one through the same call
with an explicit causal-offset mask; SDPA reads K and V as head-major views of token-major copies.
Few, large torch calls are the point on a CPU: each parallel region wakes the thread pool (tens of
microseconds with `OMP_WAIT_POLICY=PASSIVE`), so a per-head loop of small matmuls cost a 1-token
decode step more than a 5-token chunk's single SDPA call. Scores and softmax are computed in
float32 (float64 inputs stay float64). An FP8 cache is read as stored value * k_scale (keys) and
* v_scale (values), in the compute dtype (`phloem.ops.kv_store` says how it was written).
`paged_attention_reference` is the dumbest version, for tests. `XqaEmulatedAttention` (opt-in,
for quality measurements on the CPU) replaces SDPA by `xqa_attention`, the e4m3 rounding of
FlashInfer's XQA decode kernel over an FP8 cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.kv_store import FP8_KV_DTYPE


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _geometry(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_heads, head_dim, num_kv_heads, GQA group size) of a query [T, H, D] and a cache
    [blocks, 2, block_size, H_kv, D]."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    return num_heads, head_dim, num_kv_heads, num_heads // num_kv_heads


def _check_shapes(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"expected query [T, H, D] and kv_cache [num_blocks, 2, block_size, H_kv, D], got "
            f"{tuple(query.shape)} and {tuple(kv_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads, kv_head_dim = kv_cache.shape[2:]
    if head_dim != kv_head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads of dim {head_dim}; the cache has {num_kv_heads} KV heads "
            f"of dim {kv_head_dim} (need equal head dims and num_heads % num_kv_heads == 0)"
        )
    if block_size != meta.block_size:
        raise ValueError(f"kv_cache block size {block_size} != meta.block_size {meta.block_size}")
    qsl = meta.query_start_loc_cpu
    if len(qsl) != meta.num_seqs + 1 or qsl[-1] > query.shape[0]:
        raise ValueError(f"query_start_loc_cpu {qsl} does not fit {query.shape[0]} query tokens")
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        if qsl[b + 1] - qsl[b] > seq_len:
            raise ValueError(f"sequence {b}: q_len {qsl[b + 1] - qsl[b]} > seq_len {seq_len}")


# K elements (tokens x H_kv x D) gathered per decode chunk (2 MB of float32 each for K and V): the
# copy stays in cache for SDPA, and glibc serves buffers this small from its heap, while larger
# fresh ones may be mmapped and page-faulted in again on every call.
DECODE_CHUNK_ELEMENTS = 1 << 19


def _gather_kv(
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of B sequences as [B, max_len, H_kv, D] in `dtype`, gathered row by row and
    multiplied by k_scale / v_scale when the cache is FP8.

    Args:
        tables: int64 [B, max_blocks] block tables; lens: int64 [B] KV lengths (>= 1).
    Positions at or past a sequence's length read its position len - 1 (always written, so
    finite, unlike unwritten slots that may hold NaN); callers mask them out of the softmax.
    K and V are views of one token-major [B, max_len, 2, H_kv, D] copy: one gather and one
    conversion for both (on a CPU, converting while transposing to head-major is a strided copy
    several times slower than this copy plus SDPA on transposed views).
    """
    block_size = kv_cache.shape[2]
    pos = torch.arange(max_len, device=kv_cache.device)
    clamped = torch.minimum(pos[None, :], lens[:, None] - 1)  # [B, L]
    block_ids = torch.gather(tables, 1, clamped // block_size)
    offsets = clamped % block_size
    # Advanced indexing through the strides: either layout of kv_store.allocate_kv_cache.
    kv = kv_cache[block_ids, :, offsets].to(dtype)  # [B, L, 2, H_kv, D]
    k, v = kv[:, :, 0], kv[:, :, 1]
    if kv_cache.dtype == FP8_KV_DTYPE:
        k, v = k.mul_(k_scale), v.mul_(v_scale)
    return k, v


def _decode_chunks(seq_lens: list[int], seqs: list[int], row_elements: int) -> list[list[int]]:
    """`seqs` split in order into runs whose padded K (run length x longest x `row_elements`)
    stays within DECODE_CHUNK_ELEMENTS, or a single sequence."""
    chunks: list[list[int]] = []
    longest = 0
    for b in seqs:
        longest_with = max(longest, seq_lens[b])
        if chunks and (len(chunks[-1]) + 1) * longest_with * row_elements <= DECODE_CHUNK_ELEMENTS:
            chunks[-1].append(b)
            longest = longest_with
        else:
            chunks.append([b])
            longest = seq_lens[b]
    return chunks


class ReferenceAttention(AttentionBackend):
    """Paged causal attention in plain torch (GQA, chunked prefill and decode mixed in one step).

    Query tokens not covered by `meta.query_start_loc` (padding at the end of the step) get zeros.
    Nothing to plan and no CUDA graphs (its host loops read the step's lists).
    """

    name = "reference"

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal paged attention (the `AttentionBackend.forward` contract), for a query of any
        float dtype: the host lists `query_start_loc_cpu` and `seq_lens_cpu` drive the loop,
        `block_tables` is indexed on the cache's device.

        Raises:
            ValueError: for inconsistent shapes or metadata (q_len > seq_len, block size mismatch).
        """
        _check_shapes(query, kv_cache, meta)
        if out is None:
            out = torch.zeros_like(query)
        else:
            out.zero_()
        qsl = meta.query_start_loc_cpu
        decode = [b for b in range(meta.num_seqs) if qsl[b + 1] - qsl[b] == 1]
        kv_scales = (k_scale, v_scale)
        row_elements = kv_cache.shape[3] * kv_cache.shape[4]
        for seqs in _decode_chunks(meta.seq_lens_cpu, decode, row_elements):
            self._decode(query, kv_cache, meta, scale, seqs, out, kv_scales)
        for b in range(meta.num_seqs):
            if qsl[b + 1] - qsl[b] > 1:
                self._prefill(query, kv_cache, meta, scale, b, out, kv_scales)
        return out

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """softmax(q k^T * scale, masked) v: q [..., Lq, D], k and v [..., L, D], mask bool
        broadcastable to [..., Lq, L] (True: attend) or None; torch's SDPA in the inputs' dtype."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        seqs: list[int],
        out: torch.Tensor,
        kv_scales: tuple[float, float],
    ) -> None:
        """q_len == 1 sequences `seqs`, together: one padded gather, masked past each length
        (no mask when the lengths are equal), and one SDPA call whose query length is the GQA
        group (query [B, H_kv, G, D] against K, V [B, H_kv, L, D])."""
        num_heads, head_dim, num_kv_heads, group = _geometry(query, kv_cache)
        cdt, device = _compute_dtype(query.dtype), query.device
        lens_cpu = [meta.seq_lens_cpu[b] for b in seqs]
        lens = torch.tensor(lens_cpu, device=device)
        max_len = max(lens_cpu)
        rows = torch.tensor(seqs, device=meta.block_tables.device)
        tables = meta.block_tables[rows].to(device=device, dtype=torch.int64)  # [B, max_blocks]
        k, v = _gather_kv(kv_cache, tables, lens, max_len, cdt, *kv_scales)  # [B, L, H_kv, D]
        tokens = torch.tensor([meta.query_start_loc_cpu[b] for b in seqs], device=device)
        q = query[tokens].to(cdt).view(len(seqs), num_kv_heads, group, head_dim)
        mask = None  # [B, 1, 1, L]: keep the positions before each length
        if min(lens_cpu) < max_len:
            mask = (torch.arange(max_len, device=device) < lens[:, None])[:, None, None, :]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, L, D] views
        o = self._attend(q, k, v, mask, scale)  # [B, H_kv, G, D]
        out[tokens] = o.reshape(len(seqs), num_heads, head_dim).to(out.dtype)

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        b: int,
        out: torch.Tensor,
        kv_scales: tuple[float, float],
    ) -> None:
        """One q_len > 1 sequence through SDPA; GQA folds the group into the query length."""
        num_heads, head_dim, num_kv_heads, group = _geometry(query, kv_cache)
        cdt, device = _compute_dtype(query.dtype), query.device
        start, end = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        q_len, seq_len = end - start, meta.seq_lens_cpu[b]
        table = meta.block_tables[b : b + 1].to(device=device, dtype=torch.int64)
        lens = torch.tensor([seq_len], device=device)
        k, v = _gather_kv(kv_cache, table, lens, seq_len, cdt, *kv_scales)  # [1, L, H_kv, D]
        k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [H_kv, L, D]
        # [q_len, H_kv * G, D] -> [H_kv, G * q_len, D]: row g * q_len + i is query i of head (h, g).
        q = query[start:end].to(cdt).view(q_len, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]  # [q_len, L]
        # 4-D inputs: on CPU, SDPA takes its flash kernel only for 4-D (3-D takes the math path).
        mask = mask.repeat(group, 1)
        o = self._attend(q[None], k[None], v[None], mask, scale)
        o = o[0].view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start:end] = o.reshape(q_len, num_heads, head_dim).to(out.dtype)


E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value
XQA_TILE_TOKENS = 64  # KV tokens per tile of XQA's sm90 kernel (gemm0CtaTileNbTokens)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to the nearest float8 e4m3fn value (ties to even, subnormals kept), saturated
    at +-448 as CUDA's `__NV_SATFINITE` conversion does; returned in x's dtype."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_KV_DTYPE).to(x.dtype)


def xqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    e4m3: bool = True,
) -> torch.Tensor:
    """Attention with the rounding of FlashInfer's XQA decode kernel over an e4m3 cache on
    sm_90 (FlashInfer 0.6.18, `csrc/xqa/mha_sm90.cu`, single-block mode), in float32:

    1. the query is converted to e4m3 as it is (bf16 -> e4m3, saturating; no scale: the
       wrapper's q_scale = bmm1_scale / bmm2_scale * sqrt(D) and the kernel multiplies
       q_scale * kv_scale / sqrt(D) = softmax scale * k_scale into the fp32 scores instead);
    2. scores S = q8 . K in fp32 (e4m3 products are exact; GMMA accumulates in fp32), times
       the scale; masked positions -inf;
    3. online softmax over 64-token tiles from position 0: tile t's weights are
       P = exp(S - M_t) with M_t the running maximum through tile t (<= 1), and the row sum
       adds these unrounded fp32 P;
    4. P * 448 is rounded to e4m3 (1 maps to the format's largest value) for P . V, whose
       fp32 accumulator is rescaled by exp(M_t - M_t') as the maximum grows; the output is
       that accumulator / 448 / the row sum (times v_scale).

    K and V come dequantized (stored e4m3 value x k_scale / v_scale): the kernel multiplies
    the scales into its fp32 results instead, which differs by fp32 rounding only. Not
    modelled: multi-block mode (long sequences at small batch, where each CTA's running
    maximum starts over on every nbSubSeq-th tile) and any accumulator precision below fp32.

    Args:
        q: [..., Lq, D]; k, v: [..., L, D]; mask: bool broadcastable to [..., Lq, L] (True:
            attend; every row keeps position 0) or None; scale: softmax scale.
        e4m3: False computes the same tiled fp32 softmax without rounding (a check of it).
    Returns:
        float32 [..., Lq, D].
    """
    f32 = torch.float32
    q8 = round_e4m3(q.to(f32)) if e4m3 else q.to(f32)
    scores = (q8 @ k.to(f32).transpose(-1, -2)) * scale  # [..., Lq, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    num_kv = scores.shape[-1]
    scores = F.pad(scores, (0, -num_kv % XQA_TILE_TOKENS), value=float("-inf"))
    tiles = scores.unflatten(-1, (-1, XQA_TILE_TOKENS))  # [..., Lq, T, 64]
    running = tiles.amax(-1).cummax(-1).values  # [..., Lq, T]: M_t (finite: tile 0 is kept)
    p = torch.exp(tiles - running[..., None])  # each tile against its running maximum
    rescale = torch.exp(running - running[..., -1:])[..., None]  # M_t -> the final maximum
    row_sum = (p * rescale).sum((-2, -1))[..., None]  # [..., Lq, 1], unrounded P
    if e4m3:
        p = round_e4m3(p * E4M3_MAX) / E4M3_MAX
    weights = (p * rescale).flatten(-2)[..., :num_kv]  # [..., Lq, L]
    return (weights @ v.to(f32)) / row_sum


class XqaEmulatedAttention(ReferenceAttention):
    """`ReferenceAttention` with `xqa_attention`'s math in place of SDPA for every query row:
    how an FP8 cache's attention computes where decode-only steps run FlashInfer's XQA kernel
    (the default on sm_90/100/120, or PHLOEM_FP8_DECODE_KERNEL=xqa) (prefill and mixed steps keep 16-bit math on the GPU;
    teacher-forced, each row here is one such decode). Opt-in, for quality measurements
    (`benchmarks/fp8_quality.py --xqa`); never picked by `get_attention_backend`.

    Raises (forward):
        ValueError: for a cache that is not FP8 (XQA's bf16-cache kernel does 16-bit math).
    """

    name = "reference-xqa"

    def forward(self, query, kv_cache, meta, scale, out=None, k_scale=1.0, v_scale=1.0):
        if kv_cache.dtype != FP8_KV_DTYPE:
            raise ValueError(f"XqaEmulatedAttention models an FP8 cache, got {kv_cache.dtype}")
        return super().forward(query, kv_cache, meta, scale, out, k_scale, v_scale)

    @staticmethod
    def _attend(q, k, v, mask, scale):
        return xqa_attention(q, k, v, mask, scale)


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The simplest correct paged attention (test oracle): per sequence, gather K/V slot by slot,
    repeat KV heads for GQA, full score matrix, causal-offset mask, softmax, weighted sum.

    Args:
        query: [T, num_heads, head_dim]; kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim];
        meta: the step's metadata; scale: softmax scale; compute_dtype: dtype of all arithmetic;
        k_scale, v_scale: multipliers of the stored K and V (any cache dtype; 1.0 reads as is).
    Returns:
        [T, num_heads, head_dim] in `compute_dtype`; tokens outside `query_start_loc` are zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2:4]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=compute_dtype, device=query.device)
    for b in range(meta.num_seqs):
        start, end = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        q_len, seq_len = end - start, meta.seq_lens_cpu[b]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=kv_cache.device)
        block_ids = meta.block_tables[b].to(kv_cache.device, torch.int64)[pos // block_size]
        k = kv_cache[block_ids, 0, pos % block_size].to(compute_dtype) * k_scale  # [L, H_kv, D]
        v = kv_cache[block_ids, 1, pos % block_size].to(compute_dtype) * v_scale
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].to(compute_dtype)  # [q_len, H, D]
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale
        q_pos = seq_len - q_len + torch.arange(q_len, device=kv_cache.device)
        future = pos[None, :] > q_pos[:, None]  # [q_len, L]
        scores = scores.masked_fill(future[None], float("-inf"))
        out[start:end] = torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v)
    return out
