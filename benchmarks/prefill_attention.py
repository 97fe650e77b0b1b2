"""Attention of the prefill chunks of a BatchLLM mixed step: our Triton kernel vs FlashInfer.

A mixed step of the `batchllm` workload carries, next to the decode tokens, prefill chunks of
two kinds: L group leaders computing a fresh P-token prefix (q_len = P, causal over themselves)
and M members computing their S own prompt tokens after the group's P shared tokens (q_len = S,
KV = P + S). This times one layer's attention over just those chunks for:

  triton      our shared-prefix kernel (`shared_prefix_attention`; no groups: chunks longer than
              16 tokens stay out of groups, so every chunk is one causal tile row range)
  fa2 / fa3   FlashInfer's paged batch prefill planned for these chunks alone ("fa3": Hopper,
              JIT-built on first use; skipped with the reason when it does not build)

Each path is checked against the first one listed (max |diff| <= --atol). Prints and writes ms per layer and
achieved TFLOP/s (causal attention FLOPs: 4 * H * D * sum over queries of the keys they see).

    python benchmarks/prefill_attention.py OUT_DIR --leaders 3 --members 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import traceback

import torch

from phloem.ops.attention import AttentionMetadata
from phloem.ops.attention.prefix_groups import build_shared_prefix_metadata


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--leaders", type=int, default=3, help="L: chunks computing a P-token prefix")
    p.add_argument("--members", type=int, default=30, help="M: S-token chunks after a prefix")
    p.add_argument("--prefix-len", type=int, default=2000, help="P")
    p.add_argument("--suffix-len", type=int, default=200, help="S")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--paths", default="triton,fa2,fa3")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--atol", type=float, default=2e-2)
    return p.parse_args(argv)


def make_step(args):
    """(query, kv_cache, meta, flops) of the prefill chunks; random non-contiguous blocks."""
    bs, P, S = args.block_size, args.prefix_len, args.suffix_len
    q_lens = [P] * args.leaders + [S] * args.members
    seq_lens = [P] * args.leaders + [P + S] * args.members
    n_blocks = [-(-n // bs) for n in seq_lens]
    ids = list(range(sum(n_blocks)))
    random.Random(0).shuffle(ids)
    tables = [[ids.pop() for _ in range(n)] for n in n_blocks]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (len(ids) + sum(n_blocks), 2, bs, args.num_kv_heads, args.head_dim)
    kv = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(qsl[-1], args.num_heads, args.head_dim, generator=gen, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    width = max(n_blocks)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
        block_size=bs, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_tables_cpu=tables,
    )  # fmt: skip
    keys = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(q_lens, seq_lens))
    return q.to(torch.bfloat16), kv, meta, 4 * args.num_heads * args.head_dim * keys


def timed(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    q, kv, meta, flops = make_step(args)
    scale = args.head_dim**-0.5
    geometry = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                    head_dim=args.head_dim, dtype=torch.bfloat16, device="cuda", scale=scale)  # fmt: skip
    results, base = {}, None
    for path in args.paths.split(","):
        res: dict = {}
        try:
            t0 = time.perf_counter()
            if path == "triton":
                from phloem.ops.attention.shared_prefix_triton import shared_prefix_attention

                sp = build_shared_prefix_metadata(meta, [0] * meta.num_seqs)
                fn = lambda sp=sp: shared_prefix_attention(q, kv, meta, sp, scale)  # noqa: E731
            else:
                from phloem.ops.attention.flashinfer_backend import FlashInferAttention

                fi = FlashInferAttention(**geometry, kernel_backend=path)
                fi.begin_step(meta)
                fn = lambda fi=fi: fi.forward(q, kv, meta, scale)  # noqa: E731
            out = fn()
            torch.cuda.synchronize()
            res["first_call_s"] = time.perf_counter() - t0
            if base is None:
                base = out
            res["max_abs_diff"] = (out.float() - base.float()).abs().max().item()
            res["ok"] = res["max_abs_diff"] <= args.atol
            if res["ok"]:
                res["ms"] = timed(fn, args.iters)
                res["tflops"] = flops / res["ms"] / 1e9
        except Exception as e:  # a path that does not build is reported, not fatal
            traceback.print_exc()
            res = {"ok": None, "skipped": f"{type(e).__name__}: {str(e)[:300]}"}
        results[path] = res
        print(path, res, flush=True)
    record = {"config": {k: v for k, v in vars(args).items()}, "flops": flops,
              "device": torch.cuda.get_device_name(), "results": results}  # fmt: skip
    with open(os.path.join(args.out_dir, "prefill_attention.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
