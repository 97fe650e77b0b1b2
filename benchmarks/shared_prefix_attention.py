"""Decode attention of G groups x D requests as the shared prefix grows: shared path vs plain paged.

One decode step, B = G * D sequences; sequence = [group prefix P (shared blocks) | S own tokens |
the new token]. Per (G, P), one layer's attention is timed for:

  plain               phloem's paged backend ("auto": FlashInfer on CUDA, else the reference),
                      reading every sequence's whole KV: B * (P + S + 1) tokens
  triton              SharedPrefixAttention(impl="triton"): our fused kernel, reads
                      G * P + B * (S + 1) tokens
  flashinfer_cascade  SharedPrefixAttention(impl="flashinfer"): the library cascade baseline
  no_prefix           the plain backend on B sequences of S + 1 tokens (no prefix at all): the
                      issue's goal is shared-path time <= 1.5x this
  graph               the shared path as decode steps run it, replayed from a CUDA graph
                      (`DecodeGraphPlan`: fixed-capacity tables; persistent wide launch)
  graph_rows          the same graph with one wide program per table row (no-op rows past the
                      step's prefix tiles), the launch before the persistent one

`--mixed L,M` adds prefill chunks to the step, as in a BatchLLM mixed step: L leaders computing a
fresh P-token prefix (q_len = P) and M group members computing their own S-token prompts after
the shared prefix (q_len = S; longer than 16 tokens, so they stay out of the groups and read their
whole KV). `--triton-configs` adds Triton variants as paths `triton:NAME`, each a comma list of
options of `shared_prefix_triton.shared_prefix_attention` (bm=block_m, bn=block_n, w=num_warps,
s=num_stages, nm=narrow_block_m, nw=narrow_num_warps, nbn=narrow_block_n, ns=narrow_num_stages,
ps=prefix_splits, fm=fp8_math: f16|q),
configs separated by ';'. `--graph-configs` does the same for the graph path (`graph:NAME`; bn,
w, s, ps = the graph's max_splits), e.g. to time the old tiling against the default in one run.

Self-checking: before timing, every path's output is compared with the plain path (and, where it
fits in memory, with the float32 reference); a path that disagrees is reported with ok=false and
not timed. With the shared path, time should grow with G, not with G * D.

Writes OUT_DIR/shared_prefix_attention.json after every configuration (a timeout keeps what ran).

    python benchmarks/shared_prefix_attention.py OUT_DIR                 # GPU, defaults below
    python benchmarks/shared_prefix_attention.py OUT_DIR --groups 8 --prefix-lens 512,2048
    python benchmarks/shared_prefix_attention.py OUT --groups 54 --prefix-lens 2000 --mixed 3,30 \
        --triton-configs "nm=16;bm=128,w=8,nm=16"
    TRITON_INTERPRET=1 python benchmarks/shared_prefix_attention.py OUT --smoke   # CPU check
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
import traceback
from pathlib import Path

import torch

from phloem.ops.attention import AttentionMetadata, get_attention_backend
from phloem.ops.attention.prefix_groups import build_shared_prefix_metadata
from phloem.ops.attention.reference import ReferenceAttention
from phloem.ops.attention.shared_prefix import SharedPrefixAttention
from phloem.ops.attention.sharing_rule import SharingRule
from phloem.ops.kv_store import allocate_kv_cache

PATHS = ("plain", "triton", "flashinfer_cascade", "no_prefix", "graph", "graph_rows")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--groups", type=ints, default=[4, 16, 64], help="G values (comma list)")
    p.add_argument("--degree", type=int, default=16, help="D: requests per group")
    p.add_argument("--prefix-lens", type=ints, default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--suffix-len", type=int, default=200, help="S: own tokens before the step")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--kv-fp8", action="store_true", help="float8_e4m3fn KV cache (queries --dtype)")
    p.add_argument("--kv-layout", choices=["NHD", "HND"], default="NHD", help="KV block layout")
    p.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--atol", type=float, default=2e-2, help="agreement with the plain path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed", default=None, help="L,M: prefill chunks of L leaders, M members")
    p.add_argument("--triton-configs", default="", help="Triton variants (see the docstring)")
    p.add_argument("--graph-configs", default="", help="graph-path variants (see the docstring)")
    p.add_argument(
        "--smoke", action="store_true", help="tiny CPU-sized run (checks the script, not speed)"
    )
    args = p.parse_args(argv)
    args.paths = [x for x in args.paths.split(",") if x]
    unknown = set(args.paths) - set(PATHS)  # (variants are added below, after this check)
    if unknown:
        p.error(f"unknown paths {sorted(unknown)}")
    keys = {"bm": "block_m", "bn": "block_n", "w": "num_warps", "s": "num_stages",
            "nm": "narrow_block_m", "nw": "narrow_num_warps", "nbn": "narrow_block_n",
            "ns": "narrow_num_stages", "ps": "prefix_splits", "fm": "fp8_math"}  # fmt: skip
    args.triton_options = {"triton": {}}
    for cfg in filter(None, args.triton_configs.split(";")):
        opts = dict(kv.split("=") for kv in cfg.split(","))
        args.triton_options[f"triton:{cfg}"] = {
            keys[k]: v if k == "fm" else int(v) for k, v in opts.items()
        }
        args.paths.append(f"triton:{cfg}")
    graph_keys = {"bn": "block_n", "w": "num_warps", "s": "num_stages", "ps": "max_splits"}
    args.graph_options = {"graph": {}, "graph_rows": {}}
    for cfg in filter(None, args.graph_configs.split(";")):
        opts = dict(kv.split("=") for kv in cfg.split(","))
        args.graph_options[f"graph:{cfg}"] = {graph_keys[k]: int(v) for k, v in opts.items()}
        args.paths.append(f"graph:{cfg}")
    args.mixed = tuple(int(x) for x in args.mixed.split(",")) if args.mixed else (0, 0)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.groups, args.degree, args.prefix_lens, args.suffix_len = [2, 3], 3, [32, 64], 5
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 16
        args.iters, args.warmup, args.dtype = 2, 1, "float32"
        args.mixed = (1, 2) if args.mixed != (0, 0) else args.mixed
    elif args.device.type != "cuda":
        p.error("no CUDA device: run with --smoke (and TRITON_INTERPRET=1 for the triton path)")
    args.dtype = getattr(torch, args.dtype)
    return args


def make_step(args, groups: int, prefix_len: int, with_prefix: bool = True):
    """(query, kv_cache, meta) of one step: a decode token for each of the G * D sequences, then
    the `--mixed` prefill chunks; meta.prefix_lens_cpu set. Block ids random."""
    bs, dev = args.block_size, args.device
    if prefix_len % bs:
        raise ValueError(f"prefix length {prefix_len} not a multiple of the block size {bs}")
    num_leaders, num_members = args.mixed if with_prefix else (0, 0)
    num_decode = groups * args.degree
    own_len = args.suffix_len + 1
    own_blocks = -(-own_len // bs)
    prefix_blocks = prefix_len // bs if with_prefix else 0
    leader_blocks = -(-prefix_len // bs)
    num_blocks = (groups * prefix_blocks + (num_decode + num_members) * own_blocks
                  + num_leaders * leader_blocks)  # fmt: skip
    ids = list(range(num_blocks))
    random.Random(args.seed).shuffle(ids)
    prefixes = [[ids.pop() for _ in range(prefix_blocks)] for _ in range(groups)]
    tables = [prefixes[b // args.degree] + [ids.pop() for _ in range(own_blocks)]
              for b in range(num_decode)]  # fmt: skip
    seq_len = (prefix_len if with_prefix else 0) + own_len
    seq_lens, q_lens = [seq_len] * num_decode, [1] * num_decode
    prefix_lens = [prefix_len if with_prefix else 0] * num_decode
    for _ in range(num_leaders):  # computing a fresh prefix: no group yet
        tables.append([ids.pop() for _ in range(leader_blocks)])
        seq_lens.append(prefix_len)
        q_lens.append(prefix_len)
        prefix_lens.append(0)
    for m in range(num_members):  # own prompt chunk after the group's prefix
        tables.append(prefixes[m % groups] + [ids.pop() for _ in range(own_blocks)])
        seq_lens.append(seq_len - 1)
        q_lens.append(args.suffix_len)
        prefix_lens.append(prefix_len)
    num_seqs = len(tables)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    shape = (num_blocks, 2, bs, args.num_kv_heads, args.head_dim)
    kv = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32)
    kv = kv.to(torch.float8_e4m3fn if args.kv_fp8 else args.dtype)
    if args.kv_layout == "HND":  # same values, head-major memory (kv_store.allocate_kv_cache)
        kv = allocate_kv_cache(num_blocks, bs, args.num_kv_heads, args.head_dim, kv.dtype, dev,
                               "HND").copy_(kv)  # fmt: skip
    q = torch.randn(qsl[-1], args.num_heads, args.head_dim, generator=gen, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    slots = [t[p // bs] * bs + p % bs
             for t, n, q_len in zip(tables, seq_lens, q_lens) for p in range(n - q_len, n)]  # fmt: skip
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
        block_size=bs,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=tables,
    )
    meta.prefix_lens_cpu = prefix_lens
    del num_seqs
    return q.to(args.dtype), kv, meta


def timed(fn, args) -> float:
    """Mean milliseconds per call of fn() over args.iters calls, after args.warmup calls."""
    for _ in range(args.warmup):
        fn()
    if args.device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.iters
    t0 = time.perf_counter()
    for _ in range(args.iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / args.iters


def host_ms(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def plain_backend(args, scale: float):
    name = "flashinfer" if unavailable("flashinfer") is None else "reference"  # plain paged
    return get_attention_backend(
        name,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        scale=scale,
        dtype=args.dtype,
        kv_dtype=torch.float8_e4m3fn if args.kv_fp8 else args.dtype,
        device=args.device,
        max_num_blocks_per_seq=(max(args.prefix_lens) + args.suffix_len + 1) // args.block_size + 1,
        kv_layout=args.kv_layout,
    )


def begin(backend, meta: AttentionMetadata) -> None:
    """Plan the step on a planning backend (FlashInfer); the reference has nothing to plan."""
    backend.begin_step(meta)


def unavailable(lib: str) -> str | None:
    """Why `lib` cannot run here (None if it can)."""
    try:
        __import__(lib)
    except Exception as e:
        return f"{lib} not importable: {type(e).__name__}: {e}"
    if lib == "flashinfer" and not torch.cuda.is_available():
        return "flashinfer needs CUDA"
    return None


def measure(args, path: str, step, fallback, scale: float, base: torch.Tensor) -> dict:
    """One path on one step: agreement with the plain output `base`, then ms per call."""
    q, kv, meta = step
    res: dict = {}
    if path == "plain":
        res["host_plan_ms"] = host_ms(lambda: begin(fallback, meta))
        fn = lambda: fallback.forward(q, kv, meta, scale)  # noqa: E731
        res["max_abs_diff_vs_plain"], res["ok"] = 0.0, True
    elif path == "no_prefix":
        q0, kv0, meta0 = make_step(args, meta.num_seqs // args.degree, 0, with_prefix=False)
        begin(fallback, meta0)
        fn = lambda: fallback.forward(q0, kv0, meta0, scale)  # noqa: E731
        res["ok"] = True
    elif path.startswith("graph"):
        if args.mixed != (0, 0) or args.device.type != "cuda":
            return {"ok": None, "skipped": "graph paths take decode-only steps on CUDA"}
        graph, plan, out = graph_replay(args, step, scale, persistent=path != "graph_rows",
                                        **args.graph_options[path])  # fmt: skip
        fn = graph.replay  # `plan` (its buffers) lives in this frame until the timing is done
        res["max_abs_diff_vs_plain"] = (out.float() - base.float()).abs().max().item()
        res["ok"] = bool(res["max_abs_diff_vs_plain"] <= args.atol)
        if not res["ok"]:
            return res
    else:
        impl = "triton" if path.startswith("triton") else "flashinfer"
        missing = unavailable(impl)
        if missing:
            return {"ok": None, "skipped": missing}
        options = args.triton_options.get(path, {})
        backend = SharedPrefixAttention(
            fallback,
            impl=impl,
            rule=SharingRule(min_saved_kv_tokens=0, partial_cost_tokens=0),
            **options,
        )
        res["compile_and_first_call_ms"] = host_ms(lambda: backend.forward(q, kv, meta, scale))
        res["host_plan_ms"] = host_ms(lambda: backend.begin_step(meta))  # builder + cost rule
        res["first_call_ms"] = host_ms(lambda: backend.forward(q, kv, meta, scale))  # + kernel plan
        if backend.last_path != "shared_prefix":
            raise RuntimeError(f"the backend ran {backend.last_path!r}, not the shared path")
        out = backend.forward(q, kv, meta, scale)
        res["max_abs_diff_vs_plain"] = (out.float() - base.float()).abs().max().item()
        res["ok"] = bool(res["max_abs_diff_vs_plain"] <= args.atol)
        if not res["ok"]:
            return res  # a wrong answer is not timed
        fn = lambda: backend.forward(q, kv, meta, scale)  # noqa: E731
    res["ms"] = timed(fn, args)
    return res


def graph_replay(args, step, scale: float, persistent: bool, **options):
    """(graph, plan, output) of the step's shared-prefix attention captured in a CUDA graph, as
    a decode step replays it: planned into `DecodeGraphPlan` buffers sized for this batch. Keep
    the plan alive while the graph replays: a graph does not own the tensors it reads, and freed
    tile tables get reused by the allocator (replays then read garbage block ids)."""
    from phloem.ops.attention.decode_graph_plan import DecodeGraphPlan

    q, kv, meta = step
    sp = build_shared_prefix_metadata(meta, meta.prefix_lens_cpu)
    blocks = sum(map(len, sp.group_block_ids)) + sum(map(len, sp.suffix_block_ids))
    plan = DecodeGraphPlan(meta.num_seqs, args.num_heads, args.num_kv_heads, args.head_dim,
                           args.device, max_blocks=blocks + 16, persistent_wide=persistent,
                           **options)  # fmt: skip
    plan.prepare(meta, sp)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        plan.forward(q, kv, scale, args.block_size)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.forward(q, kv, scale, args.block_size)
    graph.replay()
    torch.cuda.synchronize()
    return graph, plan, out


def run_config(args, groups: int, prefix_len: int, fallback, scale: float) -> dict:
    """All paths on one (G, P); each path's dict has ms, GB/s of KV read, agreement."""
    q, kv, meta = make_step(args, groups, prefix_len)
    num_seqs, own = groups * args.degree, args.suffix_len + 1
    token_bytes = 2 * args.num_kv_heads * args.head_dim * kv.element_size()
    shared_tokens = groups * prefix_len + num_seqs * own
    kv_tokens = {
        "plain": num_seqs * (prefix_len + own),
        "flashinfer_cascade": shared_tokens,
        "no_prefix": num_seqs * own,
    }
    kv_tokens.update((p, shared_tokens) for p in args.paths if p.startswith(("triton", "graph")))
    rec = {"groups": groups, "degree": args.degree, "prefix_len": prefix_len,
           "suffix_len": args.suffix_len, "num_seqs": num_seqs, "mixed": list(args.mixed),
           "paths": {}}  # fmt: skip
    rec["default_cost_rule_picks_shared"] = SharedPrefixAttention(fallback).plan(meta) is not None
    begin(fallback, meta)
    base = fallback.forward(q, kv, meta, scale)
    ref_bytes = num_seqs * (prefix_len + own) * token_bytes // kv.element_size() * 4
    if ref_bytes < 4 << 30:  # the plain path itself against the float32 reference
        want = ReferenceAttention().forward(q.float(), kv.float(), meta, scale)
        rec["plain_vs_reference_max_abs"] = (base.float() - want).abs().max().item()
        del want
    for path in args.paths:
        try:
            res = measure(args, path, (q, kv, meta), fallback, scale, base)
        except Exception as e:  # record and go on: one broken path must not hide the others
            traceback.print_exc()
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
        res["kv_tokens_read"] = kv_tokens[path]
        if "ms" in res and args.mixed == (0, 0):  # decode-only: the KV read is the whole story
            res["kv_gb_per_s"] = kv_tokens[path] * token_bytes / res["ms"] / 1e6
        rec["paths"][path] = res
    paths = rec["paths"]
    shared_paths = [p for p in args.paths if p.startswith(("triton", "graph"))]
    for name in shared_paths + ["flashinfer_cascade"]:
        if "ms" in paths.get(name, {}):
            if "ms" in paths.get("plain", {}):
                paths[name]["speedup_vs_plain"] = paths["plain"]["ms"] / paths[name]["ms"]
            if "ms" in paths.get("no_prefix", {}):
                paths[name]["ratio_to_no_prefix"] = paths[name]["ms"] / paths["no_prefix"]["ms"]
    return rec


def environment(args) -> dict:
    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "host": platform.node(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu",
    }
    for lib in ("triton", "flashinfer"):
        try:
            env[lib] = __import__(lib).__version__
        except Exception as e:  # absent or broken: the path reports its own error
            env[lib] = f"unavailable ({type(e).__name__})"
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_file = args.out_dir / "shared_prefix_attention.json"
    scale = args.head_dim**-0.5
    fallback = plain_backend(args, scale)
    config = {k: (str(v) if isinstance(v, torch.dtype | torch.device | Path) else v)
              for k, v in vars(args).items()}  # fmt: skip
    report = {"environment": environment(args), "config": config,
              "plain_backend": fallback.name, "results": []}  # fmt: skip
    print(f"plain backend: {fallback.name}; device: {report['environment']['device']}")
    header = f"{'G':>4} {'D':>3} {'P':>6} " + " ".join(f"{p:>20}" for p in args.paths)
    print(header + "   (ms per layer; * = failed or disagrees with plain; n/a = library absent)")
    all_ok = True
    for groups in args.groups:
        for prefix_len in args.prefix_lens:
            try:
                rec = run_config(args, groups, prefix_len, fallback, scale)
            except Exception as e:  # e.g. out of memory building the step
                traceback.print_exc()
                rec = {"groups": groups, "prefix_len": prefix_len, "error": repr(e)}
                all_ok = False
            report["results"].append(rec)
            out_file.write_text(json.dumps(report, indent=1))
            cells = []
            for path in args.paths:
                res = rec.get("paths", {}).get(path, {})
                all_ok &= res.get("ok", False) is not False  # None: skipped (library absent)
                cell = f"{res['ms']:.3f}" if "ms" in res else ("n/a" if "skipped" in res else "-")
                cells.append(f"{cell + ('*' if res.get('ok') is False else ''):>20}")
            print(f"{groups:>4} {args.degree:>3} {prefix_len:>6} " + " ".join(cells), flush=True)
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"wrote {out_file}; every path that ran agrees with plain: {all_ok}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
