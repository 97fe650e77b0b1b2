"""Cost of one grammar bitmask (llguidance), split by where the row is in its JSON, on the CPU.

The GPU structured-outputs benchmark (`structured_outputs.py --model llama-3.1-8b`) fills 1,024
masks a step under one schema over a byte-level tokenizer of 128,256 random printable tokens.
This script replays the same schema on the same tokenizer (or the embedded SmolLM2 tokenizer,
49,152 real BPE tokens) row by row, on one thread:

1. records `--walks` seeded walks of `--steps` tokens: each step fills the mask and picks an
   allowed token (`--walk uniform`: uniformly, as a random-weight model does;
   `--walk short`: the closing quote whenever allowed with probability 0.35, else uniformly,
   so strings stay short as a real model's would);
2. replays every walk under each slice set of `--slices` (`SLICE_SETS`; each replay a fresh
   copy of one warmed matcher, the sets alternated over `--repeats` passes) and times each
   mask (`fill_next_token_bitmask`, one row), grouped by the row's state: inside a string
   after N characters (`s00`..`s16`), or not in a string (`other`: keys, numbers, structure);
   the masks of every slice set must be the same bit for bit (a digest of all of them);
3. `--batch R`: R rows drawn from the recorded walks (each at a random step) filled together
   through phloem's backend (`LLGuidanceBackend.fill_bitmasks`, its templates and thread
   pool, `--threads`), `--repeats` times: ms per R-row fill.

    OMP_NUM_THREADS=1 python benchmarks/grammar_fill.py --tokenizer synthetic \
        --slices current,default --batch 1024 --out DIR/fill-128k.json
    OMP_NUM_THREADS=1 python benchmarks/grammar_fill.py --tokenizer embedded --out DIR/fill-49k.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from structured_outputs import byte_level_tokenizer_dir, schema  # noqa: E402

from phloem.sampling_params import StructuredOutputsParams  # noqa: E402
from phloem.structured_output.llguidance_backend import SLICES, grammar_text  # noqa: E402

_CHAR = r'[^"\\\x00-\x1F\x7F]'
# slice sets compared (None: llguidance's defaults, []: none); "current" is the backend's
SLICE_SETS: dict[str, list[str] | None] = {
    "current": list(SLICES),
    "default": None,
    "none": [],
    # the backend's until 2026-11-27f: a slice for every remaining length 1-10
    "lengths1-10": [
        SLICES[0],
        *(f"{_CHAR}{{1,{n}}}" for n in (*range(1, 11), 16, 30)),
        f"{_CHAR}+",
    ],  # fmt: skip
    # fewer, wider slices: fewer tries walked apart when several are not subsumed
    "coarse": [SLICES[0], *(f"{_CHAR}{{1,{n}}}" for n in (3, 5, 7, 10, 16, 30)), f"{_CHAR}+"],
}


def _slice_regexes(name: str) -> tuple[str, ...]:
    """The regexes of slice set `name` (llguidance's own for "default")."""
    import llguidance as llg

    regexes = SLICE_SETS[name]
    return tuple(llg.LLTokenizer.general_slices() if regexes is None else regexes)


def load_tokenizer(args):
    """(transformers tokenizer, vocabulary size, EOS id) for `--tokenizer`."""
    from transformers import AutoTokenizer

    if args.tokenizer == "embedded":
        from phloem.models.loader import load_tokenizer as load
        from phloem.models.loader import resolve_model

        tok = load(resolve_model(None))
        return tok, len(tok), tok.eos_token_id
    overrides = {}
    if args.vocab_size is not None:  # as structured_outputs.py --vocab-size
        v = args.vocab_size
        overrides = dict(vocab_size=v, eos_token_id=v - 1, bos_token_id=v - 2)
    path = byte_level_tokenizer_dir(args.model, Path(tempfile.mkdtemp()) / "model", **overrides)
    config = json.loads((path / "config.json").read_text())
    eos = config["eos_token_id"]
    return (
        AutoTokenizer.from_pretrained(str(path)),
        config["vocab_size"],
        (eos[0] if isinstance(eos, list) else eos),
    )


def allowed_ids(mask: np.ndarray, vocab_size: int, eos: int) -> np.ndarray:
    """Token ids set in one int32 bitmask row, EOS left out."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]
    ids = np.flatnonzero(bits)
    return ids[ids != eos]


def record_walks(llg_tok, text: str, vocab_size: int, eos: int, args) -> list[list[int]]:
    """`args.walks` seeded walks of up to `args.steps` tokens (see the module docstring)."""
    import llguidance as llg
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    rng = random.Random(0)
    quote = llg_tok.tokenize_bytes(b'"')
    quote_id = quote[0] if len(quote) == 1 else -1
    mask = allocate_token_bitmask(1, vocab_size)
    walks = []
    for _ in range(args.walks):
        matcher, tokens = llg.LLMatcher(llg_tok, text), []
        for _ in range(args.steps):
            fill_next_token_bitmask(matcher, mask, 0)
            ids = allowed_ids(mask[0], vocab_size, eos)
            if not len(ids):
                break
            pick = int(ids[rng.randrange(len(ids))])
            if args.walk == "short" and quote_id in ids and rng.random() < 0.35:
                pick = quote_id
            assert matcher.consume_token(pick)
            tokens.append(pick)
        walks.append(tokens)
    return walks


def state_of(text: bytes) -> str:
    """Where a JSON prefix ends: "sNN" inside a string after NN characters (escapes count
    one, capped at 16), else "other"."""
    inside, escaped, count = False, False, 0
    for c in text:
        if not inside:
            inside, count = c == 0x22, 0
        elif escaped:
            escaped, count = False, count + 1
        elif c == 0x5C:
            escaped = True
        elif c == 0x22:
            inside = False
        else:
            count += 1
    return f"s{min(count, 16):02d}" if inside else "other"


def replay(llg_toks: dict, text: str, walks, states, vocab_size: int, repeats: int) -> dict:
    """{slice set: {state: mean ms a mask}} over the walks, sets alternated; and the masks'
    digest per set (every set must give the same masks)."""
    import llguidance as llg
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    mask = allocate_token_bitmask(1, vocab_size)
    total = {name: defaultdict(float) for name in llg_toks}
    digests = {name: hashlib.sha1() for name in llg_toks}
    templates = {name: llg.LLMatcher(tok, text) for name, tok in llg_toks.items()}
    names = list(llg_toks)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            for tokens, row_states in zip(walks, states):
                matcher = templates[name].deep_copy()
                for token, state in zip(tokens, row_states):
                    start = time.perf_counter()
                    fill_next_token_bitmask(matcher, mask, 0)
                    total[name][state] += time.perf_counter() - start
                    if rep == 0:
                        digests[name].update(mask.tobytes())
                    assert matcher.consume_token(token)
    counts: dict[str, int] = defaultdict(int)
    for row_states in states:
        for state in row_states:
            counts[state] += 1
    out = {}
    for name in names:
        per = {s: total[name][s] / repeats / counts[s] * 1e3 for s in sorted(counts)}
        per["all"] = sum(total[name].values()) / repeats / sum(counts.values()) * 1e3
        out[name] = {"ms_per_mask": per, "digest": digests[name].hexdigest()[:16]}
    out["num_masks"] = dict(counts)
    return out


def batch_rows(walks, num_rows: int, seed: int) -> list[list[int]]:
    """The tokens each of `num_rows` rows has consumed: row i a prefix of walk i % W, cut at
    a random step."""
    rng = random.Random(seed)
    return [walks[i % len(walks)][: rng.randrange(len(walks[i % len(walks)]))]
            for i in range(num_rows)]  # fmt: skip


def batch_fill(hf_tok, vocab_size: int, eos: int, walks, args) -> list[dict]:
    """ms per `args.batch`-row fill through phloem's backend, for every (threads, templates
    per thread) of `args.threads` x `args.templates`, configurations alternated over
    `args.repeats` rounds; every round fills the same rows, new matchers each time (a matcher
    keeps its mask until it advances). A backend's first fill (its templates' lexers cold) is
    not counted."""
    from llguidance.numpy import allocate_token_bitmask

    from phloem.structured_output.backend import TokenizerData
    from phloem.structured_output.llguidance_backend import LLGuidanceBackend

    data = TokenizerData(hf_tok, vocab_size, (eos,))
    params = StructuredOutputsParams(json=schema(None, 200, 400))
    configs, shared = [], {}
    for name in args.batch_slices.split(","):
        for threads in (int(t) for t in str(args.threads).split(",")):
            for per in (int(t) for t in str(args.templates).split(",")):
                backend = LLGuidanceBackend(data, threads, per, same_tokenizer_as=shared.get(
                    name), slices=_slice_regexes(name))  # fmt: skip
                shared.setdefault(name, backend)
                configs.append({"slices": name, "threads": threads, "templates_per_thread": per,
                                "backend": backend, "compiled": backend.compile(params),
                                "fill_ms": []})  # fmt: skip
    bitmask = allocate_token_bitmask(args.batch, vocab_size)
    rows = list(range(args.batch))
    for round_ in range(args.repeats + 1):
        prefixes = batch_rows(walks, args.batch, seed=round_)
        for config in configs if round_ % 2 else configs[::-1]:
            backend = config["backend"]
            matchers = []
            for tokens in prefixes:
                matcher = backend.matcher(config["compiled"])
                for token in tokens:
                    assert matcher.accept_token(token)
                matchers.append(matcher)
            start = time.perf_counter()
            backend.fill_bitmasks(matchers, bitmask, rows)
            if round_:
                config["fill_ms"].append((time.perf_counter() - start) * 1e3)
    return [{k: v for k, v in c.items() if k not in ("backend", "compiled")} for c in configs]


def add_walk_args(parser: argparse.ArgumentParser, walks: int, walks_help: str = "") -> None:
    """The options `load_tokenizer` and `record_walks` read: --tokenizer, --model,
    --vocab-size, --walk and --walks (default `walks`)."""
    parser.add_argument("--tokenizer", choices=("synthetic", "embedded"), default="synthetic")
    parser.add_argument("--model", default="llama-3.1-8b", help="synthetic: whose config")
    parser.add_argument("--vocab-size", type=int, help="synthetic: another vocabulary size")
    parser.add_argument("--walk", choices=("uniform", "short"), default="uniform")
    parser.add_argument("--walks", type=int, default=walks, help=walks_help or None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_walk_args(parser, 12)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--slices", default="current", help="comma list of SLICE_SETS names")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="rows of a batched fill (0: none)")
    parser.add_argument("--threads", default="1", help="batched fill: comma list of threads")
    parser.add_argument(
        "--batch-slices", default="current", help="batched fill: comma list of SLICE_SETS names"
    )
    parser.add_argument(
        "--templates",
        default="4",
        help="batched fill: comma list of "
        "templates per thread (LLGuidanceBackend's templates_per_thread)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import llguidance.hf

    hf_tok, vocab_size, eos = load_tokenizer(args)
    llg_toks, build_s = {}, {}
    for name in args.slices.split(","):
        start = time.perf_counter()
        llg_toks[name] = llguidance.hf.from_tokenizer(
            hf_tok, n_vocab=vocab_size, eos_token=[eos], slices=SLICE_SETS[name]
        )
        build_s[name] = time.perf_counter() - start
    text = grammar_text(StructuredOutputsParams(json=schema(None, 200, 400)))
    first = next(iter(llg_toks.values()))
    walks = record_walks(first, text, vocab_size, eos, args)
    states = [[state_of(first.decode_bytes(w[:i])) for i in range(len(w))] for w in walks]
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "vocab_size": vocab_size,
              "machine": platform.processor() or platform.machine(),
              "tokenizer_build_s": build_s,
              "replay": replay(llg_toks, text, walks, states, vocab_size, args.repeats)}  # fmt: skip
    if args.batch:
        result["batch"] = batch_fill(hf_tok, vocab_size, eos, walks, args)
    _print(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def _print(result: dict) -> None:
    replayed = result["replay"]
    names = [n for n in replayed if n != "num_masks"]
    print(f"vocab {result['vocab_size']}; ms a mask, one thread")
    print("state    masks  " + "  ".join(f"{n:>8s}" for n in names))
    for state, count in sorted(replayed["num_masks"].items()) + [("all", 0)]:
        cells = "  ".join(f"{replayed[n]['ms_per_mask'][state]:8.3f}" for n in names)
        print(f"{state:8s} {count or sum(replayed['num_masks'].values()):5d}  {cells}")
    print("digests", {n: replayed[n]["digest"] for n in names})
    for b in result.get("batch", []):
        best = min(b["fill_ms"])
        print(
            f"batched fill, slices {b['slices']}, {result['args']['batch']} rows, "
            f"{b['threads']} threads, "
            f"{b['templates_per_thread']} templates a thread: {best:.1f} ms (best of "
            f"{len(b['fill_ms'])}), {best * b['threads'] / int(result['args']['batch']) * 1e3:.0f}"
            " us of thread time a row"
        )


if __name__ == "__main__":
    main()
