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

The engine's own host work for a 1,024-row step (`StructuredOutputManager.bitmask` and the
rows' `accept`) at the GPU host's thread counts:

    python -m benchmarks.structured_masks --libs llguidance --rows 1 --distinct 0 \
        --manager-seqs 1024 --threads 1,4,8,14 --out DIR/manager.json
"""

from __future__ import annotations

import argparse
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


def manager_steps(data, backend: str, num_seqs: int, steps: int, threads: int) -> dict:
    """The engine's own per-step host work for `num_seqs` sequences under the one schema:
    `StructuredOutputManager.bitmask` (fill plus the manager's copies and checks) and the
    advance of every row by its token (uniform among the allowed): `accept` one by one on even
    steps, `accept_many` on odd ones; mean ms per step."""
    from phloem.sampling_params import StructuredOutputsParams
    from phloem.structured_output import make_backend
    from phloem.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(make_backend(data, threads, backend), data.vocab_size, 2)
    params = StructuredOutputsParams(json=schema(None, 200, 400))
    ids = [f"s{i}" for i in range(num_seqs)]
    for seq_id in ids:
        manager.register(seq_id, params)
    manager.bitmask(ids)  # matchers built (in the pool)
    rng = np.random.default_rng(0)
    eos = data.stop_token_ids[0]
    fill_s: list[float] = []
    accept_s: dict[str, list[float]] = {"one by one": [], "together": []}
    for step in range(steps):
        start = time.perf_counter()
        grammar, failed = manager.bitmask(ids)
        fill_s.append(time.perf_counter() - start)
        assert not failed, failed
        bits = np.unpackbits(grammar.bitmask.view(np.uint8), axis=1, bitorder="little")
        bits[:, eos] = 0
        tokens = [int(rng.choice(np.flatnonzero(row[: data.vocab_size]))) for row in bits]
        start = time.perf_counter()
        if step % 2:  # together, as the engine does (`StructuredOutputs.advance`)
            assert manager.accept_many(list(zip(ids, tokens))) == [False] * num_seqs
            accept_s["together"].append(time.perf_counter() - start)
        else:
            for seq_id, token in zip(ids, tokens):
                assert manager.accept(seq_id, token) is False
            accept_s["one by one"].append(time.perf_counter() - start)
    manager.shutdown()
    return {"backend": backend, "num_seqs": num_seqs, "threads": threads,
            "bitmask_ms_per_step": 1e3 * float(np.mean(fill_s[1:])),
            "accept_ms_per_step": {k: 1e3 * float(np.mean(v)) for k, v in accept_s.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedded", action="store_true", help="the embedded model's tokenizer")
    parser.add_argument("--rows", type=int, default=32, help="matchers walked side by side")
    parser.add_argument("--steps", type=int, default=128, help="tokens per walk")
    parser.add_argument("--distinct", type=int, default=4, help="distinct schemas compiled")
    parser.add_argument("--libs", default="llguidance,xgrammar", help="also: llguidance-copies")
    parser.add_argument("--threads", default="1,2", help="fill threads to time, comma-separated")
    parser.add_argument("--unbounded-strings", action="store_true", help="drop maxLength")
    parser.add_argument("--manager-seqs", type=int, default=0,
                        help="also time the manager's step for this many sequences")  # fmt: skip
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
        result["manager"] = [manager_steps(data, name, args.manager_seqs, args.steps, threads)
                             for name in args.libs.split(",") for threads in args.threads]  # fmt: skip
        print(json.dumps(result["manager"], indent=1), flush=True)
    for name in args.libs.split(","):
        lib = classes[name](hf_tok, vocab_size, eos, args.threads)
        result[name] = bench(lib, decode, vocab_size, eos, args)
        print(name, json.dumps(result[name], indent=1), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
