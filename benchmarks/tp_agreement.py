"""Greedy agreement of a tensor-parallel engine with a reference run (issue 17's TP = 2 vs TP = 1
check), teacher-forced: the reference's greedy continuations are fed back as prompts, one
position at a time, and the checked engine's next token is compared with the reference's.

    python benchmarks/tp_agreement.py reference --model llama-3.1-8b --out ref.json
    python benchmarks/tp_agreement.py check --model llama-3.1-8b --ref ref.json \
        --tensor-parallel-size 2 --out tp2.json

`--model` is a shipped config name (random weights: `load_format="dummy"`, which draws the same
model at every TP size) or a checkpoint directory (`--dummy`: its config with random weights). `reference` writes the prompts and their
greedy continuations; `check` reports `teacher_forced_agreement` (the fraction of checked
positions whose next token equals the reference's, given the reference's tokens before it),
the free-running greedy match (whole sequences equal, mean common prefix) and whether decode
steps replayed CUDA graphs (`cuda_graphs`: the graphs capture the all-reduces under TP).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time


def _llm(args: argparse.Namespace):
    from phloem import LLM
    from phloem.model_configs import materialize, model_config_dir

    model, load_format = args.model, "auto"
    if model_config_dir(model) is not None or args.dummy:
        model = str(materialize(model, tempfile.mkdtemp(prefix="phloem-tp-")))
        load_format = "dummy"
    return LLM(
        model,
        load_format=load_format,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
    )


def _greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from phloem import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference(args: argparse.Namespace) -> dict:
    llm = _llm(args)
    vocab = llm.llm_engine.hf_config.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]  # fmt: skip
    start = time.perf_counter()
    outputs = _greedy(llm, prompts, args.max_tokens)
    return {"tensor_parallel_size": args.tensor_parallel_size, "prompts": prompts,
            "outputs": outputs, "generate_s": time.perf_counter() - start,
            "cuda_graphs": llm.llm_engine.executor.worker.cuda_graphs}  # fmt: skip


def check(args: argparse.Namespace) -> dict:
    with open(args.ref) as f:
        ref = json.load(f)
    llm = _llm(args)
    prompts, expected = ref["prompts"], ref["outputs"]
    free = _greedy(llm, prompts, len(expected[0]))
    forced, want = [], []
    for prompt, out in zip(prompts, expected):
        for k in range(0, len(out), args.stride):
            forced.append(prompt + out[:k])
            want.append(out[k])
    got = [o[0] for o in _greedy(llm, forced, 1)]
    common = []
    for a, b in zip(free, expected):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        common.append(n)
    agree = sum(g == w for g, w in zip(got, want)) / len(want)
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "reference_tensor_parallel_size": ref["tensor_parallel_size"],
        "teacher_forced_positions": len(want),
        "teacher_forced_agreement": agree,
        "free_running_exact": sum(a == b for a, b in zip(free, expected)) / len(expected),
        "free_running_mean_common_prefix": sum(common) / len(common),
        "max_tokens": len(expected[0]),
        "cuda_graphs": llm.llm_engine.executor.worker.cuda_graphs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("reference", "check"))
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dummy", action="store_true", help="random weights for a model directory")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stride", type=int, default=4, help="check every STRIDE-th position")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ref", help="the reference run's JSON (check)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    result = reference(args) if args.mode == "reference" else check(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k not in ("prompts", "outputs")}))


if __name__ == "__main__":
    main()
