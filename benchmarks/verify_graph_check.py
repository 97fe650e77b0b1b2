"""Verify steps of speculative decoding through their full CUDA graphs against the piecewise and eager paths (issue 20): one command on a GPU.

Builds a random-weight engine (`--load-format dummy`, the engine's default attention backend,
so the worker captures the decode, piecewise and verify graphs as a speculative engine does;
`--shape smollm2` gives SmolLM2-135M's shapes, the embedded model's, without its GGUF), then
times, per batch size B and drafts per row d, one verify step of B sequences over --context
tokens of KV each, every row computing its last token and d drafts, run each way from the same
model runner:

  eager       ModelRunner.prepare_inputs + forward
  piecewise   PiecewiseGraphRunner.run (what verify steps replayed before the verify graphs)
  verify      VerifyGraphRunner.run (padded to 1 + k tokens a row and to the batch bucket)

and, for scale, the decode step of the same B sequences (one token each) through its decode
graph. host ms is the time until the call returns, step ms until the device is done, medians
over --iters runs after --warmup; max |diff| compares the verify graph's hidden states of the
rows the verifier reads with the eager ones (bf16).

    python benchmarks/verify_graph_check.py                       # SmolLM2 shapes, k = 16
    python benchmarks/verify_graph_check.py --shape llama-3.1-8b --k 5 --drafts 1 5 \
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.piecewise_check import _eager, time_path  # noqa: E402

# SmolLM2-135M(-Instruct)'s shapes on the Llama-3.1-8B config
SMOLLM2 = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               tie_word_embeddings=True)  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", help="smollm2, or a shipped config")
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--drafts", type=int, nargs="+", default=None,
                        help="drafts per row (default: 2 and k)")  # fmt: skip
    parser.add_argument("--context", type=int, default=600, help="KV tokens of each sequence")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def build_engine(args):
    from phloem import LLM
    from phloem.model_configs import materialize

    base, overrides = (("llama-3.1-8b", SMOLLM2) if args.shape == "smollm2"
                       else (args.shape, {}))  # fmt: skip
    path = materialize(base, tempfile.mkdtemp(prefix="verify_graph_check_"), **overrides)
    start = time.perf_counter()
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    llm = LLM(str(path), load_format="dummy", max_model_len=4096, max_num_seqs=256,
              max_num_batched_tokens=2048, speculative_config=spec)  # fmt: skip
    return llm, time.perf_counter() - start


def verify_step(runner, batch: int, drafts: int, context: int):
    """The host inputs of B sequences of `context` computed tokens, each computing its last
    token and `drafts` drafts (sampling), on consecutive blocks; drafts=0: a decode step."""
    from phloem.core.scheduler_output import NewSequenceData, ScheduledSequence, SchedulerOutput
    from phloem.sampling_params import SamplingParams
    from phloem.worker.input_batch import HostStep

    bs = runner.block_size
    params = SamplingParams(temperature=0.0)
    scheduled, next_block = [], 0
    for b in range(batch):
        blocks = list(range(next_block, next_block + -(-(context + 1 + drafts) // bs)))
        next_block += len(blocks)
        prompt = [(7 * i + b) % 30000 + 10 for i in range(context + 1)]
        new = NewSequenceData(prompt, [], params)
        scheduled.append(ScheduledSequence(
            f"s{b}", context, 1 + drafts, True, blocks, new_sequence=new,
            draft_token_ids=tuple(range(100, 100 + drafts)),
        ))  # fmt: skip
    if next_block > runner.num_blocks:
        raise ValueError(f"the step needs {next_block} blocks, the cache has {runner.num_blocks}")
    sched = SchedulerOutput(scheduled=scheduled)
    states = runner.input_batch.update(sched)
    return HostStep.build(sched, states, bs, runner.backend.reads_prefix_lens)


@torch.inference_mode()
def check(runner, batch: int, drafts: int, args) -> dict:
    host = verify_step(runner, batch, drafts, args.context)
    pieces, verify = runner.piecewise_runner, runner.verify_runner
    result = {"batch": batch, "drafts": drafts, "tokens": len(host.input_ids),
              "bucket": verify.bucket(batch)}  # fmt: skip
    result["eager"] = time_path(lambda: _eager(runner, host), args.iters, args.warmup)
    fits = pieces is not None and pieces.bucket(len(host.input_ids))
    result["piecewise"] = (time_path(lambda: pieces.run(host), args.iters, args.warmup)
                           if fits else None)  # fmt: skip
    result["verify"] = None
    if verify.run(host) is not None:
        result["verify"] = time_path(lambda: verify.run(host), args.iters, args.warmup)
        eager = _eager(runner, host).float()
        graph = verify.run(host).float()
        result["max_abs_diff"] = float((eager - graph).abs().max())
        result["max_abs_eager"] = float(eager.abs().max())
    decode = verify_step(runner, batch, 0, args.context)
    result["decode_graph"] = time_path(lambda: runner.graph_runner.run_decode(decode),
                                       args.iters, args.warmup)  # fmt: skip
    return result


def _ms(t: dict | None) -> str:
    return "-" if t is None else f"{t['host_ms']:.2f} / {t['step_ms']:.2f}"


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("verify_graph_check needs a CUDA GPU")
    llm, start_s = build_engine(args)
    runner = llm.llm_engine.executor.worker.model_runner
    if runner.verify_runner is None or runner.graph_runner is None:
        raise SystemExit("the engine captured no verify (or decode) graphs (see the log)")
    drafts = args.drafts or sorted({min(2, args.k), args.k})
    results = {
        "device": torch.cuda.get_device_name(),
        "shape": args.shape,
        "k": args.k,
        "context": args.context,
        "backend": runner.backend.name,
        "engine_start_s": start_s,
        "verify_buckets": runner.verify_runner.batch_sizes,
        "steps": [check(runner, b, d, args) for b in args.batches for d in drafts],
    }
    print(f"{results['device']}, {args.shape}, k = {args.k}, backend {results['backend']}, "
          f"verify buckets {results['verify_buckets']}, engine start {start_s:.1f} s")  # fmt: skip
    print("B | drafts | tokens | host / step ms: eager | piecewise | verify graph | decode graph"
          " | max |diff| (max |h|)")  # fmt: skip
    for r in results["steps"]:
        diff = f"{r['max_abs_diff']:.3g} ({r['max_abs_eager']:.3g})" if r["verify"] else "-"
        print(f"{r['batch']} | {r['drafts']} | {r['tokens']} | {_ms(r['eager'])} | "
              f"{_ms(r['piecewise'])} | {_ms(r['verify'])} | {_ms(r['decode_graph'])} | {diff}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
