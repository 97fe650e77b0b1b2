"""Does torch's OpenMP pool slow the grammar bitmask fill it shares a process with? (issue 21)

On the H100 host a 1,024-row fill ran at about half its ideal parallel efficiency on 14 threads
while torch kept its 16 intra-op threads. The suspicion: after every multi-threaded torch CPU op
the OpenMP threads spin-wait (libgomp's default: ~300,000 pause loops before sleeping) on the
cores the fill's native threads need. Two parts:

1. `--fill` (default): the engine's `StructuredOutputManager.bitmask` over a recorded walk of
   `--rows` sequences under the GPU benchmark's schema (the byte-level 128,256-token tokenizer)
   on `--fill-threads` threads, timed per step, while a Python thread of the same process runs
   a few torch CPU ops on `--op-elems` elements (cat, index_select, arange + add, copy_) every
   `--period-ms`, as the engine's host path would. Conditions, each in a fresh process (the
   wait policy is read once, at libgomp's start): `none` (no torch loop), `spin` (2 torch
   threads, the default wait policy), `passive` (2 threads, OMP_WAIT_POLICY=PASSIVE), `one`
   (`torch.set_num_threads(1)`), interleaved over `--rounds`.
2. `--engine-steps`: the OpenMP parallel regions a CPU engine step enters, by phase (the model
   runner's input preparation, forward pass, sampling; the rest of the engine loop), counted
   at `GOMP_parallel`: which of the engine's host work is multi-threaded torch at all.

Regions are counted by a 10-line C shim on LD_PRELOAD (built here with `cc`; counts are
None without a compiler). torch's CPU ops enter a region only from 32,768 elements
(`at::internal::GRAIN_SIZE`), whatever the thread count.

    python benchmarks/structured_fill_contention.py --op-elems 4096,262144 --out DIR/fill.json
    python benchmarks/structured_fill_contention.py --engine-steps --rows 64 --steps 16 \
        --out DIR/engine.json
    python benchmarks/structured_fill_contention.py --engine-steps --device cuda --rows 1024 \
        --steps 128 --out DIR/engine-cuda.json   # the GPU host path's regions per step
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
static atomic_long regions;
typedef void (*fn_t)(void (*)(void *), void *, unsigned, unsigned);
void GOMP_parallel(void (*f)(void *), void *d, unsigned n, unsigned flags) {
  static fn_t real;
  if (!real) real = (fn_t)dlsym(RTLD_NEXT, "GOMP_parallel");
  atomic_fetch_add(&regions, 1);
  real(f, d, n, flags);
}
long phloem_gomp_regions(void) { return atomic_load(&regions); }
"""
CONDITIONS = {  # name -> (environment, torch threads; 0: no torch loop)
    "none": ({}, 0),
    "spin": ({}, 2),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2),
    "one": ({}, 1),
}


def build_shim(directory: str) -> str | None:
    """The region-counting shim compiled into `directory`; None where no `cc` works."""
    source, library = Path(directory) / "gomp_count.c", Path(directory) / "gomp_count.so"
    source.write_text(_SHIM)
    command = ["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"]
    done = subprocess.run(command, capture_output=True, check=False)
    return str(library) if done.returncode == 0 else None


def regions() -> int | None:
    """OpenMP parallel regions entered by this process so far (None without the shim)."""
    try:
        return int(ctypes.CDLL(None).phloem_gomp_regions())
    except AttributeError:
        return None


class TorchLoop(threading.Thread):
    """Small torch CPU ops on `elems` elements every `period_s` (the engine's host path):
    `ops` rounds done, `regions` the parallel regions they entered (the process's count)."""

    def __init__(self, elems: int, period_s: float) -> None:
        super().__init__(daemon=True)
        import torch

        self.torch, self.period_s, self.stop = torch, period_s, threading.Event()
        self.a = torch.randn(elems)
        self.index = torch.randint(0, elems, (elems,))
        self.out = torch.empty(elems)
        self.ops, self.regions, self.spin_ms = 0, 0, 0.0

    def run(self) -> None:
        torch, a, half = self.torch, self.a, len(self.a) // 2
        self.spin_ms = spin_after_region()  # in this thread: one OpenMP master, as the engine
        first = regions()
        while not self.stop.is_set():
            torch.cat([a[:half], a[half:]])
            a.index_select(0, self.index)
            torch.arange(len(a)).add_(1)
            self.out.copy_(a)
            self.ops += 1
            time.sleep(self.period_s)
        self.regions = (regions() or 0) - (first or 0)


def spin_after_region() -> float:
    """CPU ms this process burns in the 200 ms after one parallel region (a 1M-element add)
    while the calling thread sleeps: the OpenMP workers' spin-wait before they sleep. Call it
    from the thread that runs the other regions: libgomp keeps a worker pool per master thread
    and spins only ~100 times (not ~300,000) once its threads outnumber the CPUs."""
    import torch

    a = torch.ones(1 << 20)
    a.add_(1)  # the pool started apart
    time.sleep(0.2)
    cpu = time.process_time()
    a.add_(1)
    time.sleep(0.2)
    return 1e3 * (time.process_time() - cpu)


def tokenizer(tmp: str):
    """The GPU benchmark's byte-level 128,256-token tokenizer as the grammar backend's data."""
    from transformers import AutoTokenizer

    from benchmarks.structured_outputs import byte_level_tokenizer_dir
    from phloem.structured_output import tokenizer_data

    path = byte_level_tokenizer_dir("llama-3.1-8b", Path(tmp) / "model")
    hf = AutoTokenizer.from_pretrained(path)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    return tokenizer_data(hf, vocab_size, hf.eos_token_id)


def fill_child(args) -> dict:
    """One condition in this process: the manager's fill of every step of a recorded walk,
    with the torch loop beside it (or not). Returns ms per step (mean, median), the process's
    CPU seconds per wall second during the fills and during 1 s of the loop alone."""
    import torch

    from benchmarks.structured_masks import record_walk
    from benchmarks.structured_outputs import schema
    from phloem.sampling_params import StructuredOutputsParams
    from phloem.structured_output import make_backend
    from phloem.structured_output.manager import StructuredOutputManager

    torch_threads = CONDITIONS[args.child][1]
    torch.set_num_threads(max(1, torch_threads))
    with tempfile.TemporaryDirectory() as tmp:
        data = tokenizer(tmp)
    walk = record_walk(data, args.rows, args.steps, args.fill_threads)
    manager = StructuredOutputManager(make_backend(data, args.fill_threads), data.vocab_size,
                                      args.fill_threads)  # fmt: skip
    ids = [f"s{i}" for i in range(args.rows)]
    for seq_id in ids:
        manager.register(seq_id, StructuredOutputsParams(json=schema(None, 200, 400)))
    manager.wait_ready(ids)
    manager.bitmask(ids)  # the start state's masks apart
    loop = TorchLoop(args.child_elems, args.period_ms / 1e3) if torch_threads else None
    alone = None
    if loop is not None:
        loop.start()
        time.sleep(0.5)  # its spin measure (0.4 s)
        wall, cpu = time.perf_counter(), time.process_time()
        time.sleep(1.0)
        alone = (time.process_time() - cpu) / (time.perf_counter() - wall)
    fills, cpus = [], []
    for tokens in walk:
        wall, cpu = time.perf_counter(), time.process_time()
        manager.bitmask(ids)
        fills.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        assert None not in manager.accept_many(list(zip(ids, tokens)))
    if loop is not None:
        loop.stop.set()
        loop.join()
    manager.shutdown()
    ops = loop.ops if loop else 0
    return {"condition": args.child, "op_elems": args.child_elems if loop else 0,
            "torch_threads": torch.get_num_threads() if loop else None,
            "wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "cpu_ms_after_one_region": loop.spin_ms if loop else None,
            "fill_ms_mean": 1e3 * float(np.mean(fills)), "fill_ms_median": 1e3 * float(np.median(fills)),
            "fill_cpu_per_wall": float(np.sum(cpus) / np.sum(fills)),
            "loop_alone_cpu_per_wall": alone, "loop_rounds": ops,
            "regions_per_loop_round": loop.regions / ops if loop and ops else None}  # fmt: skip


def run_children(args, shim: str | None) -> list[dict]:
    """Every condition x op size in its own process, `args.rounds` interleaved rounds."""
    runs = []
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}  # fmt: skip
    if shim:
        base["LD_PRELOAD"] = shim
    cases = [("none", 0)] + [(c, n) for n in args.op_elems for c in ("spin", "passive", "one")]
    for round_ in range(args.rounds):
        for condition, elems in cases:
            env = base | CONDITIONS[condition][0]
            command = [sys.executable, "-m", "benchmarks.structured_fill_contention",
                       "--child", condition, "--child-elems", str(elems), "--rows",
                       str(args.rows), "--steps", str(args.steps), "--fill-threads",
                       str(args.fill_threads), "--period-ms", str(args.period_ms)]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1]) | {"round": round_}
            print(json.dumps(run), flush=True)
            runs.append(run)
    return runs


def counting_executor(counts: dict[str, int]):
    """A `UniProcExecutor` factory whose calls add the parallel regions they enter to
    `counts[method]` (the test-only seam `LLMEngine(executor_factory=...)`)."""
    from phloem.engine.executor import UniProcExecutor

    class Counting(UniProcExecutor):
        def _counted(self, name: str, call, *args):
            first = regions() or 0
            try:
                return call(*args)
            finally:
                counts[name] = counts.get(name, 0) + (regions() or 0) - first
                counts[f"{name}_calls"] = counts.get(f"{name}_calls", 0) + 1

        def launch(self, scheduler_output):
            return self._counted("launch", super().launch, scheduler_output)

        def collect(self, launched):
            return self._counted("collect", super().collect, launched)

        def presample(self, launched):
            return self._counted("presample", super().presample, launched)

        def sample(self, launched, grammar):
            return self._counted("sample", super().sample, launched, grammar)

    return Counting


def engine_steps(args) -> list[dict]:
    """Parallel regions per engine step by phase, the embedded model on `args.device`, over
    `args.rows` requests of `args.prompt_len` random tokens x `args.steps` output tokens at
    temperature 0.7 (seeded, as the GPU benchmark), under the GPU benchmark's schema and
    unconstrained. `loop`: the regions outside the executor's calls (scheduling, updates,
    grammar work, outputs); on CUDA `launch` is the host's input staging and kernel launches."""
    from benchmarks.structured_outputs import schema
    from phloem import LLM, SamplingParams
    from phloem.engine.llm_engine import LLMEngine
    from phloem.engine_args import EngineArgs
    from phloem.sampling_params import StructuredOutputsParams

    counts: dict[str, int] = {}
    config = EngineArgs.from_kwargs(model=None, device=args.device).create_engine_config()
    llm = LLM.__new__(LLM)
    llm._init_state(LLMEngine(config, executor_factory=counting_executor(counts)), 0.0)
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.hf_config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(256, vocab, args.prompt_len).tolist()}
               for _ in range(args.rows)]  # fmt: skip
    constraint = StructuredOutputsParams(json=schema(None, 1, 4))
    runs = []
    for name, structured in (("warm-up", constraint), ("one schema", constraint),
                             ("unconstrained", None)):  # fmt: skip
        params = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.steps, ignore_eos=True,
                                 structured_outputs=structured) for i in range(args.rows)]  # fmt: skip
        counts.clear()
        first, wall = regions() or 0, time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        total, wall = (regions() or 0) - first, time.perf_counter() - wall
        inside = sum(v for k, v in counts.items() if not k.endswith("_calls"))
        steps = max(1, counts.get("launch_calls", 0))
        run = {"run": name, "launches": steps, "wall_s": wall,
               "regions_per_launch": {k: v / steps for k, v in counts.items()
                                      if not k.endswith("_calls")} | {"loop": (total - inside) / steps}}  # fmt: skip
        print(json.dumps(run), flush=True)
        runs.append(run)
    return runs[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-steps", action="store_true", help="part 2 only")
    parser.add_argument("--rows", type=int, default=256, help="sequences (requests)")
    parser.add_argument("--steps", type=int, default=48, help="tokens per sequence")
    parser.add_argument("--fill-threads", type=int, default=2)
    parser.add_argument("--op-elems", default="4096,262144", help="the torch loop's op sizes")
    parser.add_argument("--period-ms", type=float, default=1.0, help="the torch loop's sleep")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="--engine-steps: the engine's device")
    parser.add_argument("--prompt-len", type=int, default=64, help="--engine-steps [tokens]")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-elems", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(fill_child(args)), flush=True)
        return
    args.op_elems = [int(n) for n in args.op_elems.split(",")]
    result: dict = {"command": "python " + " ".join(sys.argv), "cpus": os.cpu_count(),
                    "machine": platform.processor() or platform.machine()}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(tmp)
        if args.engine_steps:
            if shim and "LD_PRELOAD" not in os.environ:  # the shim must load before torch
                env = os.environ | {"LD_PRELOAD": shim}
                sys.exit(subprocess.run([sys.executable, "-m", "benchmarks.structured_fill_contention"]
                                        + sys.argv[1:], env=env, check=False).returncode)  # fmt: skip
            result["regions_counted"] = regions() is not None  # else every count reads 0
            result["engine_steps"] = engine_steps(args)
        else:
            result["fill"] = run_children(args, shim)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
