"""The shared-prefix tile planner on its own, without Triton: every (query row, KV position) a
causal attention needs is covered by exactly one tile, through the right block ids, and nothing
else; splits, graph caps and exclusions lay out as documented."""

from __future__ import annotations

import random
import sys
from collections import Counter

import numpy as np
import pytest
import torch

from phloem.ops.attention import tile_plan
from phloem.ops.attention.prefix_groups import build_shared_prefix_metadata
from tests.ops.test_shared_prefix import make_shared_step, random_members

CPU = torch.device("cpu")


def coverage(host: tile_plan.HostPlan, meta, sp, gqa: int, narrow_block_m: int | None):
    """(token, head-in-group) -> Counter of (absolute KV position, block id, slot) the tiles give
    it, simulating the kernel's row and KV walk (tile table layout in tile_plan.py)."""
    bs = meta.block_size
    cov: dict[tuple[int, int], Counter] = {}
    for table, tile_m in ((host.wide, host.block_m), (host.narrow, narrow_block_m)):
        for tok_off, row0, n_rows, blk_off, kv_b, kv_e, pos0, slot in table.tolist():
            for row in range(row0, min(row0 + tile_m, n_rows)):
                token = int(host.tokens[tok_off + row // gqa])
                for j in range(kv_b, kv_e):
                    if pos0 + j > host.qpos[token]:
                        continue  # causal: masked in the kernel
                    block = int(host.blocks[blk_off + j // bs])
                    cov.setdefault((token, row % gqa), Counter())[(pos0 + j, block, slot)] += 1
    return cov


def check_plan(host: tile_plan.HostPlan, meta, sp, gqa: int, narrow_block_m, exclude=None):
    """Every query token of every non-excluded sequence sees each KV position 0..its own once,
    read from its block table's block; grouped tokens write partials (prefix slots below the
    suffix slot), the others their output."""
    cov = coverage(host, meta, sp, gqa, narrow_block_m)
    qsl, bs = meta.query_start_loc_cpu, meta.block_size
    seen = set()
    for b in range(meta.num_seqs):
        if exclude is not None and exclude[b]:
            assert not any(qsl[b] <= t < qsl[b + 1] for t, _ in cov)
            continue
        q_len, seq_len = qsl[b + 1] - qsl[b], meta.seq_lens_cpu[b]
        table = meta.block_tables_cpu[b]
        grouped = sp.seq_group[b] >= 0
        for i in range(q_len):
            token, pos = qsl[b] + i, seq_len - q_len + i
            assert host.qpos[token] == pos
            for g in range(gqa):
                got = cov.get((token, g), Counter())
                assert all(n == 1 for n in got.values()), (b, i, g)
                assert sorted(p for p, _, _ in got) == list(range(pos + 1)), (b, i, g)
                for p, block, slot in got:
                    assert block == table[p // bs]
                    own = p >= sp.seq_prefix_lens[b]
                    want = (host.num_slots - 1 if own else slot) if grouped else -1
                    assert slot == want and (own or slot < host.num_slots - 1)
                seen.add((token, g))
    assert seen == set(cov)  # no tile covers a padding token
    assert host.num_grouped == sum(e - s for r in sp.group_query_ranges for s, e in r)


GQAS = [1, 2, 4]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gqa", GQAS)
def test_random_steps_are_covered_exactly_once(seed, gqa):
    rng = random.Random(seed)
    groups = [(rng.choice([16, 48, 96]), random_members(rng, rng.randint(1, 6), 40))
              for _ in range(rng.randint(1, 3))]  # fmt: skip
    singles = [(1, rng.randint(1, 50)), (rng.randint(2, 9), rng.randint(9, 60))]
    _, _, meta, prefix_lens = make_shared_step(
        groups, singles, 2 * gqa, 2, 8, torch.float32, seed, leaders=[(0, 3, groups[0][0] + 1)]
    )
    sp = build_shared_prefix_metadata(meta, prefix_lens, min_group_size=1)
    for block_m, narrow, splits in [(None, None, None), (16, 16, 2), (32, 16, 3), (64, None, 1)]:
        host = tile_plan.plan_tiles(meta, sp, 2, gqa, CPU, block_m, 16, splits, 1024, narrow)
        check_plan(host, meta, sp, gqa, narrow)
        if narrow is None:
            assert len(host.narrow) == 0


def test_splits_lay_out_the_prefix_in_kv_chunks():
    groups = [(64, [(1, 1), (1, 5)])]
    _, _, meta, prefix_lens = make_shared_step(groups, [(1, 7)], 2, 1, 8, torch.float32, 0)
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    host = tile_plan.plan_tiles(meta, sp, 1, 2, CPU, 16, 16, 2, 1024, 16)
    prefix = host.wide[host.wide[:, 7] >= 0]
    assert sorted(map(tuple, prefix[:, [4, 5, 7]].tolist())) == [(0, 32, 0), (32, 64, 1)]
    assert host.num_slots == 3 and host.num_grouped == 2
    assert list(host.tokens[:2]) == sp.group_token_indices(0)  # grouped tokens first
    check_plan(host, meta, sp, 2, 16)


def test_graph_caps_fix_the_suffix_slot_and_bound_prefix_tiles():
    groups = [(128, [(1, 1), (1, 3), (1, 9)])]
    _, _, meta, prefix_lens = make_shared_step(groups, [(1, 4)], 4, 2, 8, torch.float32, 1)
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    capped = tile_plan.plan_tiles(meta, sp, 2, 2, CPU, 64, 16, 8, 1024, 16, max_splits=4)
    assert capped.num_slots == 5 and int(capped.wide[:, 7].max()) == 3  # 8 splits -> 4
    check_plan(capped, meta, sp, 2, 16)
    bounded = tile_plan.plan_tiles(meta, sp, 2, 2, CPU, 64, 16, 8, 1024, 16, max_splits=4,
                                   max_prefix_tiles=3)  # fmt: skip
    assert len(bounded.wide) == 1 and bounded.num_slots == 5  # one split, suffix slot still 4
    check_plan(bounded, meta, sp, 2, 16)


def test_exclude_drops_lone_sequences_only():
    groups = [(32, [(1, 1), (1, 3)])]
    _, _, meta, prefix_lens = make_shared_step(groups, [(8, 8), (1, 5)], 2, 1, 8,
                                               torch.float32, 2)  # fmt: skip
    sp = build_shared_prefix_metadata(meta, prefix_lens)
    lone = [b for b in range(meta.num_seqs) if sp.seq_group[b] < 0]
    exclude = np.zeros(meta.num_seqs, dtype=bool)
    exclude[lone[0]] = True
    host = tile_plan.plan_tiles(meta, sp, 1, 2, CPU, 16, 16, None, 1024, 16, exclude=exclude)
    check_plan(host, meta, sp, 2, 16, exclude=exclude)
    exclude[sp.group_seq_ids[0][0]] = True
    with pytest.raises(ValueError, match="without a group"):
        tile_plan.plan_tiles(meta, sp, 1, 2, CPU, 16, 16, None, 1024, 16, exclude=exclude)


def test_split_counts_follow_the_fair_share(monkeypatch):
    """Few long prefixes on a 132-SM GPU split; many groups, or tiny prefixes, do not; the
    partial-state budget caps the splits."""
    monkeypatch.setattr(tile_plan, "num_sms", lambda device: 132)

    def splits(num_groups, prefix_len, degree=16, partial_bytes=32 * 129 * 4):
        groups = [(prefix_len, [(1, 201)] * degree) for _ in range(num_groups)]
        _, _, meta, prefix_lens = make_shared_step(groups, [], 4, 1, 4, torch.float32, 0, num_pad=0)
        sp = build_shared_prefix_metadata(meta, prefix_lens)
        rows = np.array([degree * 4] * num_groups)
        return tile_plan.split_counts(sp, rows, sum(sp.suffix_lens), 8, num_groups * degree, 64,
                                      partial_bytes, CPU, None)  # fmt: skip

    assert splits(4, 8192) == [5] * 4
    assert splits(64, 8192, degree=4) == [1] * 64
    assert splits(2, 256) == [1, 1]
    assert splits(4, 8192, partial_bytes=tile_plan.MAX_PARTIAL_BYTES // 64 // 3) == [2] * 4


def test_the_planner_imports_no_triton():
    """tile_plan (and what it imports) loads with Triton blocked."""
    import subprocess

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import phloem.ops.attention.tile_plan, phloem.ops.attention.shared_prefix\n"
        "assert 'triton' not in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
