"""Small-batch decode attention: our one-launch split-KV kernel against FlashInfer's decode path,
per layer, in CUDA graphs (issues 19, 24).

At batch 1-16 and a few hundred KV tokens a decode step's attention is launch and fixed latency:
FlashInfer's q_len-1 attention plus its split-KV merge took 9.5 + 2.4 us a layer of Llama-3.1-8B
on an H200 (benchmarks/results/2026-11-26d-h200-serving). This times, for each batch x KV length
x geometry (Llama-3.1-8B's 32 query / 8 KV heads of 128, and its TP = 2 shard, 16 / 4):

  flashinfer      phloem's FlashInfer backend as its decode graphs run it (`prepare_replay`:
                  fa2 prefill kernel at q_len 1 in a CUDA-graph wrapper, plus its merge)
  small/bn{N}/w{W}  `small_decode.SmallDecodeAttention` (the kernel of `small_decode_triton.py`,
                  BLOCK_N = N, W warps; the grid's S_max by `max_splits`, each sequence using
                  `splits_used`: one split per DEFAULT_SPLIT_TOKENS tokens), planned the same way
  .../s{S}        the grid's S_max fixed at S at every batch (--splits S)
  .../t{T}        T target tokens a split instead of the default (--split-tokens T; 1: every
                  sequence uses min(S_max, tiles) splits)
  .../pf          the register-pipelined inner loop (`prefetch=True`; --prefetch 0 1)
  .../old         the rule before 2026-11-27e (one wave: S_max = floor(SMs / (B x H_kv)), every
                  sequence using all its tiles' worth of them: split tokens 1), the baseline

Each runs --layers forward calls (one KV cache per layer, the same block table: the engine's
layout; pages shuffled) captured in one CUDA graph, timed over --iters replays; us/layer = mean
replay / layers. Errors: each output's max |diff| from FlashInfer's, and from float64 attention
(`paged_attention_reference`) on the first layer. Before timing, `checks` runs the kernel on
ragged steps (lengths 1, off the block size, up to 4,095; batch 1, 3, 16; launches in a row on
one workspace; an FP8 cache with scales), and one captured decode graph replayed on other steps
(`graph_checks`), against float64, and records pass / fail.

--kv-dtype bf16 fp8 times every case once per cache dtype (issue 18). An FP8 case's caches are
the bf16 ones rounded to e4m3, read with the per-tensor scales --fp8-scales (k_scale, v_scale;
default 0.5, 2.0, as `checks`); FlashInfer is built as the engine builds it for
`--kv-cache-dtype fp8` (`kv_dtype=torch.float8_e4m3fn`: XQA on sm_90/100/120 by default, its fa2
prefill kernel over e4m3 pages elsewhere or under PHLOEM_FP8_DECODE_KERNEL=prefill) and both kernels get
the scales in `forward`, as `layers.attention.Attention` passes them. Each kernel's line and JSON
entry carry the achieved KV read bandwidth: bytes of K and V the step reads (B x L x 2 x H_kv x
D x 2 bytes in bf16, x 1 in FP8) / time a layer, TB/s; an FP8 case's entries also carry their
speedup over the same case's bf16 FlashInfer (`vs_flashinfer_bf16`). `--large` replaces the
batch, KV and geometry lists by the decode-heavy regime: batch 64, 256, 512 x KV 1,024, 2,048,
Llama-3.1-8B's 32 / 8 / 128. Every case runs at most the layers whose caches fit
--kv-budget-gb in bf16 (`layers_that_fit`: 13 at 512 x 2,048, 4 GiB a layer), whatever the
dtype, so the two dtypes of a case replay the same graph length.

    source benchmarks/device_setup.sh && python3 benchmarks/small_decode_attention.py \
        --device cuda --json $OUT/small_decode_attention.json
    source benchmarks/device_setup.sh && python3 benchmarks/small_decode_attention.py \
        --device cuda --large --kv-dtype bf16 fp8 --block-n 32 --num-warps 4 --prefetch 0 1 \
        --no-old --iters 30 --json $OUT/small_decode_fp8.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import traceback

import torch

from phloem.bench.graph_timing import graph_replay_seconds
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.reference import ReferenceAttention, paged_attention_reference
from phloem.ops.attention.small_decode import (
    GRAPH_VARIANT,
    MAX_SPLITS,
    SmallDecodeAttention,
    max_splits,
    splits_used,
    target_programs,
)

KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
LARGE = {"batch": [64, 256, 512], "kv": [1024, 2048], "geometry": ["32,8,128"]}  # --large


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="a CUDA device (the kernels are GPU-only)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--kv", type=int, nargs="+", default=[128, 384, 1024, 4096],
                   help="KV tokens per sequence")  # fmt: skip
    p.add_argument("--geometry", nargs="+", default=["32,8,128", "16,4,128"],
                   help="num_heads,num_kv_heads,head_dim")  # fmt: skip
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    p.add_argument("--splits", type=int, nargs="+", default=[0],
                   help="the grid's S_max to time (0: the rule, `small_decode.max_splits`)")  # fmt: skip
    p.add_argument("--split-tokens", type=int, nargs="+", default=[0, 32, 128],
                   help="target KV tokens a split (0: small_decode.DEFAULT_SPLIT_TOKENS)")  # fmt: skip
    p.add_argument("--prefetch", type=int, nargs="+", default=[0, 1],
                   help="0: the plain inner loop, 1: the register-pipelined one")  # fmt: skip
    p.add_argument("--no-old", action="store_true", help="skip the one-wave baseline")
    p.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--kv-dtype", nargs="+", choices=list(KV_DTYPES), default=["bf16"],
                   help="cache dtypes; each case is timed once per dtype")  # fmt: skip
    p.add_argument("--fp8-scales", type=float, nargs=2, default=[0.5, 2.0],
                   metavar=("K_SCALE", "V_SCALE"), help="an FP8 cache's per-tensor scales")  # fmt: skip
    p.add_argument("--large", action="store_true",
                   help=f"the decode-heavy cases {LARGE} (replace --batch, --kv, --geometry)")  # fmt: skip
    p.add_argument("--kv-budget-gb", type=float, default=60.0,
                   help="cap each case's layers so their caches fit this many GB in bf16")  # fmt: skip
    args = p.parse_args(argv)
    if args.large:
        vars(args).update(LARGE)
    return args


def layers_that_fit(layers: int, batch: int, kv_len: int, geometry, block_size: int,
                    budget_gb: float) -> int:  # fmt: skip
    """`layers`, capped (at least 1) so that many bf16 caches of `batch` sequences of `kv_len`
    tokens (whole pages of `block_size`) fit `budget_gb` GB (1e9 bytes): 60 GB holds 13 layers
    of Llama-3.1-8B's 32 / 8 / 128 at 512 x 2,048 (4 GiB a layer)."""
    _, num_kv_heads, head_dim = geometry
    pages = batch * -(-kv_len // block_size)
    layer_bytes = pages * block_size * 2 * num_kv_heads * head_dim * 2
    return max(1, min(layers, int(budget_gb * 1e9 // layer_bytes)))


def kv_read_bytes(batch: int, kv_len: int, geometry, kv_dtype: torch.dtype) -> int:
    """Bytes of K and V one layer's decode step reads: B x L x 2 x H_kv x D x element size."""
    _, num_kv_heads, head_dim = geometry
    return batch * kv_len * 2 * num_kv_heads * head_dim * kv_dtype.itemsize


def make_step(lens, geometry, block_size, device, seed, layers=1, kv_dtype=torch.bfloat16):
    """(query bf16 [B, H, D], `layers` caches [blocks, 2, bs, H_kv, D], meta with host tables)
    for sequences of KV lengths `lens`, each sequence's pages shuffled over the cache."""
    num_heads, num_kv_heads, head_dim = geometry
    rng = random.Random(seed)
    pages = [-(-n // block_size) for n in lens]
    ids = list(range(sum(pages)))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in pages:
        tables.append(ids[start : start + n])
        start += n
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (sum(pages), 2, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).to(kv_dtype)
              for _ in range(layers)]  # fmt: skip
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen, device=device,
                        dtype=torch.bfloat16)  # fmt: skip
    meta = AttentionMetadata.from_host([1] * len(lens), list(lens), tables, block_size,
                                       device=device, padded_tables=True)  # fmt: skip
    return query, caches, meta


def flashinfer_backend(geometry, batch: int, max_pages: int, device, kv_dtype=torch.bfloat16):
    """phloem's FlashInfer backend as the engine builds it (`worker.Worker`'s factory call:
    bf16 queries, the cache's dtype as `kv_dtype`, NHD pages, the default softmax scale)."""
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention

    num_heads, num_kv_heads, head_dim = geometry
    return FlashInferAttention(num_heads, num_kv_heads, head_dim, torch.bfloat16, device,
                               kv_dtype=kv_dtype, max_num_blocks_per_seq=max_pages,
                               max_num_seqs=batch)  # fmt: skip


def small_backend(geometry, batch, max_pages, device, args, block_n, splits=0, warps=None,
                  tokens=0, prefetch=0):  # fmt: skip
    """Our backend over a reference fallback (unused: every step here is a small decode);
    `splits` 0: the rule's S_max; `warps` None: the first --num-warps; `tokens` 0: the
    default target tokens a split; `prefetch` 1: the register-pipelined inner loop."""
    num_heads, num_kv_heads, head_dim = geometry
    return SmallDecodeAttention(
        ReferenceAttention(), num_heads, num_kv_heads, head_dim, device, max_batch=batch,
        max_num_blocks_per_seq=max_pages, impl="triton", splits=splits or None,
        split_tokens=tokens or None, block_n=block_n, num_warps=warps or args.num_warps[0],
        num_stages=args.num_stages, prefetch=bool(prefetch),
    )  # fmt: skip


def old_splits(batch: int, num_kv_heads: int, device) -> int:
    """The one-wave rule before 2026-11-27e: floor(SMs / (B x H_kv)) in [1, MAX_SPLITS]."""
    return max(1, min(MAX_SPLITS, target_programs(device) // (batch * num_kv_heads)))


def kernel_runs(args, geometry, batch, max_pages, device) -> list:
    """(name, backend factory) of each of our variants of a case (the module docstring)."""
    runs = []
    for bn, s, t, w, pf in itertools.product(args.block_n, args.splits, args.split_tokens,
                                             args.num_warps, args.prefetch):  # fmt: skip
        name = (f"small/bn{bn}/w{w}" + (f"/s{s}" if s else "") + (f"/t{t}" if t else "")
                + ("/pf" if pf else ""))  # fmt: skip
        runs.append((name, lambda bn=bn, s=s, t=t, w=w, pf=pf: small_backend(
            geometry, batch, max_pages, device, args, bn, s, w, t, pf)))  # fmt: skip
        if not args.no_old and s == 0 and t == 0 and pf == 0:
            old = old_splits(batch, geometry[1], device)
            runs.append((name + "/old", lambda bn=bn, w=w, old=old: small_backend(
                geometry, batch, max_pages, device, args, bn, old, w, 1)))  # fmt: skip
    return runs


def plan_replay(backend, meta: AttentionMetadata) -> None:
    """Plan a decode graph's step the way the engine does: the "small_decode" variant for ours
    (its "plain" graphs are the fallback's), the plain one for FlashInfer's."""
    if isinstance(backend, SmallDecodeAttention):
        backend.prepare_replay(meta, GRAPH_VARIANT)
    else:
        backend.prepare_replay(meta)


def split_counts(backend, batch: int, kv_len: int) -> dict:
    """Ours: the grid's S_max and the splits a sequence of kv_len tokens uses; FlashInfer: 0."""
    if not isinstance(backend, SmallDecodeAttention):
        return {"s_max": 0, "splits_used": 0}
    s_max = backend.plan.splits(batch)
    used = splits_used(kv_len, s_max, backend.plan.split_tokens,
                       backend.kernel_options["block_n"])  # fmt: skip
    return {"s_max": s_max, "splits_used": used}


def time_layers(backend, query, caches, meta, iters: int, k_scale: float = 1.0,
                v_scale: float = 1.0) -> tuple[float, torch.Tensor]:  # fmt: skip
    """Mean seconds a layer (one graph replay of every cache's forward, / layers) and the first
    layer's output; an FP8 cache's scales go to every forward (constants of the capture)."""
    scale = query.shape[-1] ** -0.5
    outs = [torch.empty_like(query) for _ in caches]
    plan_replay(backend, meta)

    def step():
        for kv, out in zip(caches, outs):
            backend.forward(query, kv, meta, scale, out=out, k_scale=k_scale, v_scale=v_scale)

    return graph_replay_seconds(step, iters) / len(caches), outs[0]


def case_step(args, geometry, batch: int, kv_len: int, dtype: str, device):
    """(query, caches, meta, float64 reference of the first layer, (k_scale, v_scale), layers)
    of a case: --layers capped by `layers_that_fit`; an FP8 case's caches are the bf16 ones
    (same seed) rounded to e4m3. The reference gathers each sequence's pages from a bf16 copy
    of the first cache (exact for e4m3), not a float64 copy of it (16 GiB at 512 x 2,048)."""
    layers = layers_that_fit(args.layers, batch, kv_len, geometry, args.block_size,
                             args.kv_budget_gb)  # fmt: skip
    kv_dtype = KV_DTYPES[dtype]
    query, caches, meta = make_step([kv_len] * batch, geometry, args.block_size, device,
                                    seed=batch * 7919 + kv_len, layers=layers,
                                    kv_dtype=kv_dtype)  # fmt: skip
    scales = tuple(args.fp8_scales) if dtype == "fp8" else (1.0, 1.0)
    want = paged_attention_reference(query, caches[0].to(torch.bfloat16), meta,
                                     query.shape[-1] ** -0.5, k_scale=scales[0],
                                     v_scale=scales[1])  # fmt: skip
    return query, caches, meta, want, scales, layers


def run_case(args, geometry, batch: int, kv_len: int, device, dtype: str = "bf16") -> dict:
    """FlashInfer and each variant of ours on one (geometry, batch, KV length, cache dtype)."""
    query, caches, meta, want, scales, layers = case_step(args, geometry, batch, kv_len, dtype,
                                                          device)  # fmt: skip
    kv_dtype = KV_DTYPES[dtype]
    max_pages = -(-kv_len // args.block_size)
    read_bytes = kv_read_bytes(batch, kv_len, geometry, kv_dtype)
    rule = max_splits(batch, geometry[1], target_programs(device))
    case = {"geometry": list(geometry), "batch": batch, "kv": kv_len, "kv_dtype": dtype,
            "k_scale": scales[0], "v_scale": scales[1], "layers": layers,
            "kv_read_bytes_per_layer": read_bytes, "rule_s_max": rule, "kernels": {}}  # fmt: skip
    runs = [("flashinfer", lambda: flashinfer_backend(geometry, batch, max_pages, device,
                                                      kv_dtype))]  # fmt: skip
    runs += kernel_runs(args, geometry, batch, max_pages, device)
    base = backend = None
    for name, make in runs:
        try:
            backend = make()
            seconds, out = time_layers(backend, query, caches, meta, args.iters, *scales)
        except Exception as e:  # noqa: BLE001 - a kernel that fails is reported, not fatal
            case["kernels"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            traceback.print_exc()
            continue
        base = out if base is None else base
        entry = {"us_per_layer": seconds * 1e6, **split_counts(backend, batch, kv_len),
                 "kv_read_tb_s": read_bytes / seconds / 1e12,
                 "max_abs_diff_vs_flashinfer": (out.float() - base.float()).abs().max().item(),
                 "max_abs_err_vs_float64": (out.double() - want).abs().max().item()}  # fmt: skip
        case["kernels"][name] = entry
        print(f"H={geometry[0]:2d}/{geometry[1]} B={batch:3d} KV={kv_len:5d} {dtype:4s} "
              f"L={layers:2d} rule S_max={rule:2d} {name:22s} S={entry['s_max']:2d} "
              f"used={entry['splits_used']:2d} {entry['us_per_layer']:8.2f} us/layer "
              f"{entry['kv_read_tb_s']:5.2f} TB/s  "
              f"diff {entry['max_abs_diff_vs_flashinfer']:.1e} "
              f"err64 {entry['max_abs_err_vs_float64']:.1e}", flush=True)  # fmt: skip
    del query, caches, backend
    torch.cuda.empty_cache()  # the next case's caches (up to --kv-budget-gb) need the room
    return case


def compare_to_bf16(cases: list[dict]) -> None:
    """Give each kernel of a non-bf16 case `vs_flashinfer_bf16`: the same case's (geometry,
    batch, KV) bf16 FlashInfer time / its time (mutates `cases`), and print them."""
    bf16 = {(tuple(c["geometry"]), c["batch"], c["kv"]): c for c in cases
            if c["kv_dtype"] == "bf16"}  # fmt: skip
    for case in cases:
        ref = bf16.get((tuple(case["geometry"]), case["batch"], case["kv"]))
        if case["kv_dtype"] == "bf16" or ref is None:
            continue
        base = ref["kernels"].get("flashinfer", {}).get("us_per_layer")
        for name, entry in case["kernels"].items():
            if base is None or "us_per_layer" not in entry:
                continue
            entry["vs_flashinfer_bf16"] = base / entry["us_per_layer"]
            print(f"H={case['geometry'][0]:2d}/{case['geometry'][1]} B={case['batch']:3d} "
                  f"KV={case['kv']:5d} {case['kv_dtype']} {name:22s} "
                  f"{entry['vs_flashinfer_bf16']:.2f}x bf16 FlashInfer", flush=True)  # fmt: skip


def checks(args, device) -> list[dict]:
    """The kernel against float64 on ragged steps, two launches in a row per backend (the
    counters' reset) and an FP8 cache with scales; tolerance: bf16 output rounding."""
    results = []
    geometry = (32, 8, 128)
    steps = [[1], [4095, 1, 130], [random.Random(s).randint(1, 700) for s in range(16)]]
    for kv_dtype, k_scale, v_scale in ((torch.bfloat16, 1.0, 1.0),
                                       (torch.float8_e4m3fn, 0.5, 2.0)):  # fmt: skip
        for bn, tokens, pf in itertools.product(args.block_n, (0, 16), args.prefetch):
            backend = small_backend(geometry, 16, 256, device, args, bn, tokens=tokens,
                                    prefetch=pf)  # fmt: skip
            for seed, lens in enumerate(steps):
                query, (kv,), meta = make_step(lens, geometry, args.block_size, device, seed,
                                               kv_dtype=kv_dtype)  # fmt: skip
                backend.begin_step(meta)
                got = backend.forward(query, kv, meta, 0.088, k_scale=k_scale, v_scale=v_scale)
                backend.end_step()
                want = paged_attention_reference(query.double(), kv.double(), meta, 0.088,
                                                 k_scale=k_scale, v_scale=v_scale)  # fmt: skip
                err = (got.double() - want).abs().max().item()
                ok = err <= 2e-2 and not backend.plan.counters.any().item()
                results.append({"lens": lens[:4], "batch": len(lens), "block_n": bn,
                                "split_tokens": backend.plan.split_tokens, "prefetch": pf,
                                "kv_dtype": str(kv_dtype), "max_abs_err": err, "ok": ok})  # fmt: skip
                print(f"check B={len(lens):2d} bn={bn} t={backend.plan.split_tokens} pf={pf} "
                      f"{kv_dtype}: err {err:.1e} "
                      f"{'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return results


def graph_checks(args, device) -> list[dict]:
    """One "plain" decode graph of 4 sequences captured on one step and replayed on others (new
    lengths and block tables planned into the same buffers by `prepare_replay`, new queries in
    the static buffer), as the engine replays it: each replay against float64, counters 0."""
    geometry, bs, num_blocks = (32, 8, 128), args.block_size, 1024
    gen = torch.Generator(device=device).manual_seed(1)
    kv = torch.randn(num_blocks, 2, bs, 8, 128, generator=gen, device=device,
                     dtype=torch.bfloat16)  # fmt: skip
    query = torch.randn(4, 32, 128, generator=gen, device=device, dtype=torch.bfloat16)
    out, rng, metas = torch.empty_like(query), random.Random(1), []
    for lens in ([1, 1, 1, 1], [300, 17, 4095, 64], [5, 129, 1000, 2]):
        pages = [-(-n // bs) for n in lens]
        ids = rng.sample(range(num_blocks), sum(pages))
        tables = [ids[sum(pages[:b]) : sum(pages[: b + 1])] for b in range(4)]
        metas.append(AttentionMetadata.from_host([1] * 4, lens, tables, bs, device=device,
                                                 padded_tables=True))  # fmt: skip
    results = []
    for bn, tokens, pf in itertools.product(args.block_n, (0, 16), args.prefetch):
        backend = small_backend(geometry, 4, 256, device, args, bn, tokens=tokens, prefetch=pf)
        plan_replay(backend, metas[0])
        backend.forward(query, kv, metas[0], 0.088, out=out)  # compiles
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.forward(query, kv, metas[0], 0.088, out=out)
        for meta in metas[1:] + metas[:1]:
            plan_replay(backend, meta)
            query.copy_(torch.randn(query.shape, generator=gen, device=device))
            graph.replay()
            want = paged_attention_reference(query.double(), kv.double(), meta, 0.088)
            err = (out.double() - want).abs().max().item()
            ok = err <= 2e-2 and not backend.plan.counters.any().item()
            results.append({"graph_replay_lens": meta.seq_lens_cpu, "block_n": bn,
                            "split_tokens": tokens, "prefetch": pf, "max_abs_err": err,
                            "ok": ok})  # fmt: skip
            print(f"graph replay {meta.seq_lens_cpu} bn={bn} t={tokens} pf={pf}: err {err:.1e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("the FlashInfer and Triton kernels need --device cuda")
    import flashinfer
    import triton

    result = {"device": torch.cuda.get_device_name(device), "flashinfer": flashinfer.__version__,
              "triton": triton.__version__, "args": vars(args)}  # fmt: skip
    result["checks"] = checks(args, device) + graph_checks(args, device)
    result["cases"] = []
    for spec in args.geometry:
        geometry = tuple(int(x) for x in spec.split(","))
        for kv_len in args.kv:
            for batch in args.batch:
                for dtype in args.kv_dtype:
                    result["cases"].append(run_case(args, geometry, batch, kv_len, device, dtype))
    compare_to_bf16(result["cases"])
    print("checks:", "all ok" if all(c["ok"] for c in result["checks"]) else "FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
