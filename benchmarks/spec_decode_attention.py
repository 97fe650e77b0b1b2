"""One layer's reference attention on the CPU (the backend a CPU decode or verify step runs), in the
embedded SmolLM2-135M's geometry (9 query heads, 3 KV heads of 64, blocks of 16 tokens, bf16 cache
with shuffled blocks): median time of `ReferenceAttention.forward` per (sequences, query tokens
per sequence, KV tokens per sequence), and with `--baseline FILE` the same for another version of
`reference.py` (e.g. `git show REV:phloem/ops/attention/reference.py > /tmp/ref_old.py`), the two
called alternately so a load that drifts on a shared machine touches both alike.

    git show 35ea522:phloem/ops/attention/reference.py > /tmp/ref_old.py
    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_decode_attention.py --baseline /tmp/ref_old.py \
        --out benchmarks/results/2026-11-26d-cpu-spec-decode/attention_layer.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (sequences, query tokens each, KV tokens of the longest; the others 3 tokens shorter each)
CASES = [(1, 1, 200), (1, 1, 760), (1, 1, 1500), (1, 5, 760), (1, 17, 760), (8, 1, 760),
         (32, 1, 760), (32, 5, 760), (1, 721, 721)]  # fmt: skip


def load_baseline(path: Path):
    """`ReferenceAttention` of another copy of reference.py (its imports resolve to phloem)."""
    spec = importlib.util.spec_from_file_location("reference_baseline", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ReferenceAttention()


def make_case(num_seqs: int, q_len: int, max_len: int, seed: int):
    """(query [T, 9, 64] bf16, cache [blocks, 2, 16, 3, 64] bf16, metadata) of one step."""
    import torch

    from phloem.ops.attention import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    lens = [max_len - 3 * i for i in range(num_seqs)]
    need = sum(-(-n // block_size) for n in lens)
    blocks = torch.randperm(need + 64, generator=gen).tolist()
    tables = []
    for n in lens:
        count = -(-n // block_size)
        tables.append(blocks[:count])
        blocks = blocks[count:]
    cache = torch.randn(need + 64, 2, block_size, 3, 64, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata.from_host(
        [q_len] * num_seqs, lens, tables, block_size, "cpu", padded_tables=True
    )
    query = torch.randn(num_seqs * q_len, 9, 64, generator=gen).to(torch.bfloat16)
    return query, cache, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, help="another reference.py to time beside")
    parser.add_argument("--calls", type=int, default=40, help="calls per case and version")
    args = parser.parse_args()

    import torch

    from phloem.ops.attention.reference import ReferenceAttention

    torch.set_num_threads(min(2, torch.get_num_threads()))  # a shared machine: 2 at most
    versions = {"current": ReferenceAttention()}
    if args.baseline is not None:
        versions["baseline"] = load_baseline(args.baseline)
    rows = []
    for seed, (num_seqs, q_len, max_len) in enumerate(CASES):
        query, cache, meta = make_case(num_seqs, q_len, max_len, seed)
        outs = {name: v.forward(query, cache, meta, 0.125) for name, v in versions.items()}
        times: dict[str, list[float]] = {name: [] for name in versions}
        calls = max(4, args.calls * 760 // (num_seqs * q_len * max_len // 8 + 760))
        for _ in range(calls):
            for name, version in versions.items():
                t0 = time.perf_counter()
                version.forward(query, cache, meta, 0.125)
                times[name].append(time.perf_counter() - t0)
        row = {"num_seqs": num_seqs, "q_len": q_len, "max_kv_len": max_len, "calls": calls}
        for name in versions:
            row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
        if "baseline" in versions:
            diff = (outs["current"].float() - outs["baseline"].float()).abs().max().item()
            row["max_abs_diff"] = diff
            row["speedup"] = row["baseline_ms"] / row["current_ms"]
        rows.append(row)
        print(row, flush=True)
    result = {"command": "python " + " ".join(sys.argv), "threads": torch.get_num_threads(),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "load_avg_1min_after": os.getloadavg()[0], "cases": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
