"""Grammar libraries for structured outputs compared on the embedded model's tokenizer (49,152
tokens): xgrammar vs llguidance, same run, CPU only.

Measures, per library: building the tokenizer info from the HF tokenizer, compiling a typical
JSON schema (nested object, array, enum, numbers) the first time (no cache), filling one token
bitmask (mean over seeded random walks of the grammar: each step fills the mask, then accepts a
random allowed token, as a sampling model would: string contents included), and the installed
size of the package and its own dependencies.

    python benchmarks/structured_output_libs.py --out benchmarks/results/DATE/libs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "kind": {"enum": ["person", "company", "place"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "kind", "address"],
}
NUM_STEPS = 60  # tokens walked per walk
NUM_WALKS = 5


def _dist_size(name: str) -> int:
    """Bytes of the installed files of distribution `name`."""
    dist = metadata.distribution(name)
    total = 0
    for f in dist.files or []:
        path = Path(dist.locate_file(f))
        if path.is_file():
            total += path.stat().st_size
    return total


def _walk(new_matcher, fill, accept, stops: set[int]) -> float:
    """Mean seconds of one mask fill over NUM_WALKS seeded random walks of NUM_STEPS tokens
    (`new_matcher()` starts a walk and returns its matcher)."""
    times = []
    rng = np.random.default_rng(0)
    for _ in range(NUM_WALKS):
        matcher = new_matcher()
        for _ in range(NUM_STEPS):
            start = time.perf_counter()
            mask = fill(matcher)
            times.append(time.perf_counter() - start)
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
            allowed = [int(t) for t in np.flatnonzero(bits) if int(t) not in stops]
            if not allowed or not accept(matcher, int(rng.choice(allowed))):
                break
    return float(np.mean(times))


def bench_xgrammar(hf_tok, vocab_size: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab_size)
    t1 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def fill(matcher):
        matcher.fill_next_token_bitmask(bitmask)
        return bitmask[0]

    fill_s = _walk(
        lambda: xgr.GrammarMatcher(compiled),
        fill,
        lambda m, t: m.accept_token(t),
        set(info.stop_token_ids),
    )
    return {
        "version": metadata.version("xgrammar"),
        "tokenizer_info_s": t1 - t0,
        "compile_json_schema_s": t2 - t1,
        "mask_fill_s": fill_s,
        "install_bytes": _dist_size("xgrammar") + _dist_size("apache-tvm-ffi"),
        "install_note": "xgrammar + apache-tvm-ffi (also requires torch, transformers, triton, "
        "which phloem already has)",
    }


def bench_llguidance(hf_tok, vocab_size: int) -> dict:
    import llguidance as llg
    import llguidance.hf

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab_size)
    t1 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llg.LLMatcher(tok, grammar)
    t2 = time.perf_counter()
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def fill(m):
        bitmask[0] = np.frombuffer(m.compute_bitmask(), dtype=np.int32)[: bitmask.shape[1]]
        return bitmask[0]

    fill_s = _walk(
        lambda: llg.LLMatcher(tok, grammar),
        fill,
        lambda m, t: m.consume_token(t),
        {tok.eos_token},
    )
    return {
        "version": metadata.version("llguidance"),
        "tokenizer_info_s": t1 - t0,
        "compile_json_schema_s": t2 - t1,
        "mask_fill_s": fill_s,
        "install_bytes": _dist_size("llguidance"),
        "install_note": "llguidance only (no dependencies)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    from transformers import PreTrainedTokenizerFast

    from phloem.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    hf_tok = tok
    if not isinstance(tok, PreTrainedTokenizerFast):  # phloem's FastTokenizer
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token="<|im_end|>")
    vocab_size = len(hf_tok)
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "vocab_size": vocab_size,
        "schema": SCHEMA,
        "xgrammar": bench_xgrammar(hf_tok, vocab_size),
        "llguidance": bench_llguidance(hf_tok, vocab_size),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
