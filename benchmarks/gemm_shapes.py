"""GEMM throughput of a model's linear layers by token count M, against the 8192^3 ceiling of
shared/docs/ROOFLINE.md measured in the same run (GPU only).

For each linear layer of one decoder layer (fused QKV, O, fused gate/up, down) and each M, times
`F.linear(x [M, K], W [N, K])` in bf16 with CUDA events and prints TFLOP/s and the ratio to the
ceiling (median over `--rounds`, each visiting the points in a fresh random order: clocks drift
with load); `--chunks` also times each M as consecutive GEMMs over row chunks. `--sustained-s` also runs the whole per-layer GEMM sequence of a mixed step (M = 8192,
all layers) back to back for that many seconds and reports the first and last second: clocks
drop under sustained load, which the short ceiling measurement does not see. `--overlap` times a
memory-bound copy on a second stream against the gate/up GEMM: alone, and concurrently.

    python benchmarks/gemm_shapes.py OUT_DIR [--model llama-3.1-8b] [--m 1024,8192]

Writes OUT_DIR/gemm_shapes.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from phloem.bench.roofline import measure_ceilings
from phloem.model_configs import model_config_dir

DEFAULT_M = "1024,2048,4096,7936,8000,8064,8108,8192,8320,16384"


def layer_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(K, N) of each linear layer of one decoder layer (tensor parallel size 1)."""
    d, f = config["hidden_size"], config["intermediate_size"]
    hq = config["num_attention_heads"]
    hkv = config.get("num_key_value_heads", hq)
    hd = config.get("head_dim") or d // hq
    return {"qkv": (d, (hq + 2 * hkv) * hd), "o": (hq * hd, d), "gate_up": (d, 2 * f),
            "down": (f, d)}  # fmt: skip


def time_op(fn, reps: int, warmup: int = 3) -> float:
    """Mean seconds per call (CUDA events around `reps` calls)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--m", default=DEFAULT_M, help="token counts (comma list)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5, help="median over rounds in random order")
    p.add_argument("--chunks", default="", help="also time each M split into chunks of these")
    p.add_argument("--sustained-s", type=float, default=0.0)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--overlap-m", type=int, default=8192, help="GEMM rows in the overlap test")
    p.add_argument("--overlap-copy-mib", type=int, default=1024)
    p.add_argument("--carveouts", default="0", help="SMs the GEMMs leave free (comma list)")
    p.add_argument("--blas", default=None, choices=["cublas", "cublaslt"],
                   help="torch.backends.cuda.preferred_blas_library")  # fmt: skip
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    config = json.loads((model_config_dir(args.model) / "config.json").read_text())
    shapes = layer_shapes(config)
    ceilings = measure_ceilings(dev)
    peak = ceilings["flops_per_s"]
    print(f"ceiling {peak / 1e12:.0f} TFLOP/s, copy {ceilings['bytes_per_s'] / 1e12:.2f} TB/s")
    bf16 = dict(dtype=torch.bfloat16, device=dev)
    weights = {name: torch.randn(n, k, **bf16) * 0.02 for name, (k, n) in shapes.items()}
    ms = [int(x) for x in args.m.split(",") if x]
    chunks = [int(x) for x in args.chunks.split(",") if x]
    # Rounds visit the (M, chunk) points in a fresh random order each, so that the GPU's clock
    # drift under load (power and heat) spreads over all points instead of biasing the late ones.
    points = [(m, 0) for m in ms] + [(m, c) for m in ms for c in chunks if c < m]
    inputs = {}
    times: dict[tuple[int, int, str], list[float]] = {}
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(points)
        for m, chunk in points:
            for name, (k, _) in shapes.items():
                x = inputs.get((m, k))
                if x is None:
                    x = inputs[(m, k)] = torch.randn(m, k, **bf16)
                w = weights[name]
                parts = list(x.split(chunk)) if chunk else [x]
                fn = lambda w=w, parts=parts: [F.linear(part, w) for part in parts]  # noqa: E731
                times.setdefault((m, chunk, name), []).append(time_op(fn, args.reps))
    rows = []
    for m, chunk in sorted(set(points)):
        line = [f"M={m:6d}" + (f" in chunks of {chunk}" if chunk else "")]
        total_flops = total_s = 0.0
        for name, (k, n) in shapes.items():
            s = statistics.median(times[(m, chunk, name)])
            flops = 2 * m * k * n
            total_flops += flops
            total_s += s
            rows.append({"m": m, "chunk": chunk, "layer": name, "k": k, "n": n, "s": s,
                         "tflops": flops / s / 1e12, "ratio": flops / s / peak})  # fmt: skip
            line.append(f"{name} {flops / s / 1e12:4.0f}")
        rows.append({"m": m, "chunk": chunk, "layer": "all", "s": total_s,
                     "tflops": total_flops / total_s / 1e12,
                     "ratio": total_flops / total_s / peak})  # fmt: skip
        line.append(
            f"| all {total_flops / total_s / 1e12:4.0f} ({total_flops / total_s / peak:.3f})"
        )
        print("  ".join(line), flush=True)
    result = {"model": args.model, "device": torch.cuda.get_device_name(dev),
              "ceilings": ceilings, "gemms": rows}  # fmt: skip
    if args.sustained_s:
        m, layers = 8192, config["num_hidden_layers"]
        xs = {name: torch.randn(m, k, **bf16) for name, (k, _) in shapes.items()}
        step_flops = layers * sum(2 * m * k * n for k, n in shapes.values())
        samples = []
        stop = time.perf_counter() + args.sustained_s
        while time.perf_counter() < stop:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(layers):
                for name in shapes:
                    F.linear(xs[name], weights[name])
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        tf = [step_flops / s / 1e12 for s in samples]
        per_s = max(1, int(len(tf) / args.sustained_s))
        first, last = sum(tf[:per_s]) / per_s, sum(tf[-per_s:]) / per_s
        after = measure_ceilings(dev)["flops_per_s"]
        result["sustained"] = {"steps": len(tf), "first_s_tflops": first, "last_s_tflops": last,
                               "ceiling_after": after}  # fmt: skip
        print(
            f"sustained M=8192 x {layers} layers: first second {first:.0f}, last second "
            f"{last:.0f} TFLOP/s over {len(tf)} steps; ceiling after {after / 1e12:.0f}"
        )
    if args.overlap:
        # A decode step's attention (memory-bound) against its GEMMs (compute-bound): a copy on a
        # second stream stands in for attention; the GEMMs may leave SMs free for it
        # (torch._C._set_sm_carveout_experimental: cuBLASLt's SM count target).
        k, n = shapes["gate_up"]
        x = torch.randn(args.overlap_m, k, **bf16)
        src = torch.empty(args.overlap_copy_mib << 19, **bf16)
        dst = torch.empty_like(src)
        side = torch.cuda.Stream()

        def gemms():
            for _ in range(8):
                F.linear(x, weights["gate_up"])

        def copies():
            for _ in range(4):
                dst.copy_(src)

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copies()
            gemms()
            torch.cuda.current_stream().wait_stream(side)

        t_copy = time_op(copies, 5)
        result["overlap"] = []
        for carveout in [int(c) for c in args.carveouts.split(",")]:
            torch._C._set_sm_carveout_experimental(carveout or None)
            t_gemm, t_both = time_op(gemms, 5), time_op(both, 5)
            result["overlap"].append({"m": args.overlap_m, "carveout_sms": carveout,
                                      "gemm_s": t_gemm, "copy_s": t_copy, "both_s": t_both})  # fmt: skip
            print(f"overlap M={args.overlap_m} carveout {carveout:3d} SMs: gemm {t_gemm * 1e3:.2f} "
                  f"ms, copy {t_copy * 1e3:.2f} ms, sum {(t_gemm + t_copy) * 1e3:.2f} ms, "
                  f"concurrent {t_both * 1e3:.2f} ms")  # fmt: skip
        torch._C._set_sm_carveout_experimental(None)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gemm_shapes.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
