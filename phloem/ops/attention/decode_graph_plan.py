"""Shared-prefix decode steps in CUDA graphs: fixed-capacity tile tables for our Triton kernels.

A captured graph replays its launches with the grids and buffer addresses of the capture, so a
decode step's tile tables (`tile_plan.plan_tiles`) are written into buffers of fixed capacity
before each replay, and every launch reads its tile count from the device.
"""

from __future__ import annotations

import numpy as np
import torch

from phloem.ops.attention import tile_plan
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.prefix_groups import SharedPrefixMetadata
from phloem.ops.attention.shared_prefix_triton import launch_plan
from phloem.ops.attention.tile_plan import DevicePlan, Launch, cdiv, plan_tiles
from phloem.ops.staging import pinned


class DecodeGraphPlan:
    """Fixed-address tile tables and partial states for shared-prefix decode steps replayed
    from CUDA graphs (one instance serves every captured batch size).

    A graph captured for a batch of B decode sequences (q_len 1, padded with dummy sequences)
    launches per layer, with grids fixed at capture:
      * the wide launch over the prefix-tile table of B rows: a step's prefix tiles (at most B:
        with one KV split a group of m members has ceil(m * GQA / BLOCK_M) <= m row tiles). By
        default it is persistent: min(B, `wide_programs`) programs per KV head stride over the
        step's tiles, their number read from the device; otherwise one program per row, the
        rows past the step's tiles zero, i.e. no-op tiles (n_rows = 0 and an empty KV range).
        The no-op programs are not free: the wide tiles' registers and shared memory leave room
        for 2 programs per SM, so at B = 1,024 with 64 prefix tiles ~960 empty programs per KV
        head queue behind and between the real ones;
      * the narrow launch over B rows, one suffix tile per sequence (a decode token's GQA rows
        fit one narrow tile);
      * the merge over B programs, of which the first `count[0]` (the grouped tokens) work.
    Prefix splits are capped at `max_splits` and the suffix partial always goes to slot
    `max_splits`, so the merge reduces a fixed number of slots; `prepare` resets their LSE to
    -inf each step (a slot no tile of this step writes must not keep an older step's LSE).

    `prepare(meta, sp)` plans a step on the host and uploads every table in one pinned copy into
    one int32 buffer laid out as [wide | narrow | tokens | qpos | counts | blocks], each region
    sized for `max_batch` (counts: the grouped tokens the merge reduces, the wide tiles); graphs
    of smaller batches read prefixes of the regions.

    Args:
        max_batch: the largest captured batch B.
        num_heads, num_kv_heads, head_dim: attention geometry (GQA = num_heads / num_kv_heads
            must be <= narrow_block_m).
        device: the CUDA device (or CPU under the Triton interpreter, for tests).
        max_blocks: capacity of the block-id region (prefix blocks + own blocks of a step);
            `fits(sp)` tells whether a step fits.
        block_m, narrow_block_m, block_n, max_splits, num_warps, num_stages: kernel options as in
            `shared_prefix_attention`.
        wide_programs: programs per KV head of the persistent wide launch (default: enough for
            two per SM over all KV heads, the residency of the wide tiles); None with
            `persistent_wide=False`, one program per table row.
    Memory: (max_splits + 1) * max_batch * num_heads * (head_dim + 1) * 4 bytes of float32
        partial states (168 MiB for B = 2048, 32 heads of 128, 4 splits) plus the tables.
    Raises:
        ValueError: if GQA > narrow_block_m.
    """

    def __init__(
        self,
        max_batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        max_blocks: int,
        block_m: int = 64,
        narrow_block_m: int = 16,
        block_n: int | None = None,
        max_splits: int = 4,
        num_warps: int = 4,
        num_stages: int = 3,
        persistent_wide: bool = True,
        wide_programs: int | None = None,
    ) -> None:
        gqa = num_heads // num_kv_heads
        if gqa > narrow_block_m:
            raise ValueError(f"GQA ratio {gqa} exceeds narrow_block_m {narrow_block_m}")
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        self.block_m, self.narrow_block_m, self.max_splits = block_m, narrow_block_m, max_splits
        self.block_n = block_n or (64 if head_dim <= 128 else 32)
        self.num_warps, self.num_stages = num_warps, num_stages
        if persistent_wide and wide_programs is None:
            wide_programs = cdiv(2 * tile_plan.num_sms(self.device), num_kv_heads)
        self.wide_programs = wide_programs if persistent_wide else None
        m = max_batch
        # region offsets in the int32 buffer
        self._off = dict(wide=0, narrow=8 * m, tokens=16 * m, qpos=17 * m, count=18 * m)
        self._off["wide_count"] = 18 * m + 1
        self._off["blocks"] = 18 * m + 2
        self._buf = torch.zeros(self._off["blocks"] + max_blocks, dtype=torch.int32, device=device)
        f32, lead = torch.float32, (max_splits + 1, m, num_heads)
        self.opart = torch.zeros(*lead, head_dim, dtype=f32, device=device)
        self.lpart = torch.full(lead, float("-inf"), dtype=f32, device=device)
        self._plans: dict[int, DevicePlan] = {}

    def fits(self, sp: SharedPrefixMetadata) -> bool:
        """Whether a step's block ids fit the buffer (else run it eagerly), with room for the
        padding sequences of its bucket (fewer than 16, one block each)."""
        used = sum(map(len, sp.group_block_ids)) + sum(map(len, sp.suffix_block_ids))
        return used + 16 <= self.max_blocks

    def _view(self, name: str, length: int) -> torch.Tensor:
        start = self._off[name]
        return self._buf[start : start + length]

    def plan_for(self, batch: int) -> DevicePlan:
        """The launch description a graph of `batch` sequences captures (views of the buffers)."""
        plan = self._plans.get(batch)
        if plan is None:
            programs = None if self.wide_programs is None else min(batch, self.wide_programs)
            wide = Launch(self._view("wide", 8 * batch).view(batch, 8), self.block_m, False,
                           programs, self._view("wide_count", 1))  # fmt: skip
            narrow = Launch(self._view("narrow", 8 * batch).view(batch, 8), self.narrow_block_m,
                             True)  # fmt: skip
            plan = DevicePlan(
                [wide, narrow],
                self._view("tokens", batch),
                self._buf[self._off["blocks"] :],
                self._view("qpos", batch),
                self._view("count", 1),
                batch,
                self.max_splits + 1,
                self.block_n,
                self.opart,
                self.lpart,
                merge_grid=batch,
            )  # fmt: skip
            self._plans[batch] = plan
        return plan

    def prepare(self, attn_meta: AttentionMetadata, sp: SharedPrefixMetadata) -> None:
        """Plan a decode step of B = attn_meta.num_seqs sequences (q_len 1 each, real ones and
        padding) into the buffers, before the replay of the graph of batch B.

        Raises:
            ValueError: if B > max_batch, a sequence has q_len != 1, or the blocks do not fit.
        """
        batch = attn_meta.num_seqs
        if batch > self.max_batch or attn_meta.query_start_loc_cpu[-1] != batch:
            raise ValueError(f"a graph step needs <= {self.max_batch} decode sequences (q_len 1)")
        host = plan_tiles(
            attn_meta, sp, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.device,
            self.block_m, self.block_n, None, self.num_heads * (self.head_dim + 1) * 4,
            self.narrow_block_m, max_splits=self.max_splits, max_prefix_tiles=batch,
        )  # fmt: skip
        if len(host.narrow) != batch or len(host.wide) > batch:
            raise ValueError("not a decode step: tiles do not match the graph's grid")
        if len(host.blocks) > self.max_blocks:
            raise ValueError(f"the step's block ids exceed the graph buffer ({self.max_blocks})")
        off = self._off
        data = np.zeros(off["blocks"] + len(host.blocks), dtype=np.int32)
        data[off["wide"] : off["wide"] + host.wide.size] = host.wide.ravel()
        data[off["narrow"] : off["narrow"] + host.narrow.size] = host.narrow.ravel()
        data[off["tokens"] : off["tokens"] + batch] = host.tokens
        data[off["qpos"] : off["qpos"] + batch] = host.qpos
        data[off["count"]] = host.num_grouped
        data[off["wide_count"]] = len(host.wide)
        data[off["blocks"] :] = host.blocks
        self._buf[: len(data)].copy_(pinned(data), non_blocking=True)
        self.lpart[:, :batch].fill_(float("-inf"))

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        block_size: int,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """The planned step's attention, [B, H, D] in query.dtype (capturable: no host work
        depends on the step; an FP8 cache's k_scale / v_scale are constants of the capture)."""
        out = torch.empty_like(query)
        launch_plan(self.plan_for(query.shape[0]), query, kv_cache, out, scale, block_size,
                self.num_warps, self.num_stages, None, k_scale=k_scale,
                v_scale=v_scale)  # fmt: skip
        return out
