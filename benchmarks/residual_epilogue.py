"""Two epilogue alternatives around the GEMMs of one decoder layer, timed against what phloem
does, in the same run (bf16, CUDA events, median of `--repeats`).

  * The residual add: phloem runs `F.linear` for o_proj / down_proj, then the compiled RMSNorm
    with the residual add fused in ("add+norm": reads the GEMM output and the residual, writes
    the new residual and the normalized tensor). The alternative ("addmm+norm") puts the add in
    cuBLAS's epilogue (`torch.addmm(residual, x, W^T)`, beta = 1) so the norm reads and writes
    one tensor each. Measured on an H200 (benchmarks/results/2026-11-25-h200): the beta = 1
    GEMM costs more than the norm saves (o_proj at M = 8192: +84 us in the GEMM), so phloem
    keeps add+norm.
  * The LM head of `--rows` sampled rows and the greedy argmax: logits upcast to float32 first
    (phloem before) vs argmax of the bf16 logits (phloem now: `LMHead` returns the model dtype).
Both alternatives are checked against the baseline (normalized outputs, sampled ids).

    python benchmarks/residual_epilogue.py OUT_DIR [--model llama-3.1-8b] [--m 1024,8192]

Writes OUT_DIR/residual_epilogue.json (GPU only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from phloem.bench.roofline import cuda_time_s
from phloem.layers.norm import RMSNorm
from phloem.model_configs import model_config_dir


def _time_ms(fn, repeats: int) -> float:
    return cuda_time_s(fn, repeats) * 1e3


def _compare(weight, x, residual, norm, compiled, fused_add_norm, repeats: int) -> dict:
    """Times of the two forms (and of the bare GEMMs) for one layer and token count."""

    def before():
        return fused_add_norm(F.linear(x, weight), residual)[0]

    def after():
        return compiled(norm, torch.addmm(residual, x, weight.t()))

    diff = (before().float() - after().float()).abs().max().item()
    return {
        "add_norm_ms": _time_ms(before, repeats),
        "addmm_norm_ms": _time_ms(after, repeats),
        "gemm_ms": _time_ms(lambda: F.linear(x, weight), repeats),
        "addmm_ms": _time_ms(lambda: torch.addmm(residual, x, weight.t()), repeats),
        "max_abs_diff_normed": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--m", default="1024,8192", help="token counts per step")
    parser.add_argument("--rows", type=int, default=1650, help="sampled rows of the LM head")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    config = json.loads((model_config_dir(args.model) / "config.json").read_text())
    d, f, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    eps = config.get("rms_norm_eps", 1e-5)
    norm = RMSNorm(d, eps, bf16).to(dev)
    compiled = torch.compile(RMSNorm.forward, dynamic=True)

    def fused_add_norm(x: torch.Tensor, residual: torch.Tensor):
        h = residual + x
        return norm._norm(h), h

    fused_add_norm = torch.compile(fused_add_norm, dynamic=True)
    shapes = {"o_proj": (d, d), "down_proj": (d, f)}  # (out, in)
    results: dict = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "command": " ".join(["python", *sys.argv]),
        "gemms": [],
    }
    for name, (n_out, n_in) in shapes.items():
        weight = torch.randn(n_out, n_in, device=dev, dtype=bf16) * 0.02
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, n_in, device=dev, dtype=bf16)
            residual = torch.randn(m, d, device=dev, dtype=bf16)
            row = {"layer": name, "m": m, **_compare(weight, x, residual, norm, compiled,
                                                      fused_add_norm, args.repeats)}  # fmt: skip
            row["saved_ms"] = row["add_norm_ms"] - row["addmm_norm_ms"]
            results["gemms"].append(row)
            print(json.dumps(row), flush=True)
    head = torch.randn(vocab, d, device=dev, dtype=bf16) * 0.02
    hidden = torch.randn(args.rows, d, device=dev, dtype=bf16)
    ids_f32 = F.linear(hidden, head).float().argmax(-1)
    ids_bf16 = F.linear(hidden, head).argmax(-1)
    lm = {
        "rows": args.rows,
        "float32_argmax_ms": _time_ms(lambda: F.linear(hidden, head).float().argmax(-1), args.repeats),
        "bf16_argmax_ms": _time_ms(lambda: F.linear(hidden, head).argmax(-1), args.repeats),
        "same_ids": bool(torch.equal(ids_f32, ids_bf16)),
    }  # fmt: skip
    results["lm_head"] = lm
    print(json.dumps(lm), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "residual_epilogue.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
