"""Piecewise CUDA graphs against the eager forward on mixed steps (issue 24): one command on a GPU.

Steps that mix a prompt chunk with running decodes ("mixed steps") ran the model eagerly, and
their host time (launching every kernel layer by layer from Python) exceeded their GPU time. This
builds a random-weight engine of Llama-3.1-8B shapes (`--load-format dummy`, FlashInfer and the
engine's defaults, so the worker captures the decode and the piecewise graphs as `phloem serve`
does), then times, for each step size T, a step of one prompt chunk of T - D tokens and D decodes
(one token each over --context tokens of KV), run both ways from the same model runner:

  eager       ModelRunner.prepare_inputs + forward (what mixed steps ran before)
  piecewise   PiecewiseGraphRunner.run (pieces replayed, attention eager between them)

host ms is the time until the call returns (the launch), step ms until the device is done (a
synchronize after it), medians over --iters runs after --warmup. Each size also reports the max
|difference| of the hidden states of all T rows between the two (bf16), and how large the eager
ones are.

    python benchmarks/piecewise_check.py                 # 32 layers, T = 256, 550, 1024
    python benchmarks/piecewise_check.py --tokens 1100 1600 --max-num-batched-tokens 2048 \
        --json out.json

The second measured the coarse buckets (1,280, 1,536, 2,048) that the first version captured:
1,100 tokens padded to 1,280 and 1,600 to 2,048 ran 8-10% slower than eager on an H200
(benchmarks/results/2026-11-26c-h200-piecewise), so buckets now end at 1,024 and those sizes
run eagerly (such a size has no bucket: only its eager column is timed).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time

import torch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a shipped config or a dir")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 550, 1024])
    parser.add_argument("--decodes", type=int, default=25, help="decodes in each mixed step")
    parser.add_argument("--context", type=int, default=600, help="KV tokens of each decode")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def build_engine(args):
    from phloem import LLM
    from phloem.model_configs import materialize

    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    path = materialize(args.model, tempfile.mkdtemp(prefix="piecewise_check_"), **overrides)
    start = time.perf_counter()
    llm = LLM(str(path), load_format="dummy", max_model_len=4096, max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    return llm, time.perf_counter() - start


def mixed_step(runner, num_tokens: int, num_decodes: int, context: int, first_block: int = 0):
    """The host inputs of one chunk of num_tokens - num_decodes prompt tokens and num_decodes
    one-token steps over `context` KV tokens each, on consecutive blocks from first_block."""
    from phloem.core.scheduler_output import (
        NewSequenceData,
        ScheduledSequence,
        SchedulerOutput,
    )
    from phloem.sampling_params import SamplingParams
    from phloem.worker.input_batch import HostStep

    bs = runner.block_size
    params = SamplingParams(temperature=0.0)
    next_block = first_block
    scheduled = []
    specs = [(f"d{i}", context, 1) for i in range(num_decodes)]
    specs.append(("chunk", 0, num_tokens - num_decodes))
    for seq_id, computed, n in specs:
        blocks = list(range(next_block, next_block + -(-(computed + n) // bs)))
        next_block += len(blocks)
        prompt = [(7 * k + len(seq_id)) % 30000 + 10 for k in range(computed + n)]
        new = NewSequenceData(prompt, [], params)
        scheduled.append(ScheduledSequence(seq_id, computed, n, True, blocks, new_sequence=new))
    if next_block > runner.num_blocks:
        raise ValueError(f"the step needs {next_block} blocks, the cache has {runner.num_blocks}")
    sched = SchedulerOutput(scheduled=scheduled)
    states = runner.input_batch.update(sched)
    return HostStep.build(sched, states, bs, runner.backend.reads_prefix_lens)


def _eager(runner, host):
    inputs = runner.prepare_inputs(host)
    hidden = runner.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
    return hidden[inputs.logits_indices]


def time_path(fn, iters: int, warmup: int) -> dict:
    """Median host (launch) and step (until the device is done) milliseconds of fn()."""
    host, step = [], []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            host.append((t1 - t0) * 1e3)
            step.append((t2 - t0) * 1e3)
    return {"host_ms": statistics.median(host), "step_ms": statistics.median(step)}


@torch.inference_mode()
def check(runner, num_tokens: int, args) -> dict:
    from dataclasses import replace

    host = mixed_step(runner, num_tokens, args.decodes, args.context)
    pieces = runner.piecewise_runner
    result = {"tokens": num_tokens, "decodes": args.decodes, "bucket": pieces.bucket(num_tokens)}
    result["eager"] = time_path(lambda: _eager(runner, host), args.iters, args.warmup)
    if result["bucket"] is None:  # larger than every bucket: the engine runs it eagerly
        result["piecewise"], result["max_abs_diff"], result["max_abs_eager"] = None, 0.0, 0.0
        return result
    result["piecewise"] = time_path(lambda: pieces.run(host), args.iters, args.warmup)
    every_row = replace(host, logits_indices=list(range(num_tokens)))
    eager = _eager(runner, every_row).float()
    piecewise = pieces.run(every_row).float()
    result["max_abs_diff"] = float((eager - piecewise).abs().max())
    result["max_abs_eager"] = float(eager.abs().max())
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("piecewise_check needs a CUDA GPU")
    llm, start_s = build_engine(args)
    runner = llm.llm_engine.executor.worker.model_runner
    if runner.piecewise_runner is None:
        raise SystemExit("the engine captured no piecewise graphs (see the log)")
    results = {
        "device": torch.cuda.get_device_name(),
        "model": args.model,
        "layers": runner.model.num_layers,
        "engine_start_s": start_s,
        "piecewise_graphs": runner.piecewise_runner.num_graphs,
        "token_buckets": runner.piecewise_runner.token_sizes,
        "steps": [check(runner, t, args) for t in args.tokens],
    }
    print(f"{results['device']}, {results['layers']} layers, {results['piecewise_graphs']} "
          f"piecewise graphs, engine start {start_s:.1f} s")  # fmt: skip
    print(
        "tokens | bucket | eager host / step ms | piecewise host / step ms | max |diff| (max |h|)"
    )
    for r in results["steps"]:
        e, p = r["eager"], r["piecewise"]
        pw = "eager (no bucket)" if p is None else f"{p['host_ms']:.2f} / {p['step_ms']:.2f}"
        print(f"{r['tokens']} | {r['bucket']} | {e['host_ms']:.2f} / {e['step_ms']:.2f} | {pw} | "
              f"{r['max_abs_diff']:.3g} ({r['max_abs_eager']:.3g})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
