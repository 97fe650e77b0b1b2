"""Throughput of structured outputs against unconstrained decoding, same engine, same run.

Three kinds of run over the same prompts: every request under ONE JSON schema, every request
under its OWN schema (distinct property names, so each compiles), and unconstrained. For equal
work the unconstrained run generates exactly the tokens the one-schema run did (each request's
max_tokens = its constrained output's length, ignore_eos), and the per-request-schema runs are
capped the same way. Ratios are output tokens/s of a constrained run over the unconstrained
run, best of `--pairs` runs each (default 2; the JSON also has each (one schema,
unconstrained) pair's own ratio and their median), interleaved (other work on the machine
drifts: on an H200 two unconstrained runs differed by 15%, results/2026-11-27b-h200); the second
per-request run has new schemas, so both compile every one of theirs; compiling is inside a
constrained run's wall time (a job pays it); loading the grammar library and building its
tokenizer info (once per process) is not: the warm-up does it, timed apart. The warm-up also
runs the whole batch for 4 tokens, unconstrained and under a schema not measured after, so no
measured run is the engine's first at the batch's size (`--small-warm-up`: 2 requests only,
as before 2026-11-27). Each constrained run also reports the grammar counters it added
(`GrammarStats`: compile and matcher time, how long after its registration the last matcher
was ready, rows a step waited for, admissions put off for a grammar still compiling) and every
run where the engine loop's time went (`steps`: mean ms per step of scheduling, launching,
waiting for the device, updating, the rest; see `step_times`); a constrained run also its
structured-output work per constrained step (`loop_ms_per_bitmask`: marking rows, advancing
the matchers, the fill and the loop's wait for it) and its fill's ms by quarter of the run
(`fill_ms_by_quarter`: `by_quarter`), and on a GPU the caching allocator's
device frees and retries in the run (`cuda_allocator`: each one a device sync in a step).
`--grammar-threads N` sets the grammar library's threads (default: all CPUs but two);
`--grammar-process` runs the grammars in a process of their own (`grammar_process` in the JSON
says whether it ran: without room in /dev/shm the engine keeps them in its process and warns).

CPU (the embedded model, 64 requests; goal one-schema >= 0.9x):

    python benchmarks/structured_outputs.py --num-requests 64 --out DIR/cpu.json

GPU (Llama-3.1-8B shapes, random weights, 1,024 requests x 128 output tokens; goals one-schema
>= 0.95x, per-request >= 0.85x, both from this one command). Random weights with the shipped
synthetic tokenizer (words "t<i>") cannot spell JSON, so the script writes a byte-level
tokenizer of the same 128,256 tokens (256 single bytes plus random printable strings) beside the
config; its schema asks for at least 200 array items, so every constrained output runs to
--output-len (finish "length", not parseable: the run measures the cost of constraining, not the
outputs):

    python benchmarks/structured_outputs.py --model llama-3.1-8b --num-requests 1024 \
        --output-len 128 --out DIR/so-1024.json

The same path on the CPU in a few minutes (the model's vocabulary and tokenizer on one narrow
layer): add `--shrink --num-requests 16 --output-len 16`.

The engine loop's host work of a constrained step at the GPU benchmark's batch, on the CPU
(`--vocab-size`: the shrunk model's vocabulary, so the CPU's forward and sampling stay small;
the schema and the loop's per-row work are the same; compare `steps` and `loop_ms_per_bitmask`
between runs, not the ratio):

    OMP_NUM_THREADS=1 python benchmarks/structured_outputs.py --model llama-3.1-8b --shrink \
        --vocab-size 4096 --num-requests 1024 --max-num-seqs 1024 --output-len 32 \
        --prompt-len 8 --skip-per-request
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from phloem import LLM, SamplingParams
from phloem.engine.device_wait import device_wait_mode
from phloem.sampling_params import StructuredOutputsParams


def schema(index: int | None, min_items: int, max_items: int) -> dict:
    """A record schema: nested object, enum, bounded numbers and an array of short strings
    (`min_items` to `max_items`; a large minimum keeps a random-weight model from closing it
    early). `index` renames the
    properties (a distinct schema per request); None is the shared one."""
    p = "" if index is None else f"_{index}"
    return {
        "type": "object",
        "properties": {
            f"id{p}": {"type": "integer", "minimum": 0, "maximum": 100000},
            f"kind{p}": {"enum": ["person", "company", "place"]},
            f"score{p}": {"type": "number", "minimum": 0, "maximum": 1},
            f"owner{p}": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 16},
                               "active": {"type": "boolean"}},
                "required": ["name", "active"],
            },
            f"tags{p}": {"type": "array", "items": {"type": "string", "maxLength": 10},
                         "minItems": min_items, "maxItems": max_items},
        },
        "required": [f"id{p}", f"kind{p}", f"score{p}", f"owner{p}", f"tags{p}"],
    }  # fmt: skip


def byte_level_tokenizer_dir(model: str, dest: Path, **overrides) -> Path:
    """The shipped config (with `overrides`) plus a byte-level tokenizer of its vocabulary size
    (see the module docstring): ids 0..255 are the bytes, the rest random printable strings of
    2-6 bytes, as a byte-level BPE without merges (the grammar libraries read a WordLevel
    model's tokens wrong)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from phloem.model_configs import materialize

    path = materialize(model, dest, **overrides)
    config = json.loads((path / "config.json").read_text())
    vocab_size = config["vocab_size"]
    eos = config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    to_char = bytes_to_unicode()
    tokens = [to_char[b] for b in range(256)]
    seen = set(tokens)
    rng = random.Random(0)
    alphabet = [to_char[b] for b in range(32, 127)]
    while len(tokens) < vocab_size:
        word = "".join(rng.choices(alphabet, k=rng.randint(2, 6)))
        if word not in seen:
            seen.add(word)
            tokens.append(word)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tokens[eos]).save_pretrained(path)
    return path


# --shrink: the model's vocabulary and tokenizer on one narrow layer (a CPU check of the GPU
# command, end to end in minutes)
SHRINK = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}  # fmt: skip


def run(
    llm, prompts, params, save_token_ids: Path | None = None
) -> tuple[float, list[int], list[str], dict]:
    """(seconds, output lengths, texts, the grammar counters this call added) of one generate
    call (`GrammarStats`, and `num_held`: admissions put off for a grammar not compiled yet;
    `steps`: where the loop's time went, `step_times`); the outputs' token ids written to
    `save_token_ids` if given."""
    engine = llm.llm_engine
    structured = engine.structured
    if structured.manager is not None:
        structured.manager.reset_max_ready_lag()  # this call's
    before = _grammar_counters(structured)
    records: list = []
    fill_s: list[float] = []  # the loop's `LoopTimes.fill_s` after each step

    def observer(record) -> None:
        records.append(record)
        fill_s.append(structured.times.fill_s)

    engine.add_step_observer(observer)
    allocator = _allocator_counters()
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.remove_step_observer(observer)
    wall = time.perf_counter() - start
    after = _grammar_counters(structured)
    added = {k: v - before.get(k, 0) for k, v in after.items() if k != "max_ready_lag_s"}
    added["cuda_allocator"] = {k: v - allocator[k] for k, v in _allocator_counters().items()}
    added["max_ready_lag_s"] = after.get("max_ready_lag_s", 0.0)
    added["steps"] = step_times(records, start)
    added["loop_ms_per_bitmask"] = loop_ms_per_bitmask(added)
    fills = [1e3 * (b - a) for a, b in zip([before.get("fill_s", 0.0), *fill_s], fill_s)]
    added["fill_ms_by_quarter"] = by_quarter([f for f in fills if f > 0])
    lens = [len(o.outputs[0].token_ids) for o in outs]
    if save_token_ids is not None:
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        save_token_ids.write_text(json.dumps({"token_ids": token_ids}))
    return wall, lens, [o.outputs[0].text for o in outs], added


def by_quarter(values: list[float]) -> list[float]:
    """Means of `values` (one per step, in step order) over its four quarters, the remainder
    in the last ([] with fewer than four values): where in a decode a cost is. A constrained
    run's `fill_ms_by_quarter` (ms of the fill that ended in each step, steps without one left
    out) shows this schema's masks getting dearer as the walk enters the `tags` strings: on
    the CPU the last quarter's fill ~17x the first's (results/2026-11-27h-cpu-fill-gap)."""
    n = len(values) // 4
    if not n:
        return []
    bounds = [0, n, 2 * n, 3 * n, len(values)]
    return [statistics.fmean(values[a:b]) for a, b in zip(bounds, bounds[1:])]


def step_times(records: list, start: float) -> dict:
    """Mean ms per step of the engine loop's parts over a run's `StepRecord`s: the period
    between steps' starts, and of it scheduling, launching, waiting for the step's tokens
    (`wait`: the device's lead; ~0 when the host is the bottleneck), updating (`update`: the
    scheduler, the grammars' advance and the outputs), and the rest (`other`: waiting for the
    step after's bitmask, launching its sampling); and how long after the call's start the
    first step began (`first_step_s`: admissions held for grammars delay it)."""
    if len(records) < 2:
        return {"num_steps": len(records)}
    starts = [r.started_at for r in records]
    period = (starts[-1] - starts[0]) / (len(records) - 1)
    parts = {name: 1e3 * sum(getattr(r, f"{name}_s") for r in records[:-1]) / (len(records) - 1)
             for name in ("schedule", "launch", "wait", "update")}  # fmt: skip
    return {"num_steps": len(records), "period_ms": 1e3 * period, **{f"{k}_ms": v for k, v in parts.items()},
            "other_ms": 1e3 * period - sum(parts.values()),
            "first_step_s": starts[0] - (start - time.perf_counter() + time.monotonic())}  # fmt: skip


def _allocator_counters() -> dict:
    """The CUDA caching allocator's counters ({} without a GPU): `num_device_free` and
    `num_alloc_retries` (cudaFree, and a malloc retried after freeing the cache) each
    synchronize the device, so a run that counts them made the host wait for the device in
    the middle of a step (the constrained step holds its logits' clone and its noise as well)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    names = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    return {k: stats.get(k, 0) for k in names}


def _grammar_counters(structured) -> dict:
    """The manager's `GrammarStats`, the admissions held and the loop's `LoopTimes`."""
    manager = structured.manager
    counters = {} if manager is None else dataclasses.asdict(manager.stats)
    return counters | {"num_held": structured.num_held} | dataclasses.asdict(structured.times)


def loop_ms_per_bitmask(added: dict) -> dict:
    """A run's `LoopTimes` in ms per constrained step: `mark`, `advance` (on the loop; of it
    `handover`, `collected`'s hand-over to the fill thread, and `advance_wait`, the wait for
    the thread's advance), `advanced` (the hand-over to the thread's advance results), `fill`
    (the fill's own time, mostly in its thread), `fill_wait` (the loop blocked on it),
    `fill_lag` (the fill's thread, or the grammar process, starting after `advance` handed it
    over), `fill_done` (from that hand-over to the fill's end) and, of `fill`, the
    library's own (`library_fill`, `GrammarStats.library_fill_s`), of `advance` the backend's
    batched call (`library_advance`, `GrammarStats.library_advance_s`; 0 for a tree from
    before it was counted)."""
    n = added.get("num_bitmasks", 0)
    names = ("mark", "advance", "handover", "advance_wait", "advanced", "fill", "fill_wait",
             "fill_lag", "fill_done", "library_fill", "library_advance")  # fmt: skip
    return {f"{k}_ms": 1e3 * added.get(f"{k}_s", 0.0) / n for k in names} if n else {}


def host_cpus() -> dict:
    """The CPUs this process may run on and how many hardware threads share a core (from
    /sys; None where it is not there): 16 CPUs may be 8 cores."""
    siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    per_core = None
    if siblings.exists():
        spans = [part.split("-") for part in siblings.read_text().strip().split(",")]
        per_core = sum(int(span[-1]) - int(span[0]) + 1 for span in spans)
    return {"cpus": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
            "threads_per_core": per_core}  # fmt: skip


def setup(args, tmp: str):
    """(LLM, prompts, (minItems, maxItems) of the schemas) for the model asked for."""
    n, rng = args.num_requests, random.Random(0)
    if args.model is None:  # the embedded model: real text prompts, real JSON
        llm = LLM(structured_outputs_backend=args.backend, **_grammar_process(args))
        words = ["Describe", "a", "record", "as", "JSON", "for", "the", "archive", "entry"]
        prompts = [" ".join(rng.choices(words, k=12)) + f" #{i}:" for i in range(n)]
        return llm, prompts, (1, 4)
    overrides = dict(SHRINK) if args.shrink else {}
    if args.vocab_size is not None:  # the stop and start tokens the vocabulary's last two
        v = args.vocab_size
        overrides.update(vocab_size=v, eos_token_id=v - 1, bos_token_id=v - 2)
    path = byte_level_tokenizer_dir(args.model, Path(tmp) / "model", **overrides)
    engine = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    engine.update(_grammar_process(args))
    llm = LLM(str(path), load_format="dummy", structured_outputs_backend=args.backend, **engine)
    vocab = llm.llm_engine.hf_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(256, vocab) for _ in range(args.prompt_len)]}
               for _ in range(n)]  # fmt: skip
    return llm, prompts, (200, 400)


def _grammar_process(args) -> dict:
    """The engine argument of `--grammar-process` (none without it: the engine's default)."""
    return {"structured_outputs_grammar_process": True} if args.grammar_process else {}


def measure(llm, prompts, items, args) -> dict:
    """The three runs (see the module docstring), interleaved: one schema, unconstrained, one
    schema again (compiled already), unconstrained again, then a schema per request twice
    (new schemas the second time, so both compile all of theirs)."""
    n = len(prompts)
    one = StructuredOutputsParams(json=schema(None, *items))
    cons = [SamplingParams(temperature=0.7, seed=i, max_tokens=args.output_len,
                           structured_outputs=one) for i in range(n)]  # fmt: skip
    wall_one, lens, texts, grammar_one = run(llm, prompts, cons, args.save_token_ids)
    free = [SamplingParams(temperature=0.7, seed=i, max_tokens=k, ignore_eos=True)
            for i, k in enumerate(lens)]  # fmt: skip
    wall_free, _, _, loop_free = run(llm, prompts, free)
    walls_one, grammars_one = [wall_one], [grammar_one]
    walls_free, loops_free = [wall_free], [loop_free]
    for _ in range(max(args.pairs, 2) - 1):  # more (one schema, unconstrained) pairs, alternated
        wall, _, _, grammar = run(llm, prompts, cons)
        walls_one.append(wall)
        grammars_one.append(grammar)
        wall, _, _, loop = run(llm, prompts, free)
        walls_free.append(wall)
        loops_free.append(loop)
    tokens, best_free = sum(lens), min(walls_free)
    pair_ratios = [f / o for f, o in zip(walls_free, walls_one)]  # each pair's own ratio
    result = {
        "output_tokens": tokens, "one_schema_valid_json": sum(1 for t in texts if _parses(t)),
        "unconstrained_s": walls_free, "one_schema_s": walls_one,
        "one_schema_ratio": best_free / min(walls_one),
        "one_schema_first_run_ratio": best_free / wall_one,
        "one_schema_pair_ratios": pair_ratios,
        "one_schema_median_pair_ratio": statistics.median(pair_ratios),
        "one_schema_grammar": grammars_one,
        "unconstrained_steps": [loop["steps"] for loop in loops_free],
        "unconstrained_cuda_allocator": [loop["cuda_allocator"] for loop in loops_free],
    }  # fmt: skip
    if args.skip_per_request:
        return result
    walls, own_tokens, grammars = [], [], []
    for offset in (0, n):
        own = [SamplingParams(temperature=0.7, seed=i, max_tokens=k, structured_outputs=
                              StructuredOutputsParams(json=schema(offset + i, *items)))
               for i, k in enumerate(lens)]  # fmt: skip
        wall, own_lens, own_texts, grammar = run(llm, prompts, own)
        walls.append(wall)
        own_tokens.append(sum(own_lens))
        grammars.append(grammar | {"valid_json": sum(1 for t in own_texts if _parses(t))})
    rates = [k / w for k, w in zip(own_tokens, walls)]
    result.update(
        per_request_schema_s=walls, per_request_schema_output_tokens=own_tokens,
        per_request_schema_ratio=max(rates) / (tokens / best_free),
        per_request_schema_first_run_ratio=rates[0] / (tokens / best_free),
        per_request_schema_grammar=grammars,
    )  # fmt: skip
    return result


def full_batch_warm_up(llm, prompts, items) -> list[float]:
    """Seconds of two 4-token runs of the whole batch, unconstrained and under a schema of
    the family not used after (`schema(-1)`): the engine's first steps at the batch's size
    (the sampler's and the bitmask's buffers at 1,024 rows) are paid here, not by the first
    measured run, which thus compiles its schema as a job would, on a warm engine."""
    spare = StructuredOutputsParams(json=schema(-1, *items))
    walls = []
    for constraint in (None, spare):
        params = SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs=constraint)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
    return walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a shipped config (random weights)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens [tokens]")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (random ids)")
    parser.add_argument("--skip-per-request", action="store_true")
    parser.add_argument("--pairs", type=int, default=2,
                        help="(one schema, unconstrained) pairs, alternated (>= 2); the JSON "
                             "has each pair's ratio and their median")  # fmt: skip
    parser.add_argument("--shrink", action="store_true", help="--model on one narrow layer")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="--model's vocabulary [tokens] (a CPU check of the loop's work)")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the engine's")
    parser.add_argument("--backend", default="llguidance", help="structured_outputs_backend")
    parser.add_argument("--grammar-threads", type=int, default=None,
                        help="the grammar library's threads (default: all CPUs but two)")  # fmt: skip
    parser.add_argument("--small-warm-up", action="store_true",
                        help="warm up on 2 requests only (before 2026-11-27: the first measured "
                        "run was the engine's first at the batch's size)")  # fmt: skip
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval [s] for the run (default: Python's 0.005): "
                        "how long the fill thread may wait for the GIL while the loop runs "
                        "Python (2026-11-27d-h200)")  # fmt: skip
    parser.add_argument("--grammar-process", action="store_true",
                        help="the grammars in a process of their own "
                        "(structured_outputs_grammar_process; 2026-11-27e-cpu-grammar-process)")  # fmt: skip
    parser.add_argument("--save-token-ids", type=Path, default=None,
                        help="write the first one-schema run's output token ids here "
                        "({\"token_ids\": [[...], ...]}: grammar_fill_threads.py --walks-file "
                        "replays them)")  # fmt: skip
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    with tempfile.TemporaryDirectory() as tmp:
        llm, prompts, items = setup(args, tmp)
        if args.grammar_threads is not None:  # read when the first constrained request comes
            llm.llm_engine.structured.num_threads = args.grammar_threads
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        start = time.perf_counter()  # the grammar library and its tokenizer info, once
        warm = StructuredOutputsParams(choice=["yes", "no"])
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, structured_outputs=warm), use_tqdm=False)  # fmt: skip
        result: dict = {"model": args.model or "embedded", "shrink": args.shrink,
                        "backend": args.backend, "num_requests": len(prompts),
                        "output_len": args.output_len, "vocab_size": args.vocab_size,
                        "max_num_seqs": args.max_num_seqs, "machine": platform.machine(),
                        **host_cpus(), "grammar_library_load_s": time.perf_counter() - start,
                        "grammar_threads": llm.llm_engine.structured.num_threads,
                        "switch_interval_s": sys.getswitchinterval(),
                        "grammar_process": llm.llm_engine.structured.process is not None,
                        "constrained_device_wait": device_wait_mode()}  # fmt: skip
        if not args.small_warm_up:
            result["full_batch_warm_up_s"] = full_batch_warm_up(llm, prompts, items)
        result.update(measure(llm, prompts, items, args))
    print(json.dumps(result, indent=2))
    print(f"one schema / unconstrained: {result['one_schema_ratio']:.3f}x")
    if "per_request_schema_ratio" in result:
        print(f"per-request schema / unconstrained: {result['per_request_schema_ratio']:.3f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
