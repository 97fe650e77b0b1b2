"""Speculative decoding end to end on the CPU with the embedded SmolLM2-135M-Instruct: output
tokens/s with n-gram, suffix and draft-model drafts against speculation off, same run, same
greedy outputs.

Workloads (chat-templated, greedy, `--max-tokens` outputs at most):

- `copy_b1`: copy-heavy prompts one at a time (batch 1): rewrite a passage of CPython's reference
  documentation (`pydoc_data.topics`, 300-800 tokens) exactly, or extract the records of one
  colour from a generated catalogue (~750 tokens), alternating;
- `copy_b32`: 32 such prompts in one `chat` call (batch 32);
- `open_b1`: open-ended prompts ("Write a few paragraphs about ...") one at a time.

The engines (off, ngram, suffix: cost rule on, k = `--k`, default 16 since
results/2026-11-26c-cpu-spec-decode (5 before): on the CPU a draft costs a few percent of a step,
so the rule verifies long drafts while a request copies; `draft_model`: the embedded model
as its own draft, cost rule off, so every draft is accepted in float32 and the ratio shows the
draft machinery's overhead; `ngram_nograph`, `suffix_nograph`: on CUDA, verify steps without
their full CUDA graphs, `verify_graph_max_batch` 0; `ngram_widths`, `suffix_widths`: verify
graphs also at the narrower draft widths `--verify-widths` (`verify_graph_widths`, issue 20);
`--engines` picks some) are built once; each workload runs on them
back to back (the order rotated per repeat), so a load that drifts on a shared machine touches
them alike. Reported per workload and engine: output
tokens/s end to end (prefill included), mean time per output token after the first (TPOT), the
ratios to speculation off, the acceptance counters, and whether the outputs equal the off run's;
per run the drafter's host counters (syncs, proposals) and, at its end, its offer rate and what
the step time learner holds (`StepTimeLearner.as_dict`: the corrected t_host, t_verify, their
samples), which say why the cost rule drafted or not. `--step-trace DIR` writes each run's step
trace (`phloem.bench.step_trace_file`) and adds per kind of step (prefill, verify, plain) the
mean period and host phases; `--profile` adds each traced run's cProfile hot spots
(results/2026-11-27b-h200: a plain step costs 0.3-0.4 ms more with a drafter on the H200).

Sizes: on CUDA a step takes ~2 ms and the sizes of the CPU (4 prompts a batch-1 workload, 192
tokens, one batch of 32) ran ~1 s, too short for a ratio (off itself moved 615 -> 497 tok/s
between repeats, results/2026-11-26h-cpu-spec-gpu-gaps): there `--num-b1` and `--max-tokens`
default to 8 and 384 (~3x the tokens, ~60 s of runs for three engines and 2 repeats on an H200),
on the CPU to 4 and 192. (More batch-32 prompts would repeat passages, which the suffix
proposer's tree shares across requests.)

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_decode_cpu.py --only copy_b1 open_b1 \
        --repeats 2 --out benchmarks/results/2026-11-26c-cpu-spec-decode/spec_decode_cpu_b1.json
    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_decode_cpu.py --engines off draft_model --k 5 \
        --dtype float32 --only copy_b1 open_b1 \
        --out benchmarks/results/2026-11-26b-cpu-draft-model/draft_model_cpu.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = ("assignment", "class", "exceptions", "for", "function", "if", "import", "lambda",
          "numbers", "raise", "return", "try", "while", "with", "yield", "global", "atom-literals",
          "attribute-access", "augassign", "binary", "booleans", "comparisons", "context-managers",
          "dict", "execmodel", "formatstrings", "identifiers", "naming", "operator-summary",
          "specialnames", "string-methods", "strings", "typesseq", "truth")  # fmt: skip
SUBJECTS = ("the ocean", "a city at night", "learning to cook", "old maps", "trains", "bees",
            "mountain weather", "a public library")  # fmt: skip
WORDS = (
    "river stone market garden window silver morning letter engine harbor candle forest bridge "
    "orange paper winter rabbit castle music ladder pocket summer valley copper island mirror"
).split()
COLOURS = ("red", "blue", "green", "black", "white")


def passages(tokenizer, num: int) -> list[str]:
    """`num` prose passages of 300-800 tokens from CPython's reference documentation (indented
    code dropped), each one topic's text cut at a paragraph boundary."""
    from pydoc_data.topics import topics

    out = []
    for name in TOPICS:
        paragraphs = [p for p in topics[name].split("\n\n") if p and not p.startswith("   ")]
        text = ""
        for p in paragraphs:
            longer = (text + "\n\n" + p).strip()
            if len(tokenizer.encode(longer)) > 800:
                break
            text = longer
        if len(tokenizer.encode(text)) >= 300:
            out.append(text)
        if len(out) == num:
            return out
    return [out[i % len(out)] for i in range(num)]


def catalogue_prompt(rng: random.Random) -> str:
    lines = [
        f"- id: {1000 + i}, name: {' '.join(rng.sample(WORDS, 2))}, "
        f"colour: {rng.choice(COLOURS)}, price: {rng.randint(2, 99)}.{rng.randint(0, 99):02d}"
        for i in range(rng.randint(24, 30))
    ]
    colour = rng.choice(COLOURS)
    return (
        "Here is a product catalogue:\n" + "\n".join(lines) + f"\n\nList every {colour} product "
        'as a JSON line {"id": ..., "name": ..., "price": ...}, copying the values exactly.'
    )


def copy_prompts(tokenizer, num: int, seed: int) -> list[str]:
    """Alternately: rewrite a documentation passage exactly; extract from a catalogue."""
    rng = random.Random(seed)
    texts = passages(tokenizer, num)
    return [
        f"Rewrite the following text exactly, word for word:\n\n{texts[i]}"
        if i % 2 == 0
        else catalogue_prompt(rng)
        for i in range(num)
    ]


def run_workload(
    llm,
    prompts: list[str],
    batch: int,
    max_tokens: int,
    trace: Path | None = None,
    profile: bool = False,
) -> dict:
    """Generate `prompts` in chunks of `batch`; output tokens/s end to end and mean TPOT;
    `trace`: write the run's step trace there and add its summary (`trace_summary`); `profile`
    (with `trace`): the run's cProfile hot spots beside it (TRACE.prof.txt)."""
    from phloem import SamplingParams
    from phloem.bench.step_trace_file import StepTraceFile

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tracer = None if trace is None else StepTraceFile.for_engine(trace, llm.llm_engine)
    profiler = cProfile.Profile() if trace is not None and profile else None
    drafter = llm.llm_engine.drafter
    before = drafter.stats.as_dict() if drafter is not None else None
    counters_before = drafter.counters() if drafter is not None else None
    replays_before = _verify_graph_replays(llm)
    outputs, elapsed = [], 0.0
    for start in range(0, len(prompts), batch):
        chunk = [[{"role": "user", "content": p}] for p in prompts[start : start + batch]]
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        outputs += llm.chat(chunk, params, use_tqdm=False)
        if profiler is not None:
            profiler.disable()
        elapsed += time.perf_counter() - t0
    if tracer is not None:
        llm.llm_engine.remove_step_observer(tracer)
        tracer.close()
    if profiler is not None and trace is not None:  # the host's hot spots, beside the trace
        with open(trace.with_suffix(".prof.txt"), "w", encoding="utf-8") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(60)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpots = [o.tpot for o in outputs if o.tpot is not None]
    result = {
        "num_requests": len(prompts),
        "output_tokens": num_out,
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "mean_tpot_s": statistics.mean(tpots) if tpots else None,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "load_avg_1min_after": os.getloadavg()[0],  # the machine is shared: how busy it was
    }
    if drafter is not None:
        after = drafter.stats.as_dict()
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        rows = after["num_drafts"] - before["num_drafts"]
        result.update(num_draft_tokens=drafted, num_accepted_tokens=accepted, num_verify_rows=rows,
                      acceptance_rate=accepted / drafted if drafted else 0.0,
                      num_verify_steps=after["num_spec_steps"] - before["num_spec_steps"],
                      verify_graph_replays=_verify_graph_replays(llm) - replays_before)  # fmt: skip
        counters = drafter.counters()
        result.update({key: counters[key] - counters_before[key] for key in counters})
        result["offer_rate_end"] = drafter.offer_rate
        result["step_time_end"] = drafter.timer.as_dict()
    if trace is not None:
        result["trace_summary"] = trace_summary(trace)
    return result


def trace_summary(path: Path) -> dict:
    """Per kind of step in a step trace (prefill: any prompt chunk; verify: decode-only with
    drafts, more tokens than sequences; plain: decode-only, one token a sequence): steps, and
    mean period (t0 to the next step's t0) and host phases [ms]. The drafter's proposal runs
    before `schedule()` inside the step's call, so it is in `schedule_ms`."""
    from phloem.bench.step_trace_file import read_step_trace

    _, steps = read_step_trace(path)
    kinds: dict[str, list[dict]] = {"prefill": [], "verify": [], "plain": []}
    for step, after in zip(steps, steps[1:] + [None]):
        step["period_ms"] = None if after is None else (after["t0"] - step["t0"]) * 1e3
        kind = (
            "prefill"
            if step["prefill_chunks"]
            else "verify"
            if step["tokens"] > step["seqs"]
            else "plain"
        )
        kinds[kind].append(step)
    summary: dict[str, dict] = {}
    for kind, rows in kinds.items():
        entry: dict = {"steps": len(rows)}
        for key in (
            "period_ms",
            "schedule_ms",
            "launch_ms",
            "wait_ms",
            "update_ms",
            "seqs",
            "tokens",
        ):
            values = [r[key] for r in rows if r.get(key) is not None]
            entry[key] = round(statistics.mean(values), 3) if values else None
        summary[kind] = entry
    return summary


def _verify_graph_replays(llm) -> int:
    """Verify steps that replayed a full CUDA graph so far (0 without verify graphs)."""
    runner = llm.llm_engine.executor.worker.model_runner.verify_runner
    return 0 if runner is None else runner.num_replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="default 384 on CUDA, 192 on the CPU")  # fmt: skip
    parser.add_argument(
        "--num-b1",
        type=int,
        default=None,
        help="prompts of each batch-1 workload (default 8 on CUDA, 4 on the CPU)",
    )
    parser.add_argument("--verify-widths", type=int, nargs="+", default=[2, 4, 8, 16],
                        help="*_widths engines: verify_graph_widths (<= k; k added)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=32, help="prompts of the batched workload")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", nargs="*", help="run only these workloads (e.g. copy_b1)")
    parser.add_argument("--engines", nargs="*", default=["off", "ngram", "suffix"],
                        choices=["off", "ngram", "suffix", "draft_model", "ngram_nograph",
                                 "suffix_nograph", "ngram_widths", "suffix_widths"])  # fmt: skip
    parser.add_argument("--dtype", default="auto", help="the engines' dtype")
    parser.add_argument("--model", default=None,
                        help="a GGUF file or checkpoint dir (default: the embedded model)")  # fmt: skip
    parser.add_argument("--step-trace", type=Path, default=None,
                        help="write each run's step trace into this folder and summarize it "
                             "per kind of step in the JSON (`trace_summary`); with --profile "
                             "also each run's cProfile hot spots (RUN.prof.txt)")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="with --step-trace: profile the engine's host work (cProfile; "
                             "slows the host-bound steps, so the ratios of such runs are not "
                             "the plain ones)")  # fmt: skip
    args = parser.parse_args()
    if "off" not in args.engines:
        parser.error("--engines must include off (the ratios' baseline)")

    import torch

    from phloem import LLM
    from phloem.models.loader import load_tokenizer, resolve_model

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(min(2, torch.get_num_threads()))  # a shared machine: 2 at most
    for name, on_cuda, on_cpu in (("max_tokens", 384, 192), ("num_b1", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    tokenizer = load_tokenizer(resolve_model(args.model))
    workloads = {
        "copy_b1": (copy_prompts(tokenizer, args.num_b1, 1), 1),
        f"copy_b{args.batch}": (copy_prompts(tokenizer, args.batch, 2), args.batch),
        "open_b1": ([f"Write a few paragraphs about {s}." for s in SUBJECTS[: args.num_b1]], 1),
    }
    workloads = {w: v for w, v in workloads.items() if not args.only or w in args.only}
    widths = sorted({w for w in args.verify_widths if 1 <= w <= args.k} | {args.k})
    engines = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
        "suffix": {"method": "suffix", "num_speculative_tokens": args.k},
        "draft_model": {"model": "embedded", "num_speculative_tokens": args.k,
                        "use_cost_rule": False},
        # on CUDA: verify steps without their full CUDA graphs (the piecewise ones), to
        # measure what the verify graphs gain (issue 20)
        "ngram_nograph": {"method": "ngram", "num_speculative_tokens": args.k,
                          "verify_graph_max_batch": 0},
        "suffix_nograph": {"method": "suffix", "num_speculative_tokens": args.k,
                           "verify_graph_max_batch": 0},
        # verify graphs at several draft widths, a step padded to the narrowest that holds it
        "ngram_widths": {"method": "ngram", "num_speculative_tokens": args.k,
                         "verify_graph_widths": widths},
        "suffix_widths": {"method": "suffix", "num_speculative_tokens": args.k,
                          "verify_graph_widths": widths},
    }  # fmt: skip
    engines = {name: engines[name] for name in args.engines}
    # KV for every batched request at once: with 1 GiB (SmolLM2-135M: 23 KB a token) the 32
    # copy requests (up to ~1,400 tokens each with outputs) overflowed it on the H200 whenever
    # the outputs ran long, and those runs decoded in two waves (756 steps vs 384): the
    # whole-run ratio moved +-20% with the outputs (results/2026-11-27b-h200)
    kv_bytes = 2**32 if cuda else 2**30
    llms = {}
    for name, spec in engines.items():
        llms[name] = LLM(model=args.model, max_num_batched_tokens=2048,
                         kv_cache_memory_bytes=kv_bytes, speculative_config=spec,
                         dtype=args.dtype)  # fmt: skip
        run_workload(llms[name], ["Say hello."], 1, 8)  # warm-up
    runs: dict[str, dict[str, list[dict]]] = {w: {e: [] for e in engines} for w in workloads}
    for repeat in range(args.repeats):
        for w, (prompts, batch) in workloads.items():
            names = list(engines)  # back to back per workload, the order rotated per repeat
            names = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in names:
                trace = None
                if args.step_trace is not None:
                    args.step_trace.mkdir(parents=True, exist_ok=True)
                    trace = args.step_trace / f"{w}-{name}-r{repeat}.jsonl"
                r = run_workload(llms[name], prompts, batch, args.max_tokens, trace, args.profile)
                runs[w][name].append(r)
                print(f"repeat {repeat} {w} {name}: {r['output_tokens_per_s']:.2f} tok/s, "
                      f"TPOT {r['mean_tpot_s'] * 1000:.0f} ms", file=sys.stderr)  # fmt: skip
    out = {"command": "python " + " ".join(sys.argv), "date": str(datetime.date.today()),
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "k": args.k, "max_tokens": args.max_tokens, "dtype": args.dtype,
           "num_b1": args.num_b1,
           "workloads": {}}  # fmt: skip
    for w in workloads:
        base = runs[w]["off"]
        summary = {}
        for name in engines:
            rs = runs[w][name]
            tps = statistics.median(r["output_tokens_per_s"] for r in rs)
            tpot = statistics.median(r["mean_tpot_s"] for r in rs)
            entry = {
                "output_tokens_per_s": tps,
                "mean_tpot_s": tpot,
                "ratio": tps / statistics.median(r["output_tokens_per_s"] for r in base),
                "tpot_ratio": statistics.median(r["mean_tpot_s"] for r in base) / tpot,
                "same_outputs": all(r["token_ids"] == base[0]["token_ids"] for r in rs),
                "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rs],
            }
            summary[name] = entry
        out["workloads"][w] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for w, summary in out["workloads"].items():
        line = ", ".join(
            f"{n} {s['output_tokens_per_s']:.2f} tok/s ({s['ratio']:.2f}x, TPOT "
            f"{s['tpot_ratio']:.2f}x){'' if s['same_outputs'] else ' OUTPUTS DIFFER'}"
            for n, s in summary.items()
        )
        print(f"{w}: {line}")


if __name__ == "__main__":
    main()
