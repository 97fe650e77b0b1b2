"""What the step time learner learns on this machine (issue 20): the embedded model, `--method`
drafts (k = 16, cost rule on; on CUDA where there is one), copy-heavy prompts (those of benchmarks/spec_decode_cpu.py) at
`--batch`; every decode-only step the learner saw (shape, measured and modelled seconds, the
drafts) and its state after the run.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/results/2026-11-26e-cpu-spec-cost/dev/learned_state.py \
        --method suffix --batch 32 --max-tokens 96 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import torch  # noqa: E402

from benchmarks.spec_decode_cpu import copy_prompts, run_workload  # noqa: E402
from phloem import LLM  # noqa: E402
from phloem.models.loader import load_tokenizer, resolve_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        torch.set_num_threads(min(2, torch.get_num_threads()))
    tokenizer = load_tokenizer(resolve_model(args.model))
    llm = LLM(model=args.model, max_num_batched_tokens=2048, kv_cache_memory_bytes=2**30,
              speculative_config={"method": args.method, "num_speculative_tokens": 16})  # fmt: skip
    timer = llm.llm_engine.drafter.timer
    steps = []
    observe = timer.observe

    def recording(shape, seconds):  # a diagnostic only: what each sample was
        if shape.decode_only:
            model = timer.model.step_time_s(shape.num_tokens, shape.num_kv_tokens, shape.num_drafts)
            prior = timer.prior.step_time_s(shape.num_tokens, shape.num_kv_tokens, shape.num_drafts)
            steps.append([shape.num_sampled, shape.num_drafts, shape.num_kv_tokens,
                          round(seconds * 1e3, 1), round(model * 1e3, 1), round(prior * 1e3, 1)])  # fmt: skip
        observe(shape, seconds)

    timer.observe = recording
    run_workload(llm, ["Say hello."], 1, 8)
    r = run_workload(llm, copy_prompts(tokenizer, args.batch, 2), args.batch, args.max_tokens)
    r.pop("token_ids")
    r.update(learned=timer.as_dict(), prior_t_host_s=timer.prior.t_host_s,
             steps_columns="sampled, drafts, kv, measured ms, model ms (before), prior ms",
             steps=steps)  # fmt: skip
    args.out.write_text(json.dumps(r, indent=1) + "\n")
    print(json.dumps({k: v for k, v in r.items() if k != "steps"}), file=sys.stderr)


if __name__ == "__main__":
    main()
