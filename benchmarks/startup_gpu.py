"""GPU start-up of an 8B model (issue 19's "<= 60 s"), cold and warm, seconds per phase.

Each stage is a fresh process with its own compile caches (FlashInfer's JIT workspace, Triton's
and inductor's cache dirs) under one temp dir:

    cold      empty caches: every FlashInfer module, Triton kernel and inductor graph compiles
    warm      the same caches again: what a second start costs
    prebuild  (with --stages prebuild) empty caches, `phloem prebuild-kernels` first, then a start
    serial    (with --stages serial) the FlashInfer modules built one after another, as first
              use builds them, then all in one build, each into empty caches
    triton    (with --stages triton) phloem's Triton prebuild off (PHLOEM_TRITON_PREBUILD=0),
              then on: fresh starts with an empty Triton cache each and FlashInfer's and
              inductor's caches warm (cold's, or filled by a first start), so they differ in
              Triton alone; "check" says whether, with the prebuild, any phloem kernel still
              compiled in the main process (it must not)

Per stage it records the FlashInfer modules in the cache afterwards (after `cold`: each one that
the engine's prebuild did not list was compiled at first use; `flashinfer_built_twice`: those
whose objects ninja compiled both in the prebuild and again at first use, which must be none),
the process's wall time to the
first output (`LLM(...)` plus one small
greedy batch: what a user's first `phloem generate` waits), the import, `LLM()` and first-batch
times, and each worker's start-up phases from its log line (`phloem.worker.startup_phases`:
weights, setup and the FlashInfer prebuild wait, memory profile + KV, attention warm-up, CUDA
graphs; plus the background prebuilds' own time), every Triton compile of the main process
(Triton's compilation listener: phloem's kernels and the rest, cache hits apart, when each
happened), and the dynamo/inductor compile times. Weights are random (`load_format="dummy"`), so
the weights phase is their initialization, not a disk read: a real checkpoint's read adds to it
and is reported in the same phase.

Run on the GPU machine from the repository root in one call (no .fiaot restore: cold means
cold): `bash benchmarks/startup_device.sh OUT` (the Triton check: `bash
benchmarks/startup_device.sh OUT cold,triton`) or, after `source benchmarks/device_setup.sh` and
removing its restored AOT modules, `python3 benchmarks/startup_gpu.py --json OUT/startup.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, logging, sys, time
t0, epoch0 = time.perf_counter(), time.time()
logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format="%(levelname)s %(name)s: %(message)s")
compiles = []  # every Triton compile of this (the main) process, a cache hit or not
try:
    from triton import knobs
    def listen(*, src, metadata, metadata_group, times, cache_hit):
        fn = getattr(src, "fn", None)
        compiles.append({"kernel": getattr(src, "name", "?"), "hit": cache_hit,
                         "module": getattr(fn, "module", None) or "",
                         "at_s": round(time.perf_counter() - t0, 2),
                         "compile_s": round(times.total / 1e6, 3)})
    knobs.compilation.listener = listen
except ImportError:
    pass
from phloem import LLM, SamplingParams
t_import = time.perf_counter()
llm = LLM(sys.argv[1], load_format="dummy", **json.loads(sys.argv[2]))
t_llm = time.perf_counter()
prompts = [{"prompt_token_ids": [100 + i] * 64} for i in range(4)]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
             use_tqdm=False)
t_first = time.perf_counter()
try:
    from torch._dynamo.utils import compile_times
    dynamo = compile_times(repr="str", aggregate=True)
except Exception as e:
    dynamo = repr(e)
print("RESULT " + json.dumps({"import_s": t_import - t0, "llm_s": t_llm - t_import,
                              "load_s": llm.load_s, "first_batch_s": t_first - t_llm,
                              "epoch0": epoch0, "triton_compiles": compiles,
                              "dynamo_compile_times": dynamo}))
"""


def _env(cache_root: str, **extra: str) -> dict[str, str]:
    """This process's environment with every compile cache under `cache_root`, plus `extra`."""
    env = dict(os.environ)
    env.update(
        FLASHINFER_WORKSPACE_BASE=os.path.join(cache_root, "flashinfer"),
        TRITON_CACHE_DIR=os.path.join(cache_root, "triton"),
        TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_root, "inductor"),
    )
    env.update(extra)
    return env


def start(model_dir: str, engine: dict, cache_root: str, timeout_s: float, **env: str) -> dict:
    """One start in a fresh process (`env`: extra environment); its timings, its workers'
    phases, the Triton compiles of its main process and the FlashInfer modules in its cache."""
    from phloem.worker.startup_phases import parse_phases

    begin = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, model_dir, json.dumps(engine)],
        env=_env(cache_root, **env), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    wall = time.perf_counter() - begin
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "process_s": wall}
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    prebuilt = [x.split(": ", 2)[-1] for x in proc.stderr.splitlines()
                if "FlashInfer modules ready in" in x or "Triton kernels ready in" in x]  # fmt: skip
    return {"process_s": wall, **result, "phases": parse_phases(proc.stderr),
            "prebuilt": prebuilt, "triton_main": triton_summary(result["triton_compiles"]),
            "flashinfer_jit_modules": jit_modules(cache_root, result["epoch0"]),
            "flashinfer_built_twice": flashinfer_built_twice(cache_root)}  # fmt: skip


def triton_summary(compiles: list[dict]) -> dict:
    """The main process's Triton compiles by origin: phloem's own kernels (`phloem.*` modules)
    and the rest (inductor's generated kernels); per group the compiles that missed the cache
    (compiled in the main process, holding the start) and their seconds, and the hits."""
    out = {}
    for group in ("phloem", "other"):
        mine = [c for c in compiles if c["module"].startswith("phloem.") == (group == "phloem")]
        missed = [c for c in mine if not c["hit"]]
        out[group] = {"compiled": len(missed), "compiled_s": round(sum(c["compile_s"] for c in missed), 2),
                      "cache_hits": len(mine) - len(missed),
                      "compiled_kernels": [f"{c['kernel']} at {c['at_s']} s" for c in missed]}  # fmt: skip
    return out


def jit_modules(cache_root: str, epoch0: float | None = None) -> list[str]:
    """The FlashInfer modules compiled into this cache so far (`<uri>/<uri>.so` under its
    cached_ops): after a cold start, every module beyond the prebuilt ones was compiled at
    first use, i.e. missed by `required_modules`. With `epoch0` (the process's start, epoch
    seconds) each name says when its .so was written, to place it among the phases."""
    base = os.path.join(cache_root, "flashinfer")
    found = []
    for root, _dirs, files in os.walk(base):
        name = os.path.basename(root)
        if f"{name}.so" in files:
            when = os.path.getmtime(os.path.join(root, f"{name}.so"))
            found.append(name if epoch0 is None else f"{name} at {when - epoch0:.1f} s")
    return sorted(found)


def _ninja_outputs(directory: str) -> set[str]:
    """The outputs ninja's build log in `directory` records (empty without a log)."""
    try:
        with open(os.path.join(directory, ".ninja_log")) as f:
            return {line.split("\t")[3] for line in f if not line.startswith("#")}
    except (OSError, IndexError):
        return set()


def flashinfer_built_twice(cache_root: str) -> list[str]:
    """The FlashInfer modules of this cache whose objects ninja compiled twice: once from the JIT
    directory's root (one combined build over several modules) and again in the module's own
    directory (FlashInfer's first use), each run logging to its own directory. Empty when the
    prebuild built each module where its first use looks (`phloem.worker.kernel_prebuild`)."""
    twice = []
    for root, _dirs, files in os.walk(os.path.join(cache_root, "flashinfer")):
        name = os.path.basename(root)
        if f"{name}.so" in files and _ninja_outputs(root) & _ninja_outputs(os.path.dirname(root)):
            twice.append(name)
    return sorted(twice)


def prebuild(model_dir: str, engine: dict, cache_root: str, timeout_s: float) -> dict:
    """`phloem prebuild-kernels` for the same model and settings, timed."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    begin = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "phloem.entrypoints.cli", "prebuild-kernels", "--model",
         model_dir, *flags],
        env=_env(cache_root), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    print(proc.stdout, proc.stderr[-2000:], file=sys.stderr)
    return {"returncode": proc.returncode, "seconds": time.perf_counter() - begin,
            "output": proc.stdout.splitlines()}  # fmt: skip


SERIAL = """
import json, sys, time
import torch
from phloem.worker.kernel_prebuild import build_modules, importable, required_modules
modules = required_modules("auto", int(sys.argv[1]), "bfloat16", "bfloat16",
                           torch.cuda.get_device_capability(), importable("triton"))
times = []
for m in modules if sys.argv[2] == "one-by-one" else [modules]:
    start = time.perf_counter()
    build_modules([m] if sys.argv[2] == "one-by-one" else m)
    times.append(time.perf_counter() - start)
print("RESULT " + json.dumps({"modules": [m.describe() for m in modules], "seconds": times}))
"""


def serial(head_dim: int, tmp: str, timeout_s: float) -> dict:
    """FlashInfer's modules built one after another (as first use builds them) and all in one
    build (as the prebuild does), each into empty caches: what building them at once saves."""
    out = {}
    for how in ("one-by-one", "together"):
        proc = subprocess.run(
            [sys.executable, "-c", SERIAL, str(head_dim), how],
            env=_env(os.path.join(tmp, f"caches-{how}")), capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        out[how] = json.loads(line[0][len("RESULT ") :]) if line else {"error": proc.stderr[-2000:]}
    return out


def triton(model_dir: str, engine: dict, caches: str, tmp: str, timeout_s: float) -> dict:
    """phloem's Triton prebuild off, then on: two fresh starts with an empty Triton cache each,
    FlashInfer's and inductor's caches warm (those of `caches`; a first start fills them when
    they are empty), so the difference is Triton's. With the prebuild, no phloem kernel may
    compile in the main process ("check")."""
    out: dict = {}
    if not os.path.isdir(os.path.join(caches, "flashinfer")):
        out["fill"] = start(model_dir, engine, caches, timeout_s)
    for name, switch in (("off", "0"), ("on", "1")):
        empty = tempfile.mkdtemp(prefix=f"triton-{name}-", dir=tmp)
        out[name] = start(model_dir, engine, caches, timeout_s, TRITON_CACHE_DIR=empty,
                          PHLOEM_TRITON_PREBUILD=switch)  # fmt: skip
    mine = out["on"].get("triton_main", {}).get("phloem")
    if mine is None:
        out["check"] = "FAILED: the start with the prebuild did not finish"
    elif mine["compiled"] == 0 and mine["cache_hits"] > 0:
        out["check"] = (f"OK: after the prebuild no phloem Triton kernel compiled in the main "
                        f"process ({mine['cache_hits']} launches found theirs in the cache)")  # fmt: skip
    else:
        out["check"] = f"FAILED: phloem kernels compiled in the main process: {mine}"
    for name in ("off", "on"):
        phases = (out[name].get("phases") or [{}])[0]
        print(f"triton {name}: phases {json.dumps(phases)}; main-process Triton compiles "
              f"{json.dumps(out[name].get('triton_main'))}", flush=True)  # fmt: skip
    print(out["check"], flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a shipped config name")
    parser.add_argument(
        "--stages", default="cold,warm", help="comma list: cold, warm, prebuild, serial, triton"
    )
    parser.add_argument("--engine", default="{}", help="JSON of extra LLM(...) settings")
    parser.add_argument("--config", default="{}", help="JSON of model config overrides")
    parser.add_argument("--timeout", type=float, default=560.0, help="per process [s]")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from phloem.model_configs import materialize

    tmp = tempfile.mkdtemp(prefix="phloem-startup-")
    model_dir = str(materialize(args.model, os.path.join(tmp, "model"), **json.loads(args.config)))
    engine = json.loads(args.engine)
    result: dict = {"model": args.model, "engine": engine, "stages": {},
                    "command": "python3 benchmarks/startup_gpu.py " + " ".join(sys.argv[1:])}  # fmt: skip
    caches = os.path.join(tmp, "caches")
    for stage in args.stages.split(","):
        if stage == "cold":
            out = start(model_dir, engine, caches, args.timeout)
        elif stage == "warm":
            out = start(model_dir, engine, caches, args.timeout)  # the caches cold left
        elif stage == "serial":
            from phloem.models.loader import load_hf_config, resolve_model
            from phloem.worker.kernel_prebuild import head_dim_of

            head_dim = head_dim_of(load_hf_config(resolve_model(model_dir)))
            out = serial(head_dim, tmp, args.timeout)
        elif stage == "triton":
            out = triton(model_dir, engine, caches, tmp, args.timeout)
        elif stage == "prebuild":
            fresh = os.path.join(tmp, "caches-prebuild")
            out = {"prebuild": prebuild(model_dir, engine, fresh, args.timeout)}
            out["start"] = start(model_dir, engine, fresh, args.timeout)
        else:
            raise ValueError(f"unknown stage {stage!r}: cold, warm, prebuild, serial or triton")
        result["stages"][stage] = out
        print(f"{stage}: {json.dumps(out)}", flush=True)
        if args.json:  # after every stage: a later one may hit the call's time limit
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
