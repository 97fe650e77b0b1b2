"""Where a speculative step's time goes on the CPU (embedded SmolLM2-135M-Instruct, the copy-heavy
prompts of `spec_decode_cpu.py`), and the cost rule's step time model fitted to it: per step, from
the engine's step observer, the host time before the model (proposing drafts + scheduling), the
model's time (launch + wait), the update after it, the tokens computed, drafts verified and KV
tokens read; per chat call (`--batch` prompts), steps with and without drafts.

`--fit` fits t = t_host + c_token x T + c_kv x K by least squares to the decode and verify steps
(T tokens computed, drafts included; K KV tokens read) of every file given, and the host time
per step (scheduling, proposing, updating) to a + c_draft x D (D drafts): the constants of
`step_time.step_time_model` on the CPU.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_decode_steps.py --method ngram --k 16 \
        --out benchmarks/results/2026-11-26d-cpu-spec-decode/steps_ngram_k16_b1.json
    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_decode_steps.py --method ngram --k 16 \
        --batch 8 --num-prompts 8 --max-tokens 96 \
        --out benchmarks/results/2026-11-26d-cpu-spec-decode/steps_ngram_k16_b8.json
    python benchmarks/spec_decode_steps.py --fit benchmarks/results/2026-11-26d-cpu-spec-decode/steps_*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_decode_cpu import copy_prompts  # noqa: E402


def is_decode(step: dict) -> bool:
    """A decode or verify step: each sequence computes its last token and its drafts, no
    prompt chunk (a step with one computes more)."""
    return step["tokens"] == step["sequences"] + step["drafts"]


def fit(paths: list[Path]) -> dict:
    """Least-squares constants [ms] of the model's time t = t_host + c_token T + c_kv K and of
    the host time per step a + c_draft D, over the decode and verify steps of `paths`."""
    import numpy as np

    steps = [s for path in paths for s in json.loads(path.read_text())["steps"] if is_decode(s)]
    model = np.array([[1.0, s["tokens"], s["kv_tokens"]] for s in steps])
    model_ms = np.array([s["model_ms"] for s in steps])
    coef, *_ = np.linalg.lstsq(model, model_ms, rcond=None)
    host = np.array([[1.0, s["drafts"]] for s in steps])
    host_ms = np.array([s["host_ms"] + s["update_ms"] for s in steps])
    host_coef, *_ = np.linalg.lstsq(host, host_ms, rcond=None)
    residual = np.abs(model_ms - model @ coef)
    return {"t_host_ms": coef[0], "c_token_ms": coef[1], "c_kv_ms": coef[2],
            "host_per_step_ms": host_coef[0], "c_draft_ms": host_coef[1], "steps": len(steps),
            "kv_tokens_range": [model[:, 2].min(), model[:, 2].max()],
            "residual_ms_median_abs": float(np.median(residual))}  # fmt: skip


def run(args) -> dict:
    """The engine's steps over `args.num_prompts` copy-heavy prompts, `args.batch` per call."""
    import torch

    from phloem import LLM, SamplingParams
    from phloem.models.loader import load_tokenizer, resolve_model

    torch.set_num_threads(min(2, torch.get_num_threads()))  # a shared machine: 2 at most
    prompts = copy_prompts(load_tokenizer(resolve_model(None)), args.num_prompts, 1)
    spec = None
    if args.method != "off":
        spec = {"method": args.method, "num_speculative_tokens": args.k}
    llm = LLM(max_num_batched_tokens=2048, kv_cache_memory_bytes=2**30, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat([[{"role": "user", "content": "Say hello."}]], params, use_tqdm=False)  # warm-up
    steps: list[dict] = []

    def observe(record) -> None:
        scheduled = record.scheduler_output.scheduled
        steps.append({"tokens": sum(s.num_tokens for s in scheduled), "sequences": len(scheduled),
                      "drafts": sum(len(s.draft_token_ids) for s in scheduled),
                      "kv_tokens": sum(s.num_computed_tokens + s.num_tokens for s in scheduled),
                      "host_ms": 1e3 * record.schedule_s, "update_ms": 1e3 * record.update_s,
                      "model_ms": 1e3 * (record.launch_s + record.wait_s)})  # fmt: skip

    llm.llm_engine.add_step_observer(observe)
    per_call = []
    for start in range(0, len(prompts), args.batch):
        first = len(steps)
        chunk = [[{"role": "user", "content": p}] for p in prompts[start : start + args.batch]]
        outs = llm.chat(chunk, params, use_tqdm=False)
        calls = steps[first:]
        decode = [s for s in calls if is_decode(s)]
        per_call.append({
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prefill_ms": sum(s["model_ms"] for s in calls if s not in decode),
            "decode_steps": len(decode),
            "steps_without_drafts": sum(not s["drafts"] for s in decode),
            "decode_model_s": sum(s["model_ms"] for s in decode) / 1e3,
            "host_s": sum(s["host_ms"] + s["update_ms"] for s in calls) / 1e3,
        })  # fmt: skip
        print(per_call[-1])
    by_tokens: dict[int, list[float]] = {}
    for s in steps:
        if is_decode(s):
            by_tokens.setdefault(s["tokens"], []).append(s["model_ms"])
    model_ms = {t: {"steps": len(v), "median_ms": statistics.median(v)}
                for t, v in sorted(by_tokens.items())}  # fmt: skip
    for t, v in model_ms.items():
        print(f"{t:3d} tokens: {v['steps']:3d} steps, model {v['median_ms']:.1f} ms (median)")
    return {"command": "python " + " ".join(sys.argv), "per_call": per_call,
            "model_ms_by_step_tokens": model_ms, "steps": steps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--method", default="ngram", choices=["off", "ngram", "suffix"])
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="prompts per chat call")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--fit", nargs="+", type=Path, help="fit the step model to these files")
    args = parser.parse_args()
    if args.fit:
        print(json.dumps(fit(args.fit), indent=2, default=float))
        return
    if args.out is None:
        parser.error("--out is required to measure")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
