"""Decode attention against the bandwidth ceiling: which FlashInfer kernel reads the KV cache fastest.

Issue 19: the decode-heavy workload (1000 in / 1000 out) runs at half the roofline, bound by
reading KV, and the attention kernels read it at about half the copy bandwidth. This times one
layer's decode attention (every q_len 1) of Llama-3.1-8B shapes (32 query heads, 8 KV heads,
head_dim 128, bf16) over a paged cache with shuffled pages, for each kernel FlashInfer offers on
Hopper, each batch size, context length and page size:

  fa2-prefill     BatchPrefillWithPagedKVCacheWrapper(backend="fa2") with q_len 1: what phloem's
                  decode CUDA graphs replay today
  fa3-prefill     the same with backend="fa3" (Hopper)
  fa2-nosplit     fa2-prefill planned with `disable_split_kv=True`: no split-KV merge kernel
                  (in a CUDA graph FlashInfer launches the merge on every replay); one CTA per
                  sequence x KV head, so it pays only for small batches of short contexts
  decode          BatchDecodeWithPagedKVCacheWrapper (CUDA cores, split-KV)
  decode-tc       BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)

With `--kv-dtype fp8` the cache is e4m3 (issue 18: does an FP8 KV cache make decode faster, and
on which kernel?): each kernel reads the same e4m3 pages at half the bytes, bf16 queries and
outputs, except fa3-prefill, which takes FP8 queries too (FlashInfer's fa3 FP8 path: q, K and V
in e4m3, bf16 output). Bytes then count one byte an element.

Each kernel runs inside a CUDA graph (as the engine replays decode), timed with CUDA events over
--iters replays; each result is checked against the first kernel listed (max |diff| <= --atol).
Bytes read = the K and V of every cached token (the queries and outputs are < 1% of it); the
ceiling is ROOFLINE.md's copy bandwidth (`phloem.bench.roofline.measure_ceilings`), measured in
the same run.
A kernel that fails to build or run is reported with its error and skipped.

    python benchmarks/decode_attention.py OUT_DIR --batch 64 256 512 --context 1000 2000 \
        --page-size 16 64
    python benchmarks/decode_attention.py OUT_DIR --kv-dtype fp8 --batch 64 256 512 \
        --context 1000 2000 --page-size 16 --kernels decode decode-tc fa2-prefill fa3-prefill
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import torch

from phloem.bench.graph_timing import graph_replay_seconds
from phloem.bench.roofline import measure_ceilings

KERNELS = ("fa2-prefill", "fa3-prefill", "fa2-nosplit", "decode", "decode-tc")
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--context", type=int, nargs="+", default=[1000, 2000], help="KV tokens per seq")
    p.add_argument("--page-size", type=int, nargs="+", default=[16, 64])
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--atol", type=float, default=2e-2)
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the cache's dtype (fp8: e4m3, scales 1)")  # fmt: skip
    return p.parse_args(argv)


def make_wrapper(flashinfer, kernel: str, workspace, batch: int, indptr, indices, last, args):
    """A CUDA-graph wrapper of `kernel` planned for the step (fixed buffers sized for it)."""
    i32 = dict(dtype=torch.int32, device=workspace.device)
    kv_dtype = KV_DTYPES[args.kv_dtype]
    fp8_q = kernel.startswith("fa3") and args.kv_dtype == "fp8"  # fa3's FP8 path: q in e4m3 too
    common = dict(sm_scale=args.head_dim**-0.5, kv_data_type=kv_dtype,
                  q_data_type=kv_dtype if fp8_q else torch.bfloat16)  # fmt: skip
    if fp8_q:
        common["o_data_type"] = torch.bfloat16
    geometry = (args.num_heads, args.num_kv_heads, args.head_dim, args.page)
    if kernel.startswith("fa"):
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.arange(batch + 1, **i32),
            paged_kv_indptr_buf=torch.empty(batch + 1, **i32),
            paged_kv_indices_buf=torch.empty(indices.numel(), **i32),
            paged_kv_last_page_len_buf=torch.empty(batch, **i32),
            backend=kernel.split("-")[0],
        )  # fmt: skip
        qo = torch.arange(batch + 1, dtype=torch.int32)
        wrapper.plan(qo, indptr, indices, last, *geometry, causal=True,
                     disable_split_kv=kernel.endswith("-nosplit"), **common)  # fmt: skip
    else:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=kernel == "decode-tc",
            paged_kv_indptr_buffer=torch.empty(batch + 1, **i32),
            paged_kv_indices_buffer=torch.empty(indices.numel(), **i32),
            paged_kv_last_page_len_buffer=torch.empty(batch, **i32),
        )  # fmt: skip
        wrapper.plan(indptr, indices, last, *geometry, **common)
    return wrapper


def time_kernel(wrapper, q, kv_cache, iters: int) -> tuple[float, torch.Tensor]:
    """Mean seconds per replay of the wrapper's run captured in a CUDA graph, and its output
    (bf16, whatever the query's dtype)."""
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    return graph_replay_seconds(lambda: wrapper.run(q, kv_cache, out=out), iters), out


def run_case(flashinfer, args, batch: int, context: int, page: int, ceiling: float) -> dict:
    """Every kernel on one (batch, context, page size) case; KV of every sequence `context`."""
    device = torch.device("cuda")
    args.page = page
    pages_per_seq = -(-context // page)
    num_pages = batch * pages_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    kv = torch.randn(num_pages, 2, page, args.num_kv_heads, args.head_dim, generator=gen,
                     device=device, dtype=torch.bfloat16).to(KV_DTYPES[args.kv_dtype])  # fmt: skip
    q = torch.randn(batch, args.num_heads, args.head_dim, generator=gen, device=device,
                    dtype=torch.bfloat16)  # fmt: skip
    indices = torch.randperm(num_pages, dtype=torch.int32)  # fragmented, as after hours of serving
    indptr = torch.arange(0, num_pages + 1, pages_per_seq, dtype=torch.int32)
    last = torch.full((batch,), context - (pages_per_seq - 1) * page, dtype=torch.int32)
    kv_bytes = batch * context * 2 * args.num_kv_heads * args.head_dim * kv.element_size()
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    case = {"batch": batch, "context": context, "page_size": page, "kv_bytes": kv_bytes,
            "kv_dtype": args.kv_dtype, "kernels": {}}  # fmt: skip
    reference = None
    for kernel in args.kernels:
        try:
            wrapper = make_wrapper(flashinfer, kernel, workspace, batch, indptr, indices, last,
                                   args)  # fmt: skip
            fp8_q = kernel.startswith("fa3") and args.kv_dtype == "fp8"
            seconds, out = time_kernel(wrapper, q.to(kv.dtype) if fp8_q else q, kv, args.iters)
        except Exception as e:  # noqa: BLE001 - a kernel that does not build is reported
            case["kernels"][kernel] = {"error": f"{type(e).__name__}: {e}"[:500]}
            traceback.print_exc()
            continue
        diff = 0.0 if reference is None else (out.float() - reference.float()).abs().max().item()
        reference = out if reference is None else reference
        bandwidth = kv_bytes / seconds
        case["kernels"][kernel] = {
            "us": seconds * 1e6, "bytes_per_s": bandwidth,
            "fraction_of_copy_bandwidth": bandwidth / ceiling, "max_abs_diff": diff,
            "ok": diff <= args.atol,
        }  # fmt: skip
        print(f"B={batch:4d} L={context:5d} page={page:3d} {kernel:12s} {seconds * 1e6:9.1f} us "
              f"{bandwidth / 1e12:6.2f} TB/s = {bandwidth / ceiling:.3f} of copy  "
              f"diff {diff:.2e}", flush=True)  # fmt: skip
    return case


def main(argv=None) -> None:
    args = parse_args(argv)
    import flashinfer

    os.makedirs(args.out_dir, exist_ok=True)
    device = torch.device("cuda")
    ceiling = measure_ceilings(device)["bytes_per_s"]  # ROOFLINE.md's copy ceiling
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {ceiling / 1e12:.2f} TB/s")
    result = {"device": torch.cuda.get_device_name(device), "copy_bytes_per_s": ceiling,
              "flashinfer": flashinfer.__version__, "cases": []}  # fmt: skip
    for page in args.page_size:
        for context in args.context:
            for batch in args.batch:
                result["cases"].append(run_case(flashinfer, args, batch, context, page, ceiling))
    path = os.path.join(args.out_dir, "decode_attention.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
