"""The host time of a constrained step's sampling enqueue after its bitmask fill (issue 21).

Under async scheduling the constrained step's chain is: tokens of step N on the host -> the
grammar thread advances the matchers and fills the bitmask of N+1 -> the loop, blocked on that
fill, enqueues N+1's sampling (`ModelRunner.sample`) -> the device samples -> tokens. The
enqueue is host work on that chain (3.9-7.1 ms on the H200 at 1,024 rows:
benchmarks/results/2026-11-27c-cpu-structured-serial). This drives a real `ModelRunner` (a
stub model: no forward pass) through a held constrained step's two calls, over `--rows`
sequences x `--vocab-size` logits of random values and a random bitmask (about half the tokens
allowed, every row constrained):

- `presample`: what the engine enqueues while the fill runs (`StructuredOutputs.hold`);
- `sample`: the post-fill enqueue (`StructuredOutputs.sample_held`), the number this is about;
- `sample_ops`: the torch operators `sample` dispatches (`TorchDispatchMode`: what the device
  is sent; a Triton launch is no operator), the same at every vocabulary;
- `to_tokens`: from `sample`'s start to the tokens on the host (on a GPU: with the sampling's
  device time; on a CPU every operator runs as it is dispatched).

`--params seeded` (default) is the GPU benchmark's (`structured_outputs.py`: temperature 0.7,
a seed a request); `mixed` cycles greedy, seeded with top-k, top-p, min-p, a penalty, a banned
id and logprobs rows. Each repeat is one step (the seed streams advance), after two untimed
ones; `tokens_sha` hashes every step's tokens (and log-probs), so trees that sample the same
print the same. On a CPU a small vocabulary measures the host's dispatch and Python (at 128,256
the operators' own work is most of the time); on a GPU the real one.

`--trees A,B` runs each tree (a directory with `phloem/`, e.g. a worktree of the commit before
a change) in a process of its own, alternating, `--rounds` times:

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/structured_sample_enqueue.py \
        --rows 1024 --vocab-size 64 --trees /tmp/before,. --rounds 3 --out DIR/enqueue.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rows(kind: str, num: int):
    """(per-row SamplingParams, whether the row is seeded) for `--params`."""
    from phloem.sampling_params import SamplingParams

    if kind == "seeded":
        return [SamplingParams(temperature=0.7, seed=i) for i in range(num)]
    cycle = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=1, top_k=20),
        dict(temperature=1.0, seed=2, top_p=0.9),
        dict(temperature=0.9, min_p=0.05),
        dict(temperature=0.7, seed=3, frequency_penalty=0.5),
        dict(temperature=0.0, logprobs=2),
        dict(temperature=0.6, seed=4, logprobs=1),
    ]
    return [SamplingParams(**cycle[i % len(cycle)]) for i in range(num)]


def _runner(device, vocab: int):
    import torch
    from torch import nn

    from phloem.ops.attention.reference import ReferenceAttention
    from phloem.worker.model_runner import ModelRunner

    class StubModel(nn.Module):
        """Geometry only: `sample` never runs the model."""

        num_layers, num_kv_heads, head_dim = 1, 1, 2

    return ModelRunner(StubModel(), 1, 4, torch.float32, device, ReferenceAttention(), seed=0,
                       eos_token_id=vocab - 1)  # fmt: skip


def _count_ops(fn, *args) -> int:
    """Torch operators `fn(*args)` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        num = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.num += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn(*args)
    return Count.num


def measure(args) -> dict:
    """Median ms of `presample`, `sample` and `to_tokens` over `--repeats` steps; see the module
    docstring."""
    import torch

    from phloem.layers.sampler import SamplingRow
    from phloem.ops.seeded_noise import SeedStream
    from phloem.structured_output.manager import GrammarBitmask
    from phloem.worker.input_batch import SequenceState
    from phloem.worker.runner_output import LaunchedStep

    torch.set_num_threads(1)
    device = torch.device(args.device)
    num, vocab = args.rows, args.vocab_size
    runner = _runner(device, vocab)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num, vocab, device=device, generator=gen).to(torch.bfloat16)
    seq_ids = [f"s{i}" for i in range(num)]
    states, rows = [], []
    for i, params in enumerate(_rows(args.params, num)):
        state = SequenceState([1, 2, 3], [4, 5], params)
        seeded = params.seed is not None and params.temperature > 0
        generator = torch.Generator(device=device).manual_seed(i) if seeded else None
        banned = [vocab - 1] if i % 11 == 3 else []
        rows.append(SamplingRow(params, state.prompt_token_ids, state.output_token_ids,
                                generator, banned, SeedStream(i) if seeded else None))  # fmt: skip
        states.append(state)
    rng = np.random.default_rng(0)
    words = -(-vocab // 32)
    bitmask = rng.integers(-(2**31), 2**31, (num, words), dtype=np.int64).astype(np.int32)
    bitmask[:, 0] |= 1  # token 0 allowed: no row is left without a token
    if device.type == "cuda":  # the manager's buffers are pinned on a GPU host
        bitmask = torch.from_numpy(bitmask).pin_memory().numpy()
    grammar = GrammarBitmask(list(seq_ids), bitmask)
    times: dict[str, list[float]] = {"presample": [], "sample": [], "to_tokens": []}
    digest = hashlib.sha256()
    ops = 0
    for k in range(args.repeats + 2):
        launched = LaunchedStep(list(seq_ids), states, None, deferred=(logits, list(rows)))
        _sync(device)
        t0 = time.perf_counter()
        runner.presample(launched)
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        if k == 0:
            ops = _count_ops(runner.sample, launched, grammar)
        else:
            runner.sample(launched, grammar)
        t3 = time.perf_counter()
        result = launched.sampled.result()
        t4 = time.perf_counter()
        digest.update(json.dumps([result.token_ids, result.logprobs]).encode())
        if k >= 2:
            times["presample"].append(t1 - t0)
            times["sample"].append(t3 - t2)
            times["to_tokens"].append(t4 - t2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"device": name, "rows": num, "vocab_size": vocab, "params": args.params,
           "repeats": args.repeats, "sample_ops": ops, "tokens_sha": digest.hexdigest()[:16]}  # fmt: skip
    for key, values in times.items():
        out[f"{key}_ms"] = round(1e3 * statistics.median(values), 3)
        out[f"{key}_min_ms"] = round(1e3 * min(values), 3)
    return out


def run_trees(args) -> list[dict]:
    """`measure` of each tree in `args.trees` in a process of its own, alternating, each round."""
    child_args = ["--rows", str(args.rows), "--vocab-size", str(args.vocab_size),
                  "--repeats", str(args.repeats), "--params", args.params,
                  "--device", args.device]  # fmt: skip
    from phloem.bench.ab_trees import run_in_trees  # the parent's tree (a child's may lack it)

    return run_in_trees(str(Path(__file__).resolve()), child_args, args.trees, args.rounds)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--params", choices=["seeded", "mixed"], default="seeded")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trees", default=None, help="comma-separated trees to compare")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    # the tree under test (a child), else this file's, imports first
    sys.path.insert(0, args.child or str(Path(__file__).resolve().parents[1]))
    if args.child is not None:
        import phloem

        assert Path(phloem.__file__).resolve().is_relative_to(args.child), phloem.__file__
        print(json.dumps(measure(args)))
        return
    runs = run_trees(args) if args.trees else [measure(args)]
    if not args.trees:
        print(json.dumps(runs[0]))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
