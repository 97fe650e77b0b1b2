"""Where a speculative batch-1 step's time goes on the CPU (embedded SmolLM2-135M-Instruct, the
copy-heavy prompts of `spec_decode_cpu.py`): per step, from the engine's step observer, the host
time before the model (proposing drafts + scheduling), the model's time (launch + wait), the
update after it, and the drafts verified; per prompt, steps with and without drafts and output
tokens per step.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_decode_steps.py --method ngram --k 16 \
        --out benchmarks/results/2026-11-26c-cpu-spec-decode/steps_ngram_k16.json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=192)
    args = parser.parse_args()

    from phloem import LLM, SamplingParams
    from phloem.models.loader import load_tokenizer, resolve_model

    prompts = copy_prompts(load_tokenizer(resolve_model(None)), args.num_prompts, 1)
    spec = {"method": args.method, "num_speculative_tokens": args.k}
    llm = LLM(max_num_batched_tokens=2048, kv_cache_memory_bytes=2**30, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat([[{"role": "user", "content": "Say hello."}]], params, use_tqdm=False)  # warm-up
    steps: list[dict] = []

    def observe(record) -> None:
        (s,) = record.scheduler_output.scheduled
        steps.append({"tokens": s.num_tokens, "drafts": len(s.draft_token_ids),
                      "host_ms": 1e3 * record.schedule_s, "update_ms": 1e3 * record.update_s,
                      "model_ms": 1e3 * (record.launch_s + record.wait_s)})  # fmt: skip

    llm.llm_engine.add_step_observer(observe)
    per_prompt = []
    for prompt in prompts:
        first = len(steps)
        out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0]
        decode = steps[first + 1 :]  # the first step is the prompt's prefill
        per_prompt.append({
            "output_tokens": len(out.outputs[0].token_ids),
            "prefill_ms": steps[first]["model_ms"], "decode_steps": len(decode),
            "steps_without_drafts": sum(not s["drafts"] for s in decode),
            "decode_model_s": sum(s["model_ms"] for s in decode) / 1e3,
            "host_s": sum(s["host_ms"] + s["update_ms"] for s in steps[first:]) / 1e3,
        })  # fmt: skip
        print(per_prompt[-1])
    by_tokens: dict[int, list[float]] = {}
    for s in steps:
        if s["tokens"] <= 64:  # decode and verify steps (prefills are hundreds of tokens)
            by_tokens.setdefault(s["tokens"], []).append(s["model_ms"])
    model_ms = {t: {"steps": len(v), "median_ms": statistics.median(v)}
                for t, v in sorted(by_tokens.items())}  # fmt: skip
    for t, v in model_ms.items():
        print(f"{t:3d} tokens: {v['steps']:3d} steps, model {v['median_ms']:.1f} ms (median)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": "python " + " ".join(sys.argv), "per_prompt": per_prompt,
              "model_ms_by_step_tokens": model_ms, "steps": steps}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
