"""Start-up and whole-process time on the embedded model: phloem's first and second start, and a
small greedy job end to end, phloem vs llama.cpp (llama-cpp-python) on the same GGUF, same run.

Measured, each in a fresh process (the cache dir is a new temp dir, so the first start converts):
  - first start: `LLM()` with an empty checkpoint cache (parse the GGUF, write the cache, load it);
  - second start: `LLM()` again, loading the cached HF directory (median of --repeats);
  - the job: --num-prompts chat prompts x --output-len greedy tokens, EOS ignored, as a user runs
    it: `phloem generate` (second run, warm cache; batched; default dtype, and float32 too with
    --also-float32) vs a llama-cpp-python script feeding the prompts one at a time; whole-process
    wall time from spawn to exit (median of --repeats).
Start-up times are also reported from inside the process (`LLM.load_s`, llama.cpp's model load).
llama-cpp-python is optional (`pip install -e ".[bench]"`); without it phloem's numbers are
reported and the JSON says llama.cpp was unavailable.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/startup.py --json out.json [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

TOPICS = [
    "the water cycle", "how a bicycle gear works", "why the sky is blue", "the history of tea",
    "how vaccines work", "the rules of chess", "what a black hole is", "how to bake bread",
    "the life of honeybees", "how airplanes fly", "the causes of earthquakes", "photosynthesis",
    "the printing press", "how a refrigerator works", "the moons of Jupiter", "recycling plastic",
    "how the heart pumps blood", "the Great Wall of China", "how rainbows form", "compound interest",
    "the migration of birds", "how batteries store energy", "the origin of the Olympic Games",
    "how coral reefs grow", "what DNA does", "how a compass works", "the invention of the telephone",
    "why leaves change color", "how volcanoes erupt", "the speed of light", "how bread rises",
    "what makes a good password",
]  # fmt: skip

START_SNIPPET = """
import json, time
t0 = time.perf_counter()
from phloem import LLM
llm = LLM()
print(json.dumps({"llm_s": time.perf_counter() - t0, "load_s": llm.load_s}))
"""

LLAMA_CPP_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
path, prompts_file, output_len, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = json.load(open(prompts_file))
llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, seed=0,
            verbose=False)
load_s = time.perf_counter() - t0
outputs, num_prompt = [], 0
gen_start = time.perf_counter()
for text in prompts:  # one prompt at a time: llama-cpp-python has no batched generate
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    num_prompt += len(tokens)
    llm.reset()
    out = []
    for token in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(token)  # EOS ignored: generate() never stops by itself
        if len(out) == output_len:
            break
    outputs.append(out)
print(json.dumps({"load_s": load_s, "generate_s": time.perf_counter() - gen_start,
                  "num_prompt_tokens": num_prompt, "outputs": outputs}))
"""


def chat_prompts(num: int) -> list[str]:
    """`num` one-turn chats rendered with the embedded model's chat template (plain text with its
    special tokens), so both engines get the same text."""
    from phloem.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    chats = [
        [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} in a short paragraph."}]
        for i in range(num)
    ]
    return [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats
    ]


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str, str]:
    """(whole-process wall time [s], stdout, stderr) of `cmd`; raises on a non-zero exit."""
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return wall, result.stdout, result.stderr


def measure_starts(env: dict[str, str], repeats: int) -> dict:
    first_wall, out, _ = timed([sys.executable, "-c", START_SNIPPET], env)
    first = json.loads(out.splitlines()[-1])
    seconds = []
    for _ in range(repeats):
        wall, out, _ = timed([sys.executable, "-c", START_SNIPPET], env)
        seconds.append({**json.loads(out.splitlines()[-1]), "process_s": wall})
    return {
        "first_start": {**first, "process_s": first_wall},
        "second_start_runs": seconds,
        "second_start_llm_s_median": statistics.median(r["llm_s"] for r in seconds),
    }


def measure_phloem_job(env, prompts, output_len, repeats, workdir, dtype="auto") -> dict:
    src = os.path.join(workdir, "prompts.jsonl")
    with open(src, "w", encoding="utf-8") as f:
        for i, text in enumerate(prompts):
            f.write(json.dumps({"id": str(i), "prompt": text}) + "\n")
    runs = []
    for r in range(repeats):
        out, summary = os.path.join(workdir, f"out{r}.jsonl"), os.path.join(workdir, f"s{r}.json")
        cmd = [sys.executable, "-m", "phloem.entrypoints.cli", "generate", "-i", src, "-o", out,
               "--temperature", "0", "--max-tokens", str(output_len), "--ignore-eos",
               "--no-progress", "--summary-json", summary, "--dtype", dtype]  # fmt: skip
        wall, _, _ = timed(cmd, env)
        with open(summary, encoding="utf-8") as f:
            s = json.load(f)
        runs.append({"process_s": wall, "load_s": s["load_s"], "generate_wall_s": s["wall_s"],
                     "num_prompt_tokens": s["num_prompt_tokens"],
                     "num_output_tokens": s["num_output_tokens"]})  # fmt: skip
    with open(os.path.join(workdir, "out0.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return {"runs": runs, "process_s_median": statistics.median(r["process_s"] for r in runs),
            "texts": texts}  # fmt: skip


def llama_cpp_env() -> dict[str, str]:
    """llama.cpp as its users run it: its OpenMP threads at their default wait policy (they spin
    between the many small parallel regions of a decode step; OMP_WAIT_POLICY=PASSIVE, which
    phloem's torch threads want on a shared 2-core machine, makes llama.cpp ~2.5x slower)."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    return env


def measure_llama_cpp(gguf, prompts, output_len, repeats, workdir, threads) -> dict:
    if importlib.util.find_spec("llama_cpp") is None:
        return {"available": False, "reason": "llama-cpp-python is not installed (.[bench])"}
    prompts_file = os.path.join(workdir, "prompts.json")
    with open(prompts_file, "w", encoding="utf-8") as f:
        json.dump(prompts, f)
    script = os.path.join(workdir, "llama_cpp_job.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(LLAMA_CPP_SCRIPT)
    runs, outputs = [], None
    for _ in range(repeats):
        cmd = [sys.executable, script, gguf, prompts_file, str(output_len), str(threads)]
        wall, out, _ = timed(cmd, llama_cpp_env())
        record = json.loads(out.splitlines()[-1])
        outputs = record.pop("outputs")
        runs.append({"process_s": wall, **record,
                     "num_output_tokens": sum(len(o) for o in outputs)})  # fmt: skip
    import llama_cpp

    return {"available": True, "version": llama_cpp.__version__, "n_threads": threads,
            "omp_wait_policy": llama_cpp_env().get("OMP_WAIT_POLICY", "default"),
            "runs": runs, "process_s_median": statistics.median(r["process_s"] for r in runs),
            "outputs": outputs}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each timed process")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--also-float32", action="store_true",
                        help="also time phloem's job with --dtype float32 (the default is auto)")  # fmt: skip
    args = parser.parse_args(argv)

    import torch

    from phloem.models.loader import resolve_model
    from phloem.worker.worker import resolve_dtype

    gguf = resolve_model(None).gguf_path
    prompts = chat_prompts(args.num_prompts)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="phloem-startup-") as workdir:
        env = dict(os.environ, PHLOEM_CACHE_DIR=os.path.join(workdir, "cache"))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        starts = measure_starts(env, args.repeats)
        job = measure_phloem_job(env, prompts, args.output_len, args.repeats, workdir)
        job_f32 = None
        if args.also_float32:  # convert its cache first: the job is timed on a second start
            timed([sys.executable, "-c", "from phloem import LLM; LLM(dtype='float32')"], env)
            job_f32 = measure_phloem_job(env, prompts, args.output_len, args.repeats, workdir,
                                         dtype="float32")  # fmt: skip
            job_f32.pop("texts")
        llama = measure_llama_cpp(gguf, prompts, args.output_len, args.repeats, workdir,
                                  args.threads)  # fmt: skip
    texts = job.pop("texts")
    result = {
        "benchmark": "startup",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },  # fmt: skip
        "workload": {
            "num_prompts": args.num_prompts,
            "output_len": args.output_len,
            "greedy": True,
            "ignore_eos": True,
        },  # fmt: skip
        **starts,
        "phloem_dtype": str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
        "phloem_job": job,
        **({"phloem_job_float32": job_f32} if job_f32 else {}),
        "llama_cpp_job": {k: v for k, v in llama.items() if k != "outputs"},
    }
    if llama.get("available"):
        result["job_ratio_phloem_over_llama_cpp"] = (
            job["process_s_median"] / llama["process_s_median"]
        )
        if job_f32:
            result["job_ratio_phloem_float32_over_llama_cpp"] = (
                job_f32["process_s_median"] / llama["process_s_median"]
            )
        result["sample_outputs"] = {"phloem": texts[0], "llama_cpp_token_ids": llama["outputs"][0]}
    print(f"first start  LLM(): {starts['first_start']['llm_s']:.2f} s (goal <= 9.5)")
    print(f"second start LLM(): {starts['second_start_llm_s_median']:.2f} s median (goal <= 2)")
    if job_f32:
        print(f"job, whole process, phloem --dtype float32: {job_f32['process_s_median']:.2f} s")
    print(f"job, whole process: phloem ({result['phloem_dtype']}) "
          f"{job['process_s_median']:.2f} s", end="")  # fmt: skip
    if llama.get("available"):
        print(f", llama.cpp {llama['process_s_median']:.2f} s, "
              f"ratio {result['job_ratio_phloem_over_llama_cpp']:.2f} (goal <= 0.8)")  # fmt: skip
    else:
        print(f"; llama.cpp unavailable: {llama['reason']}")
    print(f"load average before/after: {load_before} / {result['machine']['loadavg_after']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
