"""Per-row mask-fill cost of the grammar libraries on the states a random-weight model visits,
and their compile cost, CPU only (issue 21: a 1,024-row constrained step must fill its masks
within the forward pass).

Tokenizers: the byte-level 128,256-token one that benchmarks/structured_outputs.py writes for
`--model llama-3.1-8b` (`byte_level_tokenizer_dir`), and the embedded model's (`--embedded`).
Schema: that benchmark's shared one (`schema(None, 200, 400)`: a tags array of >= 200 strings).

Walks: each of `--rows` matchers starts the schema and takes a random allowed token per step
(uniform among allowed non-EOS tokens, as a random-weight model sampling under a mask does)
for `--steps` steps. Each state is classed by the text so far: "string" (inside a JSON string),
"number", "other" (between keys and items). A batch fill of all rows is timed at every step with
the library's threaded fill at each of `--threads`; per class, a single-row fill is timed on each
row. Compile: one schema, and `--distinct` schemas with renamed properties (per schema).

    python -m benchmarks.structured_masks --out DIR/masks.json
    python -m benchmarks.structured_masks --embedded --out DIR/masks-embedded.json

The engine's own host work for a 1,024-row step (`StructuredOutputManager.bitmask` and
`accept_many`) at the GPU host's thread counts, llguidance's matchers copied from templates
(the backend's default) and built apart, over one recorded walk; a line per run as it ends
(~40 s on this 2-core machine at --threads 1,2; the 1-thread run is the longest):

    python -m benchmarks.structured_masks --libs llguidance --manager-seqs 1024 \
        --threads 1,4,8,14 --out DIR/manager.json

Mask cost by schema family, each matcher built apart (the one-schema run's schema for every
row, one renamed schema for every row, a schema per row):

    python -m benchmarks.structured_masks --by-schema --rows 32 --out DIR/by-schema.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.structured_outputs import byte_level_tokenizer_dir, schema


def classify(text: str) -> str:
    """'string' inside a JSON string, 'number' right after a digit/sign/point outside one,
    else 'other'."""
    in_string, escaped = False, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and in_string:
            escaped = True
        elif ch == '"':
            in_string = not in_string
    if in_string:
        return "string"
    return "number" if text and text[-1] in "0123456789-.eE+" else "other"


class Lib:
    """One library behind a few calls: compile(schema text), matcher(compiled), fill(matchers,
    bitmask, threads), accept(matcher, token), single(matcher, bitmask)."""


class LLG(Lib):
    name = "llguidance"

    def __init__(self, hf_tok, vocab_size, eos, threads):
        import llguidance as llg
        import llguidance.hf

        self.llg = llg
        start = time.perf_counter()
        from phloem.structured_output.llguidance_backend import SLICES

        self.tok = llguidance.hf.from_tokenizer(
            hf_tok, n_vocab=vocab_size, eos_token=[eos], slices=list(SLICES)
        )  # the backend's slices
        self.tokenizer_s = time.perf_counter() - start
        self.executors = {n: llg.LLExecutor(n) for n in threads}

    def compile(self, text):
        from phloem.sampling_params import StructuredOutputsParams
        from phloem.structured_output.llguidance_backend import grammar_text

        grammar = grammar_text(StructuredOutputsParams(json=text))
        probe = self.llg.LLMatcher(self.tok, grammar)
        assert not probe.is_error(), probe.get_error()
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def fill(self, matchers, bitmask, threads):
        from llguidance.numpy import fill_next_token_bitmask_par

        pairs = [(m, i) for i, m in enumerate(matchers)]
        fill_next_token_bitmask_par(self.executors[threads], pairs, bitmask)

    def single(self, matcher, bitmask):
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token):
        return matcher.try_consume_tokens([token]) == 1


class LLGCopies(LLG):
    """llguidance with every matcher a `deep_copy` of one template per compiled grammar (the
    copies share the template's lexer and its lazily built automaton, behind a lock)."""

    name = "llguidance-copies"

    def compile(self, text):
        grammar = super().compile(text)
        return self.llg.LLMatcher(self.tok, grammar)

    def matcher(self, compiled):
        return compiled.deep_copy()


class XGR(Lib):
    name = "xgrammar"

    def __init__(self, hf_tok, vocab_size, eos, threads):
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf_tok, vocab_size=vocab_size, stop_token_ids=[eos]
        )
        self.tokenizer_s = time.perf_counter() - start
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batch = {n: xgr.BatchGrammarMatcher(max_threads=n) for n in threads}

    def compile(self, text):
        return self.compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask, threads):
        self.batch[threads].batch_fill_next_token_bitmask(matchers, bitmask)

    def single(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token):
        return bool(matcher.accept_token(token))


def walk(lib: Lib, compiled, decode, vocab_size: int, eos: int, args, threads: int | None):
    """One seeded walk of `args.rows` matchers for `args.steps` tokens (the same tokens for any
    `threads`). threads a number: each step's batch fill is timed ({"all": [s per row]});
    None: each row's single fill is timed, by state class. Each state's mask is computed once
    (llguidance caches a matcher's mask until its next token). Returns (times, allowed token
    counts by class, texts)."""
    width = (vocab_size + 31) // 32
    matchers = [lib.matcher(compiled) for _ in range(args.rows)]
    rng = np.random.default_rng(0)
    texts = [""] * args.rows
    batch = np.zeros((args.rows, width), dtype=np.int32)
    one = np.zeros((1, width), dtype=np.int32)
    times: dict[str, list[float]] = {
        "all": [],
        "string": [],
        "number": [],
        "other": [],
        "accept": [],
    }
    allowed_counts: dict[str, list[int]] = {"string": [], "number": [], "other": []}
    for _ in range(args.steps):
        if threads is not None:
            start = time.perf_counter()
            lib.fill(matchers, batch, threads)
            times["all"].append((time.perf_counter() - start) / args.rows)
        for r, m in enumerate(matchers):
            kind = classify(texts[r])
            if threads is None:
                start = time.perf_counter()
                lib.single(m, one)
                times[kind].append(time.perf_counter() - start)
                batch[r] = one[0]
            bits = np.unpackbits(batch[r].view(np.uint8), bitorder="little")[:vocab_size]
            bits[eos] = 0
            allowed = np.flatnonzero(bits)
            allowed_counts[kind].append(len(allowed))
            token = int(rng.choice(allowed))
            start = time.perf_counter()
            ok = lib.accept(m, token)
            times["accept"].append(time.perf_counter() - start)
            assert ok, (lib.name, texts[r], token)
            texts[r] += decode(token)
    return times, allowed_counts, texts


def unbounded(value):
    """`value` (a schema) without maxLength: strings of any length."""
    if isinstance(value, dict):
        return {k: unbounded(v) for k, v in value.items() if k != "maxLength"}
    return value


def the_schema(index: int | None, args) -> str:
    one = schema(index, 200, 400)
    return json.dumps(unbounded(one) if args.unbounded_strings else one)


def bench(lib: Lib, decode, vocab_size: int, eos: int, args) -> dict:
    text = the_schema(None, args)
    start = time.perf_counter()
    compiled = lib.compile(text)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(args.distinct):
        lib.compile(the_schema(i, args))
    distinct_s = (time.perf_counter() - start) / max(1, args.distinct)
    start = time.perf_counter()
    for _ in range(args.rows):
        lib.matcher(compiled)
    matcher_s = (time.perf_counter() - start) / args.rows
    batch_s = {t: walk(lib, compiled, decode, vocab_size, eos, args, t)[0] for t in args.threads}
    single, allowed_counts, texts = walk(lib, compiled, decode, vocab_size, eos, args, None)
    return {
        "tokenizer_info_s": lib.tokenizer_s,
        "compile_one_schema_s": compile_s,
        "compile_per_distinct_schema_s": distinct_s,
        "matcher_s": matcher_s,
        "batch_fill_per_row_ms": {t: 1e3 * float(np.mean(v["all"])) for t, v in batch_s.items()},
        "single_fill_ms": {k: 1e3 * float(np.mean(v)) for k, v in single.items() if k != "all"},
        "states": {k: len(v) for k, v in single.items() if k not in ("all", "accept")},
        "mean_allowed": {k: float(np.mean(v)) if v else None for k, v in allowed_counts.items()},
        "sample_text": texts[0][:160],
    }


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int32)


def choose_tokens(bitmask: np.ndarray, eos: int, rng: np.random.Generator) -> list[int]:
    """One token per row of `bitmask` (int32 [R, W]), uniform among the row's allowed tokens
    but `eos` (EOS where it is the only one), as a random-weight model sampling under the mask:
    popcounts by byte, the chosen word by cumulative count (vectorized; ~50 ms for 1,024 rows
    of 128K tokens, against ~0.3 s unpacking every bit)."""
    words = bitmask.copy().view(np.uint32)
    words[:, eos // 32] &= np.uint32(~(1 << (eos % 32)) & 0xFFFFFFFF)
    num_rows = words.shape[0]
    counts = _POPCOUNT[words.view(np.uint8)].reshape(num_rows, -1, 4).sum(axis=2)
    cumulative = np.cumsum(counts, axis=1)
    total = cumulative[:, -1]
    pick = (rng.random(num_rows) * total).astype(np.int64)
    word = (cumulative <= pick[:, None]).sum(axis=1)
    before = np.where(word > 0, cumulative[np.arange(num_rows), np.maximum(word - 1, 0)], 0)
    tokens = []
    for r in range(num_rows):
        if total[r] == 0:
            tokens.append(eos)
            continue
        bits = int(words[r, word[r]])
        for _ in range(int(pick[r] - before[r])):
            bits &= bits - 1  # drop the lowest set bit
        tokens.append(32 * int(word[r]) + (bits & -bits).bit_length() - 1)
    return tokens


_TOKENIZER_INFO: dict = {}  # id(TokenizerData) -> the first llguidance backend over it


def _grammar_backend(data, name: str, threads: int, sharing: str):
    """The engine's backend `name` on `threads`; llguidance with `sharing` "templates" (the
    default: copies of 4 x threads templates) or "apart" (every matcher built apart), its
    tokenizer info built once per process."""
    from phloem.structured_output import make_backend
    from phloem.structured_output.llguidance_backend import LLGuidanceBackend

    if name != "llguidance":
        return make_backend(data, threads, name)
    per_thread = 0 if sharing == "apart" else 4
    first = _TOKENIZER_INFO.get(id(data))
    backend = LLGuidanceBackend(data, threads, per_thread, same_tokenizer_as=first)
    _TOKENIZER_INFO.setdefault(id(data), backend)
    return backend


def manager_steps(data, name: str, num_seqs: int, walk: list[list[int]], threads: int,
                  sharing: str, time_every: int) -> dict:  # fmt: skip
    """The engine's own per-step host work for `num_seqs` sequences under the one schema,
    replaying `walk` (each step's token per sequence): `StructuredOutputManager.bitmask` (fill
    plus the manager's copies and checks) on every `time_every`-th step, `accept_many` on
    every step (a matcher needs no mask to advance); mean ms per timed step, and the fill's
    CPU time (the process's, all threads: `threads_busy` = CPU / wall, the threads the fill
    kept busy; one waiting for a lexer's lock is not). Also how long
    registering the sequences took until every matcher was ready (the manager's pool on
    `threads` threads; the engine holds a request's admission until then)."""
    from phloem.sampling_params import StructuredOutputsParams
    from phloem.structured_output.manager import StructuredOutputManager

    backend = _grammar_backend(data, name, threads, sharing)
    manager = StructuredOutputManager(backend, data.vocab_size, threads)
    params = StructuredOutputsParams(json=schema(None, 200, 400))
    ids = [f"s{i}" for i in range(num_seqs)]
    gc.collect()  # the previous run's garbage is not this one's readiness
    start = time.perf_counter()
    for seq_id in ids:
        manager.register(seq_id, params)
    manager.wait_ready(ids)
    ready_s = time.perf_counter() - start
    manager.bitmask(ids)  # the first masks (all at the start state) apart
    fill_s: list[float] = []
    fill_cpu_s: list[float] = []  # all of the process's threads
    accept_s: list[float] = []
    for step, tokens in enumerate(walk):
        if step % time_every == 0:
            start, cpu = time.perf_counter(), time.process_time()
            _, failed = manager.bitmask(ids)
            fill_s.append(time.perf_counter() - start)
            fill_cpu_s.append(time.process_time() - cpu)
            assert not failed, failed
        start = time.perf_counter()
        done = manager.accept_many(list(zip(ids, tokens)))
        accept_s.append(time.perf_counter() - start)
        assert None not in done, "the walk left the grammar"
    manager.shutdown()
    return {"backend": name, "sharing": sharing, "num_seqs": num_seqs, "threads": threads,
            "timed_steps": len(fill_s), "all_ready_ms": 1e3 * ready_s,
            "bitmask_ms_per_step": 1e3 * float(np.mean(fill_s)),
            "bitmask_ms_per_row": 1e3 * float(np.mean(fill_s)) / num_seqs,
            "bitmask_cpu_ms_per_row": 1e3 * float(np.mean(fill_cpu_s)) / num_seqs,
            "threads_busy": float(np.sum(fill_cpu_s) / np.sum(fill_s)),
            "accept_many_ms_per_step": 1e3 * float(np.mean(accept_s))}  # fmt: skip


def record_walk(data, num_seqs: int, steps: int, threads: int) -> list[list[int]]:
    """`steps` tokens for each of `num_seqs` sequences under the one schema, each uniform
    among the allowed non-EOS tokens (`choose_tokens`), seeded."""
    from phloem.sampling_params import StructuredOutputsParams
    from phloem.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(_grammar_backend(data, "llguidance", threads, "templates"),
                                      data.vocab_size, threads)  # fmt: skip
    params = StructuredOutputsParams(json=schema(None, 200, 400))
    ids = [f"s{i}" for i in range(num_seqs)]
    for seq_id in ids:
        manager.register(seq_id, params)
    rng = np.random.default_rng(0)
    walk = []
    for _ in range(steps):
        grammar, _ = manager.bitmask(ids)
        tokens = choose_tokens(grammar.bitmask, data.stop_token_ids[0], rng)
        assert None not in manager.accept_many(list(zip(ids, tokens)))
        walk.append(tokens)
    manager.shutdown()
    return walk


def thread_scaling(data, args) -> list[dict]:
    """`manager_steps` for each of `args.libs`, `args.sharing` and `args.threads` over one
    recorded walk (the masks do not depend on them), one line printed per run as it ends."""
    start = time.perf_counter()
    walk = record_walk(data, args.manager_seqs, args.steps, max(args.threads))
    print(f"walk of {args.manager_seqs} x {args.steps} tokens recorded in "
          f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    runs = []
    for name in args.libs.split(","):
        for sharing in args.sharing.split(",") if name == "llguidance" else ["-"]:
            for threads in args.threads:
                run = manager_steps(data, name, args.manager_seqs, walk, threads, sharing,
                                    args.time_every)  # fmt: skip
                print(json.dumps(run), flush=True)
                runs.append(run)
    return runs


def schema_walks(data, args) -> dict:
    """Mask cost by schema, apart from any sharing: `args.rows` matchers, each built apart,
    walked `args.steps` tokens (uniform among the allowed), each mask timed alone by state
    class, for three families: the one-schema run's schema for every row ("shared"), one
    renamed schema for every row ("renamed": `schema(7)`, the keys of the per-request runs),
    and a schema per row ("distinct")."""
    import llguidance as llg

    from phloem.sampling_params import StructuredOutputsParams
    from phloem.structured_output.llguidance_backend import grammar_text

    backend = _grammar_backend(data, "llguidance", 1, "apart")
    decode, eos = data.tokenizer.decode, data.stop_token_ids[0]
    families = {"shared": lambda i: None, "renamed": lambda i: 7, "distinct": lambda i: i}
    out = {}
    for family, index in families.items():
        texts = [grammar_text(StructuredOutputsParams(json=schema(index(r), 200, 400)))
                 for r in range(args.rows)]  # fmt: skip
        matchers = [llg.LLMatcher(backend.tokenizer, t) for t in texts]
        one = np.zeros((1, (data.vocab_size + 31) // 32), dtype=np.int32)
        rng = np.random.default_rng(args.seed)
        outputs = [""] * args.rows
        times: dict[str, list[float]] = {"string": [], "number": [], "other": []}
        for _ in range(args.steps):
            for r, m in enumerate(matchers):
                start = time.perf_counter()
                m.unsafe_compute_mask_ptr(one.ctypes.data, one.nbytes)
                times[classify(outputs[r])].append(time.perf_counter() - start)
                token = choose_tokens(one, eos, rng)[0]
                assert m.consume_token(token)
                outputs[r] += decode([token])
        total = sum(sum(v) for v in times.values())
        out[family] = {"mask_ms": 1e3 * total / (args.rows * args.steps),
                       "by_state": {k: {"share": len(v) / (args.rows * args.steps),
                                        "ms": 1e3 * float(np.mean(v)) if v else None}
                                    for k, v in times.items()},
                       "sample_text": outputs[0][:120]}  # fmt: skip
        print(family, json.dumps(out[family]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedded", action="store_true", help="the embedded model's tokenizer")
    parser.add_argument("--rows", type=int, default=32, help="matchers walked side by side")
    parser.add_argument("--steps", type=int, default=128, help="tokens per walk")
    parser.add_argument("--distinct", type=int, default=4, help="distinct schemas compiled")
    parser.add_argument("--libs", default="llguidance,xgrammar", help="also: llguidance-copies")
    parser.add_argument("--threads", default="1,2", help="fill threads to time, comma-separated")
    parser.add_argument("--unbounded-strings", action="store_true", help="drop maxLength")
    parser.add_argument(
        "--manager-seqs",
        type=int,
        default=0,
        help="time the manager's step for this many sequences (only that)",
    )
    parser.add_argument(
        "--sharing",
        default="templates,apart",
        help="llguidance matchers in --manager-seqs runs: templates, apart",
    )
    parser.add_argument(
        "--time-every",
        type=int,
        default=4,
        help="--manager-seqs runs time the bitmask of every N-th step",
    )
    parser.add_argument("--by-schema", action="store_true",
                        help="mask cost by schema family (shared, renamed, distinct) only")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="--by-schema walks' seed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    from transformers import AutoTokenizer

    from phloem.structured_output import tokenizer_data

    with tempfile.TemporaryDirectory() as tmp:
        if args.embedded:
            from phloem.models.loader import load_tokenizer, resolve_model

            tok = load_tokenizer(resolve_model(None))
            data = tokenizer_data(tok, tok.vocab_size, tok.eos_token_id)
        else:
            path = byte_level_tokenizer_dir("llama-3.1-8b", Path(tmp) / "model")
            hf = AutoTokenizer.from_pretrained(path)
            config = json.loads((path / "config.json").read_text())
            data = tokenizer_data(hf, config["vocab_size"], hf.eos_token_id)
    hf_tok, vocab_size, eos = data.tokenizer, data.vocab_size, data.stop_token_ids[0]

    def decode(token: int) -> str:
        return hf_tok.decode([token])

    result: dict = {"machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "vocab_size": vocab_size, "rows": args.rows,
                    "steps": args.steps, "unbounded_strings": args.unbounded_strings,
                    "tokenizer": "embedded" if args.embedded else "byte-level"}  # fmt: skip
    classes = {"llguidance": LLG, "llguidance-copies": LLGCopies, "xgrammar": XGR}
    if args.manager_seqs:
        result["manager"] = thread_scaling(data, args)
    elif args.by_schema:
        result["by_schema"] = schema_walks(data, args)
    else:
        for name in args.libs.split(","):
            lib = classes[name](hf_tok, vocab_size, eos, args.threads)
            result[name] = bench(lib, decode, vocab_size, eos, args)
            print(name, json.dumps(result[name], indent=1), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
