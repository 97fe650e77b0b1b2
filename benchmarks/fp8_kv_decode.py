"""Decode attention over an FP8 (e4m3) KV cache: every candidate kernel against FlashInfer over a
bf16 cache, per layer, in CUDA graphs (issue 18: an FP8 cache should make decode-heavy attention
>= 1.3x faster, half the bytes).

Candidates (`CANDIDATES`; each runs the cache dtypes it lists):

  flashinfer          phloem's backend with the fa2 prefill kernel at q_len 1 (`FlashInferAttention`,
                      decode graphs; PHLOEM_FP8_DECODE_KERNEL=prefill: the FP8 default before
                      XQA became it on sm_90/100/120); bf16 and fp8. Its bf16 time is
                      the baseline of every `vs_bf16` ratio.
  flashinfer-cuda     phloem's backend, PHLOEM_FP8_DECODE_KERNEL=cuda_core (FlashInfer's CUDA-core
                      batch decode kernel); fp8
  flashinfer-xqa      phloem's backend, PHLOEM_FP8_DECODE_KERNEL=xqa (TensorRT-LLM's XQA; on sm_90
                      its FP8 GMMA kernel: query and P rounded to e4m3); fp8
  fi-decode-tc        FlashInfer's BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) in a
                      graph wrapper (bf16 queries: its fa2 prefill module, its own plan); fp8
  fi-fa3-fp8q         FlashInfer's fa3 prefill wrapper over e4m3 pages with the query rounded to
                      e4m3 in the timed graph (fa3 reads an FP8 cache only with FP8 queries); fp8
                      (off by default: its JIT build alone may take ~80 s; --candidates all)
  triton/...          phloem's small-decode kernel (`SmallDecodeAttention`, any batch) with
                      BLOCK_N, warps and stages from the name (`bn64/w4/s2`); for fp8 its
                      `fp8_math`: "f16" (float16 math, the default), "/q" (the query's bf16,
                      the kernel before 2026-11-27f) or "/mma" (e4m3 x e4m3 wgmma with the
                      operands swapped, the query and P rounded to e4m3)

Each case (batch x KV tokens, Llama-3.1-8B's 32 / 8 / 128, page 16) makes `layers_that_fit`
caches (shared with small_decode_attention.py: the same layer count for both dtypes), an FP8 case's
the bf16 ones rounded to e4m3 and read with --fp8-scales. Every candidate's first layer output is
compared with float64 attention over the same dequantized cache: relative error (Frobenius) and
max |error|; bound `REL_TOL` by its math: 1e-2 for 16-bit math, 8e-2 where the query and P are
rounded to e4m3 (~3-4% measured in float64 on random data, CPU). A candidate over its bound is a
FAIL line and the exit status is 1 (after the JSON is written). KV read bandwidth counts B x L x 2
x H_kv x D x element size a layer. On --device cpu (`--tiny`: the CI test) only the Triton
candidates run, under TRITON_INTERPRET, and nothing is timed.

    source benchmarks/device_setup.sh && python3 benchmarks/fp8_kv_decode.py \
        --json $R/fp8_kv_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.small_decode_attention import (  # noqa: E402
    KV_DTYPES,
    kv_read_bytes,
    layers_that_fit,
    make_step,
    plan_replay,
    time_layers,
)
from phloem.ops.attention.reference import paged_attention_reference  # noqa: E402

REL_TOL = {"16-bit": 1e-2, "e4m3": 8e-2}  # relative error bound by a candidate's math
TRITON_VARIANTS = {  # name -> (cache dtypes, block_n, warps, stages, fp8_math)
    "triton/bn32/w4/s2": (("bf16", "fp8"), 32, 4, 2, "f16"),  # the engine's options
    "triton/bn64/w4/s2": (("fp8",), 64, 4, 2, "f16"),
    "triton/bn32/w4/s2/q": (("fp8",), 32, 4, 2, "q"),
    "triton/bn64/w4/s2/mma": (("fp8",), 64, 4, 2, "mma"),
    "triton/bn128/w4/s2/mma": (("fp8",), 128, 4, 2, "mma"),
    "triton/bn128/w4/s3/mma": (("fp8",), 128, 4, 3, "mma"),
    "triton/bn256/w4/s2/mma": (("fp8",), 256, 4, 2, "mma"),
}


@dataclass(frozen=True)
class Candidate:
    """A kernel to time: the cache dtypes it runs, its math (`REL_TOL`'s key), whether it needs
    FlashInfer (a GPU), and its backend factory (geometry, batch, max pages a sequence, device,
    cache dtype) -> an object with `prepare_replay(meta)` and `forward(query, kv, meta, scale,
    out=, k_scale=, v_scale=)`."""

    kv_dtypes: tuple[str, ...]
    math: str
    flashinfer: bool
    make: object


def phloem_flashinfer(fp8_decode: str):
    """The factory of phloem's FlashInfer backend as the engine builds it (bf16 queries, NHD,
    the default softmax scale) with `fp8_decode` as PHLOEM_FP8_DECODE_KERNEL."""

    def make(geometry, batch, max_pages, device, kv_dtype):
        from phloem.ops.attention.flashinfer_backend import FlashInferAttention

        h, h_kv, d = geometry
        return FlashInferAttention(h, h_kv, d, torch.bfloat16, device, kv_dtype=kv_dtype,
                                   max_num_blocks_per_seq=max_pages, max_num_seqs=batch,
                                   fp8_decode=fp8_decode)  # fmt: skip

    return make


def triton_variant(block_n: int, warps: int, stages: int, fp8_math: str):
    """The factory of phloem's small-decode backend (its Triton kernel for every step here;
    the grid's splits by `small_decode.max_splits`) with these launch options."""

    def make(geometry, batch, max_pages, device, kv_dtype):
        from phloem.ops.attention.reference import ReferenceAttention
        from phloem.ops.attention.small_decode import SmallDecodeAttention

        h, h_kv, d = geometry
        return SmallDecodeAttention(ReferenceAttention(), h, h_kv, d, device, max_batch=batch,
                                    max_num_blocks_per_seq=max_pages, impl="triton",
                                    block_n=block_n, num_warps=warps, num_stages=stages,
                                    fp8_math=fp8_math)  # fmt: skip

    return make


class LibraryDecode:
    """A FlashInfer wrapper outside phloem's backend, run as the backend runs its graph
    wrappers: planned into fixed buffers (`prepare_replay`), launched in `forward`.
    kind "decode-tc": BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True), bf16 queries;
    "fa3-fp8q": the fa3 prefill wrapper with e4m3 queries (rounded in `forward`, bf16 output).
    Scales go to `run` (k_scale folded into the softmax scale, v_scale an output multiply)."""

    def __init__(self, kind, geometry, batch, max_pages, device, kv_dtype):
        import flashinfer

        self.kind, self.geometry, self.device = kind, geometry, device
        i32 = dict(dtype=torch.int32, device=device)
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
        bufs = (torch.zeros(batch + 1, **i32), torch.zeros(batch * max_pages, **i32),
                torch.zeros(batch, **i32))  # fmt: skip
        if kind == "decode-tc":
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
                paged_kv_last_page_len_buffer=bufs[2],
            )  # fmt: skip
        else:
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.arange(batch + 1, **i32),
                paged_kv_indptr_buf=bufs[0], paged_kv_indices_buf=bufs[1],
                paged_kv_last_page_len_buf=bufs[2], backend="fa3",
            )  # fmt: skip

    def prepare_replay(self, meta):
        import numpy as np

        from phloem.ops.attention.page_tables import paged_kv_layout
        from phloem.ops.staging import pinned

        h, h_kv, d = self.geometry
        indptr, indices, last = paged_kv_layout(meta)
        indices = indices.to(self.device, non_blocking=True)
        e4m3, scale = torch.float8_e4m3fn, d**-0.5
        if self.kind == "decode-tc":
            self.wrapper.plan(indptr, indices, last, h, h_kv, d, meta.block_size, sm_scale=scale,
                              q_data_type=torch.bfloat16, kv_data_type=e4m3)  # fmt: skip
            return
        qo = pinned(np.arange(meta.num_seqs + 1, dtype=np.int32))
        self.wrapper.plan(qo, indptr, indices, last, h, h_kv, d, meta.block_size, causal=True,
                          sm_scale=scale, q_data_type=e4m3, kv_data_type=e4m3,
                          o_data_type=torch.bfloat16, max_token_per_sequence=1)  # fmt: skip

    def forward(self, query, kv, meta, scale, out=None, k_scale=1.0, v_scale=1.0):
        if self.kind == "fa3-fp8q":
            query = query.clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = {k: s for k, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s != 1.0}
        return self.wrapper.run(query, kv, out=out, **scales)


def library(kind: str):
    """The factory of a `LibraryDecode` of `kind`."""
    return lambda geometry, batch, max_pages, device, kv_dtype: LibraryDecode(
        kind, geometry, batch, max_pages, device, kv_dtype
    )


CANDIDATES = {
    "flashinfer": Candidate(("bf16", "fp8"), "16-bit", True, phloem_flashinfer("prefill")),
    "flashinfer-cuda": Candidate(("fp8",), "16-bit", True, phloem_flashinfer("cuda_core")),
    "flashinfer-xqa": Candidate(("fp8",), "e4m3", True, phloem_flashinfer("xqa")),
    "fi-decode-tc": Candidate(("fp8",), "16-bit", True, library("decode-tc")),
    "fi-fa3-fp8q": Candidate(("fp8",), "e4m3", True, library("fa3-fp8q")),
    **{
        name: Candidate(v[0], "e4m3" if v[4] == "mma" else "16-bit", False, triton_variant(*v[1:]))
        for name, v in TRITON_VARIANTS.items()
    },  # fmt: skip
}
DEFAULT_OFF = ("fi-fa3-fp8q",)  # in --candidates all only


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu (Triton interpreter, untimed)")
    p.add_argument("--tiny", action="store_true",
                   help="CI size: batch 2, KV 40, heads 8 / 2 / 32 (the --device cpu test)")  # fmt: skip
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--kv", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--geometry", default="32,8,128", help="num_heads,num_kv_heads,head_dim")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--candidates", nargs="+", default=["default"],
                   help=f"names of {list(CANDIDATES)}, 'default' (all but {DEFAULT_OFF}) "
                        "or 'all'")  # fmt: skip
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=10, help="timed graph replays a case")
    p.add_argument("--fp8-scales", type=float, nargs=2, default=[0.5, 2.0],
                   metavar=("K_SCALE", "V_SCALE"))  # fmt: skip
    p.add_argument("--kv-budget-gb", type=float, default=60.0,
                   help="cap each case's layers so their bf16 caches fit this many GB")  # fmt: skip
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.kv, args.geometry, args.layers = [2], [40], "8,2,32", 1
    args.geometry = tuple(int(x) for x in args.geometry.split(","))
    return args


def chosen(names: list[str], device_type: str) -> list[str]:
    """The candidates to run: `names` expanded ("default", "all"); FlashInfer's dropped off CUDA.

    Raises:
        SystemExit: for an unknown name.
    """
    out = []
    for name in names:
        if name in ("default", "all"):
            out += [n for n in CANDIDATES if name == "all" or n not in DEFAULT_OFF]
        elif name in CANDIDATES:
            out.append(name)
        else:
            raise SystemExit(f"unknown candidate {name!r}; choose from {list(CANDIDATES)}")
    out = list(dict.fromkeys(out))
    return [n for n in out if device_type == "cuda" or not CANDIDATES[n].flashinfer]


def jit_specs(names: list[str], geometry, block_size: int) -> list:
    """FlashInfer's JIT specs of the modules the chosen candidates load (bf16 queries and
    outputs, int32 indices, phloem's template flags: `worker/kernel_prebuild._jit_spec`)."""
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.xqa import gen_xqa_module

    bf16, e4m3, i32 = torch.bfloat16, torch.float8_e4m3fn, torch.int32
    h, h_kv, d = geometry
    specs = {"fa2 bf16": gen_batch_prefill_module("fa2", bf16, bf16, bf16, i32, d, d, 0, False,
                                                  False, False)}  # fmt: skip
    if any(n in names for n in ("flashinfer", "fi-decode-tc")):
        specs["fa2 e4m3"] = gen_batch_prefill_module("fa2", bf16, e4m3, bf16, i32, d, d, 0,
                                                     False, False, False)  # fmt: skip
    if "flashinfer-cuda" in names:
        specs["decode e4m3"] = gen_batch_decode_module(bf16, e4m3, bf16, i32, d, d, 0, False,
                                                       False)  # fmt: skip
    if "flashinfer-xqa" in names:
        specs["xqa e4m3"] = gen_xqa_module(bf16, e4m3, block_size, d, h // h_kv, False, bf16, 1)
    if "fi-fa3-fp8q" in names:
        specs["fa3 e4m3"] = gen_batch_prefill_module("fa3", e4m3, e4m3, bf16, i32, d, d, 0,
                                                     False, False, False)  # fmt: skip
    return list(specs.values())


def prebuild(args, names: list[str], device) -> dict:
    """Build the FlashInfer modules the candidates need side by side in a background thread
    (`kernel_prebuild.build_specs`: one ninja run each; restored AOT modules are skipped) while
    this thread compiles each Triton variant on a one-sequence step of the case geometry (the
    same specialization as the cases'); returns the seconds each took. A failed build is
    printed; its candidates then fail (recorded) at first use."""
    import threading
    import time

    from phloem.worker.kernel_prebuild import build_specs

    done: dict = {}

    def build():
        start = time.perf_counter()
        try:
            build_specs(jit_specs(names, args.geometry, args.block_size))
        except Exception:  # noqa: BLE001 - reported; the candidate's first use raises it
            traceback.print_exc()
        done["flashinfer_build_s"] = time.perf_counter() - start

    thread = threading.Thread(target=build, name="fp8-kv-prebuild")
    thread.start()
    start = time.perf_counter()
    for name in names:
        if CANDIDATES[name].flashinfer:
            continue
        for dtype in CANDIDATES[name].kv_dtypes:
            query, (kv,), meta = make_step([40], args.geometry, args.block_size, device, 0,
                                           kv_dtype=KV_DTYPES[dtype])  # fmt: skip
            backend = CANDIDATES[name].make(args.geometry, 1, 3, device, KV_DTYPES[dtype])
            plan_replay(backend, meta)
            backend.forward(query, kv, meta, query.shape[-1] ** -0.5, out=torch.empty_like(query))
    done["triton_compile_s"] = time.perf_counter() - start
    thread.join()
    print(f"prebuild: {done}", flush=True)
    return done


def errors(out: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max |error|) of `out` against the float64 `want`."""
    diff = out.double() - want
    return (diff.norm() / want.norm().clamp_min(1e-30)).item(), diff.abs().max().item()


def run_one(args, name, geometry, batch, kv_len, dtype, step, device) -> dict:
    """One candidate on one case: its output against float64, and on CUDA its time a layer."""
    query, caches, meta, want, scales = step
    cand = CANDIDATES[name]
    backend = cand.make(geometry, batch, -(-kv_len // args.block_size), device, KV_DTYPES[dtype])
    if device.type == "cuda":
        seconds, out = time_layers(backend, query, caches, meta, args.iters, *scales)
    else:
        seconds, out = None, torch.empty_like(query)
        plan_replay(backend, meta)
        backend.forward(query, caches[0], meta, query.shape[-1] ** -0.5, out=out,
                        k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    rel, abs_err = errors(out, want)
    entry = {"math": cand.math, "rel_err": rel, "max_abs_err": abs_err,
             "ok": rel <= REL_TOL[cand.math], "us_per_layer": None, "kv_read_tb_s": None}  # fmt: skip
    if seconds is not None:
        entry["us_per_layer"] = seconds * 1e6
        entry["kv_read_tb_s"] = (
            kv_read_bytes(batch, kv_len, geometry, KV_DTYPES[dtype]) / seconds / 1e12
        )
    return entry


def case_inputs(args, geometry, batch, kv_len, dtype, device):
    """(query, caches, meta, float64 reference of the first layer, scales) of a case; the
    reference reads a bf16 copy of the first cache (exact for e4m3), gathered per sequence."""
    layers = layers_that_fit(args.layers, batch, kv_len, geometry, args.block_size,
                             args.kv_budget_gb)  # fmt: skip
    query, caches, meta = make_step([kv_len] * batch, geometry, args.block_size, device,
                                    seed=batch * 7919 + kv_len, layers=layers,
                                    kv_dtype=KV_DTYPES[dtype])  # fmt: skip
    scales = tuple(args.fp8_scales) if dtype == "fp8" else (1.0, 1.0)
    want = paged_attention_reference(query, caches[0].to(torch.bfloat16), meta,
                                     query.shape[-1] ** -0.5, k_scale=scales[0],
                                     v_scale=scales[1])  # fmt: skip
    return query, caches, meta, want, scales


def run_case(args, names, geometry, batch, kv_len, dtype, device) -> dict:
    """Every chosen candidate that runs `dtype` on one case; a failing one is recorded."""
    step = case_inputs(args, geometry, batch, kv_len, dtype, device)
    case = {"batch": batch, "kv": kv_len, "kv_dtype": dtype, "layers": len(step[1]),
            "k_scale": step[4][0], "v_scale": step[4][1], "kernels": {}}  # fmt: skip
    for name in names:
        if dtype not in CANDIDATES[name].kv_dtypes:
            continue
        try:
            entry = run_one(args, name, geometry, batch, kv_len, dtype, step, device)
        except Exception as e:  # noqa: BLE001 - a kernel that fails is reported, not fatal
            traceback.print_exc()
            entry = {"error": f"{type(e).__name__}: {e}"[:500], "ok": False}
        case["kernels"][name] = entry
        print(line(case, name, entry), flush=True)
    del step
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next case's caches need the room
    return case


def line(case: dict, name: str, entry: dict) -> str:
    head = f"B={case['batch']:3d} KV={case['kv']:5d} {case['kv_dtype']:4s} {name:22s}"
    if "error" in entry:
        return f"{head} ERROR {entry['error'][:200]}"
    us, tb = entry["us_per_layer"], entry["kv_read_tb_s"]
    timing = f"{us:9.2f} us/layer {tb:5.2f} TB/s" if us is not None else "   (untimed)"
    return (f"{head} {timing}  rel err {entry['rel_err']:.1e} max {entry['max_abs_err']:.1e} "
            f"({entry['math']}) {'ok' if entry['ok'] else 'FAIL'}")  # fmt: skip


def compare(cases: list[dict]) -> list[str]:
    """Give every timed entry `vs_bf16`: the same (batch, KV)'s bf16 "flashinfer" time over its
    time (mutates `cases`); returns the table's lines, fastest FP8 candidate first per case."""
    base = {(c["batch"], c["kv"]): c["kernels"].get("flashinfer", {}).get("us_per_layer")
            for c in cases if c["kv_dtype"] == "bf16"}  # fmt: skip
    rows = []
    for case in cases:
        ref = base.get((case["batch"], case["kv"]))
        timed = [(e["us_per_layer"], n, e) for n, e in case["kernels"].items()
                 if e.get("us_per_layer")]  # fmt: skip
        for us, name, entry in sorted(timed, key=lambda t: t[0]):
            entry["vs_bf16"] = ref / us if ref else None
            ratio = f"{entry['vs_bf16']:.2f}x" if ref else "-"
            rows.append(f"| {case['batch']} | {case['kv']} | {case['kv_dtype']} | {name} | "
                        f"{us:.1f} | {entry['kv_read_tb_s']:.2f} | {ratio} |")  # fmt: skip
    head = "| B | KV | cache | kernel | us/layer | TB/s | vs bf16 flashinfer |"
    return [head, "|---|---|---|---|---|---|---|", *rows]


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module's import
    names = chosen(args.candidates, device.type)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "args": {k: v for k, v in vars(args).items()}, "candidates": names,
              "cases": []}  # fmt: skip
    if device.type == "cuda":
        import flashinfer
        import triton

        result.update(flashinfer=flashinfer.__version__, triton=triton.__version__)
        result["prebuild"] = prebuild(args, names, device)
    for kv_len in args.kv:
        for batch in args.batch:
            for dtype in ("bf16", "fp8"):
                result["cases"].append(run_case(args, names, args.geometry, batch, kv_len,
                                                dtype, device))  # fmt: skip
    table = compare(result["cases"])
    print("\n".join(table))
    failed = [f"{c['batch']}x{c['kv']} {c['kv_dtype']} {n}" for c in result["cases"]
              for n, e in c["kernels"].items() if not e["ok"]]  # fmt: skip
    result["failed"] = failed
    print("checks:", "all ok" if not failed else f"FAILED: {', '.join(failed)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
