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

Random weights give near-tied logits, so bf16 rounding alone (another reduction order, another
batch shape) flips top-1 tokens whose lead is tiny. The reference therefore keeps its top-5
log-probs at every position, and `check` also reports:
- `agreement_by_margin`: the agreement over the positions whose reference top-1 leads its
  top-2 by at least each threshold (nats), with the count of such positions;
- `close_agreement`: the criterion of vLLM's `check_logprobs_close`: a position passes where the
  tokens are equal, or each engine's token is in the other's top-5;
- `mean_abs_logprob_diff`: the mean |difference| of the reference token's log-prob between the
  two engines (nats), over the positions where both report it.
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


TOP_K = 5
MARGINS = (0.0, 0.01, 0.03, 0.1, 0.3)  # nats


def _greedy(llm, prompts: list[list[int]], max_tokens: int, logprobs: bool = False):
    """Greedy continuations [n][max_tokens]; with `logprobs`, also each position's top-5
    log-probs as {token_id: logprob} ([n][max_tokens])."""
    from phloem import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_K if logprobs else None
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if not logprobs:
        return tokens
    return tokens, [o.outputs[0].logprobs for o in outs]


def _top(logprobs: dict) -> list[list[float]]:
    """{token_id: logprob} -> [[token_id, logprob]] best first, at most TOP_K."""
    pairs = sorted(((int(t), float(v)) for t, v in logprobs.items()), key=lambda p: -p[1])
    return [[t, v] for t, v in pairs[:TOP_K]]


def compare(want: list[int], ref_top: list, got: list[int], got_top: list) -> dict:
    """The agreement measures of `check` over positions i: want[i] the reference's token and
    ref_top[i] its top-5 ([[token_id, logprob]] best first), got[i] / got_top[i] the same from the
    checked engine. Margins are in nats (log-prob of top-1 minus top-2 of the reference)."""
    by_margin, diffs, close = {}, [], 0
    margins = [t[0][1] - t[1][1] if len(t) > 1 else float("inf") for t in ref_top]
    for m in MARGINS:
        idx = [i for i, v in enumerate(margins) if v >= m]
        hits = sum(got[i] == want[i] for i in idx)
        by_margin[str(m)] = {"positions": len(idx), "agreement": hits / len(idx) if idx else None}
    for w, rt, g, gt in zip(want, ref_top, got, got_top):
        ref_lp_of, got_lp = {t: v for t, v in rt}, {t: v for t, v in gt}
        close += g == w or (g in ref_lp_of and w in got_lp)
        ref_lp = ref_lp_of.get(w)
        if ref_lp is not None and w in got_lp:
            diffs.append(abs(ref_lp - got_lp[w]))
    return {
        "agreement_by_margin": by_margin,
        "close_agreement": close / len(want),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None,
    }


def reference(args: argparse.Namespace) -> dict:
    llm = _llm(args)
    vocab = llm.llm_engine.hf_config.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]  # fmt: skip
    start = time.perf_counter()
    outputs, logprobs = _greedy(llm, prompts, args.max_tokens, logprobs=True)
    top = [[_top(step) for step in seq] for seq in logprobs]
    return {"tensor_parallel_size": args.tensor_parallel_size, "prompts": prompts,
            "outputs": outputs, "top_logprobs": top, "generate_s": time.perf_counter() - start,
            "cuda_graphs": llm.llm_engine.executor.worker.cuda_graphs}  # fmt: skip


def check(args: argparse.Namespace) -> dict:
    with open(args.ref) as f:
        ref = json.load(f)
    llm = _llm(args)
    prompts, expected = ref["prompts"], ref["outputs"]
    free = _greedy(llm, prompts, len(expected[0]))
    forced, want, ref_top = [], [], []
    for prompt, out, top in zip(prompts, expected, ref["top_logprobs"]):
        for k in range(0, len(out), args.stride):
            forced.append(prompt + out[:k])
            want.append(out[k])
            ref_top.append(top[k])
    tokens, logprobs = _greedy(llm, forced, 1, logprobs=True)
    got, got_top = [t[0] for t in tokens], [_top(lp[0]) for lp in logprobs]
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
        **compare(want, ref_top, got, got_top),
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
    skip = ("prompts", "outputs", "top_logprobs")
    print(json.dumps({k: v for k, v in result.items() if k not in skip}))


if __name__ == "__main__":
    main()
