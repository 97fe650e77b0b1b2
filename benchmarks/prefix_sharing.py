"""CPU prefix-sharing benchmark on the embedded model (a scaled-down BatchLLM workload).

G groups x D requests; each group shares a P-token prefix, each request adds S own tokens and
generates O tokens (greedy, EOS ignored); requests are shuffled. Three runs, same prompts:
  (a) no reuse            enable_prefix_caching=False
  (b) radix LRU cache     requests queued one by one in shuffled order (no global plan)
  (c) global planner      LLM.generate: BatchLLM groups, each prefix computed once
Prints computed prompt tokens and wall time for each and writes a JSON record to
benchmarks/results/.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/prefix_sharing.py [--groups 16 --degree 8 ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def make_workload(groups, degree, prefix_len, suffix_len, seed):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(100, 49152) for _ in range(prefix_len)]
        prompts += [
            prefix + [rng.randrange(100, 49152) for _ in range(suffix_len)] for _ in range(degree)
        ]
    rng.shuffle(prompts)
    return prompts


def run(mode: str, prompts, output_len: int, budget: int) -> dict:
    from phloem import LLM, SamplingParams

    llm = LLM(max_num_batched_tokens=budget, enable_prefix_caching=mode != "no_reuse")
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine = llm.llm_engine
    start = time.perf_counter()
    if mode == "radix_lru":  # queued one by one, as online traffic arrives: no global plan
        ids = [engine.add_request(p, params) for p in prompts]
        outputs = llm.run_engine(ids, use_tqdm=False)
    else:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    plan = llm.last_plan if mode == "global_plan" else None
    return {
        "wall_s": wall,
        "num_computed_prompt_tokens": engine.num_computed_prompt_tokens,
        "num_reused_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        "planned_physical_prompt_tokens": plan.num_physical_prompt_tokens if plan else None,
        "total_tokens_per_s": (sum(map(len, prompts)) + len(prompts) * output_len) / wall,
        "outputs": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--degree", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    prompts = make_workload(args.groups, args.degree, args.prefix_len, args.suffix_len, args.seed)
    logical = sum(map(len, prompts))
    minimum = args.groups * args.prefix_len + len(prompts) * args.suffix_len
    results = {}
    for mode in ("no_reuse", "radix_lru", "global_plan"):
        results[mode] = run(mode, prompts, args.output_len, args.max_num_batched_tokens)
        r = results[mode]
        print(
            f"{mode:12s} computed prompt tokens {r['num_computed_prompt_tokens']:7d} "
            f"(logical {logical}, minimum {minimum})  wall {r['wall_s']:7.1f} s  "
            f"{r['total_tokens_per_s']:8.1f} tok/s",
            flush=True,
        )
    same = all(results[m]["outputs"] == results["no_reuse"]["outputs"] for m in results)
    for r in results.values():
        del r["outputs"]
    record = {
        "benchmark": "prefix_sharing",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "torch_threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantized, float32)",
        "workload": {
            "groups": args.groups, "degree": args.degree, "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len, "output_len": args.output_len, "shuffled": True,
            "num_logical_prompt_tokens": logical, "num_minimum_prompt_tokens": minimum,
        },
        "results": results,
        "speedup_global_plan_vs_no_reuse": results["no_reuse"]["wall_s"] / results["global_plan"]["wall_s"],
        "speedup_global_plan_vs_radix_lru": results["radix_lru"]["wall_s"] / results["global_plan"]["wall_s"],
        "greedy_outputs_identical": same,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in record.items() if k != "results"}, indent=2))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    (out_dir / f"prefix_sharing-{stamp}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
