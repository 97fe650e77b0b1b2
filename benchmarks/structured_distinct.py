"""Where the host time of a batch with a schema per request goes, CPU only (issue 21: 1,024
requests, each with its own JSON schema, must run at >= 0.85x unconstrained on the GPU).

Schemas: benchmarks/structured_outputs.py's family, `schema(i, ...)` (properties renamed per
request, so each compiles); tokenizers: its byte-level 128,256-token one (`--model`'s) or the
embedded model's (`--embedded`). Three parts:

- compile: per distinct schema, the phases of `StructuredOutputManager.register` (the
  constraint's key, the library's grammar text, the grammar built over the tokenizer, each
  sequence's matcher), one after the other on this thread;
- manager: `--seqs` sequences registered with the manager, one schema for all vs one each, at
  each of `--threads`: the wall time until every matcher is ready (the compile pool's
  throughput), and a Python loop's slowdown on the main thread meanwhile (the engine loop's
  share of the GIL while the pool compiles);
- fill: `--seqs` matchers walked `--steps` tokens (uniform among the allowed non-EOS tokens, as
  a random-weight model), one schema vs one each: `StructuredOutputManager.bitmask` per step
  (the first step's fresh matchers apart) and `accept_many`.

    python -m benchmarks.structured_distinct --seqs 1024 --out DIR/distinct-128k.json
    python -m benchmarks.structured_distinct --embedded --seqs 1024 --out DIR/distinct-emb.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.structured_outputs import byte_level_tokenizer_dir, schema


def _ms(values: list[float]) -> dict:
    values = sorted(values)
    return {
        "mean": 1e3 * statistics.fmean(values),
        "p50": 1e3 * values[len(values) // 2],
        "p99": 1e3 * values[min(len(values) - 1, int(len(values) * 0.99))],
        "max": 1e3 * values[-1],
    }


def compile_phases(backend, schemas: list[dict]) -> dict:
    """ms per distinct schema of each phase of a constraint's way to its first matcher: the
    cache key, the library's grammar text (part of `compile`), `compile` (the text and the
    grammar built over the tokenizer), and a sequence's `matcher`."""
    from phloem.sampling_params import StructuredOutputsParams
    from phloem.structured_output.llguidance_backend import grammar_text

    phases: dict[str, list[float]] = {"key": [], "grammar_text": [], "compile": [], "matcher": []}
    for one in schemas:
        t0 = time.perf_counter()
        params = StructuredOutputsParams(json=one)
        params.key()
        t1 = time.perf_counter()
        grammar_text(params)
        t2 = time.perf_counter()
        compiled = backend.compile(params)
        t3 = time.perf_counter()
        backend.matcher(compiled)
        t4 = time.perf_counter()
        for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[name].append(dt)
    return {name: _ms(v) for name, v in phases.items()}


def _spin(stop: threading.Event, laps: list[float]) -> None:
    """A pure-Python loop timing laps of 10,000 additions until `stop` (the GIL's availability
    to the engine loop)."""
    while not stop.is_set():
        start, x = time.perf_counter(), 0
        for k in range(10_000):
            x += k
        laps.append(time.perf_counter() - start)


def manager_registration(data, seqs: int, distinct: bool, threads: int, items) -> dict:
    """Register `seqs` sequences and wait until each one's matcher is ready, a Python loop
    spinning on this thread meanwhile."""
    from phloem.sampling_params import StructuredOutputsParams
    from phloem.structured_output import make_backend
    from phloem.structured_output.manager import StructuredOutputManager

    backend = make_backend(data, threads)
    manager = StructuredOutputManager(backend, data.vocab_size, threads)
    params = [StructuredOutputsParams(json=schema(i if distinct else None, *items))
              for i in range(seqs)]  # fmt: skip
    alone: list[float] = []
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    _spin(stop, alone)
    laps: list[float] = []
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop, laps))
    start = time.perf_counter()
    for i, p in enumerate(params):
        manager.register(f"s{i}", p)
    registered = time.perf_counter() - start
    spinner.start()
    manager.wait_ready([f"s{i}" for i in range(seqs)])
    ready = time.perf_counter() - start
    stop.set()
    spinner.join()
    manager.shutdown()
    return {"distinct": distinct, "threads": threads, "register_all_s": registered,
            "all_ready_s": ready, "per_seq_ms": 1e3 * ready / seqs,
            "python_lap_alone_ms": _ms(alone), "python_lap_while_compiling_ms": _ms(laps)}  # fmt: skip


def fill_walk(data, seqs: int, distinct: bool, steps: int, threads: int, items) -> dict:
    """The manager's bitmask and advance per step for `seqs` walking sequences."""
    from phloem.sampling_params import StructuredOutputsParams
    from phloem.structured_output import make_backend
    from phloem.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(make_backend(data, threads), data.vocab_size, threads)
    ids = [f"s{i}" for i in range(seqs)]
    for i, seq_id in enumerate(ids):
        one = schema(i if distinct else None, *items)
        manager.register(seq_id, StructuredOutputsParams(json=one))
    manager.wait_ready(ids)
    rng = np.random.default_rng(0)
    eos = data.stop_token_ids[0]
    fill_s: list[float] = []
    accept_s: list[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        grammar, failed = manager.bitmask(ids)
        fill_s.append(time.perf_counter() - start)
        assert not failed, failed
        bits = np.unpackbits(grammar.bitmask.view(np.uint8), axis=1, bitorder="little")
        bits[:, eos] = 0
        tokens = [int(rng.choice(np.flatnonzero(row[: data.vocab_size]))) for row in bits]
        start = time.perf_counter()
        done = manager.accept_many(list(zip(ids, tokens)))
        accept_s.append(time.perf_counter() - start)
        assert None not in done
    manager.shutdown()
    return {"distinct": distinct, "threads": threads, "seqs": seqs,
            "first_bitmask_ms": 1e3 * fill_s[0], "bitmask_ms": _ms(fill_s[1:]),
            "bitmask_per_row_ms": 1e3 * statistics.fmean(fill_s[1:]) / seqs,
            "accept_many_ms": _ms(accept_s)}  # fmt: skip


def tokenizer(embedded: bool):
    """(TokenizerData, (minItems, maxItems) of the benchmark's schema for this model)."""
    from transformers import AutoTokenizer

    from phloem.structured_output import tokenizer_data

    if embedded:
        from phloem.models.loader import load_tokenizer, resolve_model

        tok = load_tokenizer(resolve_model(None))
        return tokenizer_data(tok, tok.vocab_size, tok.eos_token_id), (1, 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = byte_level_tokenizer_dir("llama-3.1-8b", Path(tmp) / "model")
        hf = AutoTokenizer.from_pretrained(path)
        vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    return tokenizer_data(hf, vocab_size, hf.eos_token_id), (200, 400)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedded", action="store_true", help="the embedded model's tokenizer")
    parser.add_argument("--seqs", type=int, default=1024, help="sequences (distinct schemas)")
    parser.add_argument("--compile-schemas", type=int, default=256, help="timed phase by phase")
    parser.add_argument("--steps", type=int, default=16, help="tokens per fill walk")
    parser.add_argument("--threads", default="1,2", help="pool and fill threads, comma-separated")
    parser.add_argument("--parts", default="compile,manager,fill")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    parts = args.parts.split(",")
    start = time.perf_counter()
    data, items = tokenizer(args.embedded)
    from phloem.structured_output import make_backend

    backend = make_backend(data, 1)
    result: dict = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load_avg_start": os.getloadavg(), "vocab_size": data.vocab_size,
                    "tokenizer": "embedded" if args.embedded else "byte-level", "seqs": args.seqs,
                    "tokenizer_and_backend_s": time.perf_counter() - start}  # fmt: skip
    if "compile" in parts:
        schemas = [schema(i, *items) for i in range(args.compile_schemas)]
        result["compile_ms_per_schema"] = compile_phases(backend, schemas)
        print(json.dumps(result["compile_ms_per_schema"], indent=1), flush=True)
    if "manager" in parts:
        result["registration"] = [
            manager_registration(data, args.seqs, distinct, t, items)
            for t in threads
            for distinct in (False, True)
        ]
        print(json.dumps(result["registration"], indent=1), flush=True)
    if "fill" in parts:
        result["fill"] = [
            fill_walk(data, args.seqs, distinct, args.steps, t, items)
            for t in threads
            for distinct in (False, True)
        ]
        print(json.dumps(result["fill"], indent=1), flush=True)
    result["load_avg_end"] = os.getloadavg()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
