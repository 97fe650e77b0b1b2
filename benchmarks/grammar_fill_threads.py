"""How llguidance's batched bitmask fill scales with threads, by how the matchers are made.

Copies of one llguidance matcher (`LLMatcher.deep_copy`) share its lexer, behind one lock that
a mask holds for its whole trie walk, so copies of one template fill one at a time on any number
of threads. This script decodes `--rows` rows under the GPU benchmark's schema
(`structured_outputs.schema(None, 200, 400)`) on its synthetic 128K tokenizer (as
`grammar_fill.py`), every row from the start of its grammar: each row follows one of `--walks`
recorded walks (`grammar_fill.record_walks`, uniform among the allowed tokens; `--assign`) for
up to `--steps` steps, all configurations in lockstep; each step fills all live rows' masks
(`LLGuidanceBackend.fill_bitmasks`: rows ordered by shared lexer, the library's `--threads`
threads) and advances them (`LLGuidanceBackend.advance`). Matchers made as (`--makes`):

- `copies` (or `copiesN`): phloem's `LLGuidanceBackend.matcher` (copies of 4, or N, templates
  a thread: `templates_per_thread`), rows ordered by template; `copies-mixed` (`copiesN-mixed`):
  the same matchers, rows in the order made (round robin: consecutive rows on different
  templates);
- `one`: copies of ONE matcher (every row on one lexer: the lock at its worst); `tN`: copies
  of N matchers, whatever the threads (rows ordered by template, as `copies`);
- `apart`: each row's matcher built from the grammar text (its own lexer, nothing shared),
  rows in the backend's order (by `id`: no order); `apart-ordered`: the same, rows ordered as
  `copies` orders its copies (group i % templates), to tell the lock from the order.

Each make is filled by every mode of `--fills` (the backend's `fill_mode`): `pool` (the
library's work-stealing pool of `--threads` threads over the rows ordered by template: phloem's
default) or `split` (`split_fill`: whole templates on each of `--threads` Python threads, each
with its own 1-thread executor, so no two threads ever share a lexer) or `pull` (the same, a
free thread taking the next template); such a config is named `MAKE/split`, `MAKE/pull`.

Per (make, fill, threads), over `--repeats` rounds (configurations alternated): ms to make the
matchers (one Python thread), the fill's wall ms summed over the steps and the process's CPU ms
during those fills (CPU / wall ~ threads kept busy), the voluntary context switches during
them (a thread that waits for a held lock sleeps), the advance's ms, and ms a fill and an
advance by quarter of the steps (`fill_ms_by_quarter`, `advance_ms_by_quarter`).

Measure the engine's window: `--steps 128` (the default) for the GPU benchmark's 1,024 x 128
run. A walk spends its first ~50 steps on the keys, numbers and the short name, where a mask
costs 0.01-0.03 ms, and the rest inside the `tags` array's strings (maxLength 10), where it
costs 0.15-0.9 ms: on 1 thread a 1,024-row fill averages 3.7x more over 128 steps than over
the first 64, and its last quarter 17x its first. `--steps 64` thus measured 8.8 ms a fill on
the H200 host (14 threads) where the engine's 128-step run fills in 26-28 ms
(benchmarks/results/2026-11-27h-cpu-fill-gap/). The masks of every
configuration must be the same bit for bit (a digest over all steps, first round). Results:
benchmarks/results/2026-11-27g-cpu-fill-threads/, 2026-11-27g-cpu-fill-split/.

    OMP_NUM_THREADS=1 python benchmarks/grammar_fill_threads.py --threads 1,2 --steps 128 \
        --makes copies,apart-ordered,apart,one --repeats 2 --out DIR/threads.json
    OMP_NUM_THREADS=1 python benchmarks/grammar_fill_threads.py --threads 1,2 --steps 128 \
        --makes copies --fills pool,split,pull --repeats 2 --out DIR/split.json

`--walks-file F`: the engine's walks instead of recorded ones (`structured_outputs.py
--save-token-ids F`, the first one-schema run's output tokens on the same tokenizer), to
compare the library's fill of the engine's own rows with the engine's `library_fill_ms`.

`--part-costs 14,28`: instead, one decode on one thread that times every row's mask alone
(`copies`' first make and threads), then, per T, how much longer than an even share of the
step's mask time (its sum / T) the split fill's busiest thread works, rows in the templates
phloem would make on T threads (row i in template i % (4 T), or 16 T): `static` (the split:
whole templates, balanced by row count) and `pull` (the backend's "pull": whole templates,
most rows first, each to the thread that is free first); sums over the steps. Masks cost 0.02-0.9 ms by the row's state, so a static split of few rows a thread
is not balanced by cost.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grammar_fill import add_walk_args, load_tokenizer, record_walks  # noqa: E402
from structured_outputs import by_quarter, schema  # noqa: E402

from phloem.sampling_params import StructuredOutputsParams  # noqa: E402
from phloem.structured_output.backend import TokenizerData  # noqa: E402
from phloem.structured_output.llguidance_backend import (  # noqa: E402
    LLGuidanceBackend,
    LLGuidanceMatcher,
)


def make_matchers(make: str, backend: LLGuidanceBackend, compiled, num_rows: int) -> list:
    """`num_rows` fresh matchers of `compiled`, made as `make` (module docstring)."""
    import llguidance as llg

    if make.startswith("copies"):
        made = [backend.matcher(compiled) for _ in range(num_rows)]
        if make.endswith("-mixed"):  # made round robin over the templates: keep that order
            for i, m in enumerate(made):
                m.group = i
        return made
    if make == "one" or make.startswith("t"):
        count = 1 if make == "one" else int(make[1:])
        templates = [llg.LLMatcher(backend.tokenizer, compiled.text) for _ in range(count)]
        return [LLGuidanceMatcher(templates[i % count].deep_copy(), id(templates[i % count]))
                for i in range(num_rows)]  # fmt: skip
    if make in ("apart", "apart-ordered"):
        built = [llg.LLMatcher(backend.tokenizer, compiled.text) for _ in range(num_rows)]
        if make == "apart":
            return [LLGuidanceMatcher(m, id(m)) for m in built]
        slots = backend._num_templates  # as `copies`: row i in group i % templates
        return [LLGuidanceMatcher(m, i % slots) for i, m in enumerate(built)]
    raise ValueError(f"unknown --makes entry {make!r}")


def _new_round(config: dict, args) -> dict:
    """Fresh templates (cold lexers) and matchers of config's make: its round's state."""
    start = time.perf_counter()
    compiled = config["backend"].compile(config["params"])
    matchers = make_matchers(config["make"], config["backend"], compiled, args.rows)
    made_ms = (time.perf_counter() - start) * 1e3
    totals = dict.fromkeys(("fill_ms", "fill_cpu_ms", "fill_vcsw", "advance_ms", "masks"), 0)
    steps: dict = {"fill_steps": [], "advance_steps": []}  # ms of each step's call
    return {"matchers": matchers, "crc": 0, "make_ms": made_ms, **totals, **steps}


def _step(config: dict, state: dict, live: list[int], tokens: list[int], digest: bool) -> None:
    """Fill the live rows' masks (timed: wall, process CPU, voluntary context switches of
    all threads: a thread waiting on a held lock sleeps) and advance them by `tokens`."""
    backend = config["backend"]
    rows_matchers = [state["matchers"][i] for i in live]
    rows = list(range(len(live)))
    bitmask = config["bitmask"]
    vcsw = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    wall, cpu = time.perf_counter(), time.process_time()
    backend.fill_bitmasks(rows_matchers, bitmask, rows)
    state["fill_steps"].append((time.perf_counter() - wall) * 1e3)
    state["fill_ms"] += state["fill_steps"][-1]
    state["fill_cpu_ms"] += (time.process_time() - cpu) * 1e3
    state["fill_vcsw"] += resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - vcsw
    state["masks"] += len(live)
    if digest:
        state["crc"] = zlib.crc32(bitmask[: len(live)].tobytes(), state["crc"])
    start = time.perf_counter()
    advanced = backend.advance(rows_matchers, tokens)
    state["advance_steps"].append((time.perf_counter() - start) * 1e3)
    state["advance_ms"] += state["advance_steps"][-1]
    assert all(a is not None for a in advanced), "a recorded token was rejected"


def assign_walks(num_walks: int, args) -> list[int]:
    """Each row's walk: i % num_walks (`--assign cyclic`: row i and row i + num_walks alike,
    so copies of one template, made round robin, follow a few walks: their rows' costs move
    together) or a seeded random one (`random`: as a batch's independent rows)."""
    if args.assign == "cyclic":
        return [i % num_walks for i in range(args.rows)]
    rng = random.Random(1)
    return [rng.randrange(num_walks) for _ in range(args.rows)]


def decode_round(configs: list[dict], walks: list[list[int]], args, round_: int) -> None:
    """One round: every config makes its matchers, then all decode in lockstep (each step
    every config fills and advances, in an order alternated by step), so load from other
    processes falls on all of them alike. Appends each config's totals to its "rounds"."""
    states = [_new_round(c, args) for c in configs]
    row_walks = [walks[w] for w in assign_walks(len(walks), args)]
    for step in range(args.steps):
        live = [i for i in range(args.rows) if step < len(row_walks[i])]
        if not live:
            break
        tokens = [row_walks[i][step] for i in live]
        pairs = list(zip(configs, states))
        for config, state in pairs if (step + round_) % 2 == 0 else pairs[::-1]:
            _step(config, state, live, tokens, digest=round_ == 0)
    for config, state in zip(configs, states):
        state["digest"] = f"{state.pop('crc'):08x}" if round_ == 0 else None
        for name in ("fill", "advance"):
            state[f"{name}_ms_by_quarter"] = by_quarter(state.pop(f"{name}_steps"))
        del state["matchers"]
        config["rounds"].append(state)


def build_configs(args) -> tuple[list[dict], int]:
    """One config per (make, fill, threads), backends sharing one tokenizer info."""
    hf_tok, vocab_size, eos = load_tokenizer(args)
    data = TokenizerData(hf_tok, vocab_size, (eos,))
    params = StructuredOutputsParams(json=schema(None, 200, 400))
    configs, first = [], None
    for threads in (int(t) for t in args.threads.split(",")):
        for make in args.makes.split(","):
            count = make.removesuffix("-mixed")[len("copies") :]
            per = int(count or 4) if make.startswith("copies") else 4
            for fill in args.fills.split(","):
                backend = LLGuidanceBackend(
                    data, threads, per, same_tokenizer_as=first, fill_mode=fill
                )
                first = first or backend
                name = make if fill == "pool" else f"{make}/{fill}"
                configs.append({"make": name, "threads": threads, "backend": backend,
                                "params": params, "vocab_size": vocab_size,
                                "rounds": []})  # fmt: skip
    return configs, eos


def _row_costs(config: dict, walks: list[list[int]], args) -> list[list[float]]:
    """[step][row] seconds of each live row's mask alone (one thread; `copies` rows)."""
    backend = config["backend"]
    state = _new_round(config, args)
    row_walks = [walks[w] for w in assign_walks(len(walks), args)]
    costs, bitmask = [], config["bitmask"]
    for step in range(args.steps):
        live = [i for i in range(args.rows) if step < len(row_walks[i])]
        if not live:
            break
        matchers = [state["matchers"][i] for i in live]
        times = [0.0] * args.rows
        for i, m in zip(live, matchers):
            start = time.perf_counter()
            m.fill_bitmask(bitmask, 0)
            times[i] = time.perf_counter() - start
        costs.append(times)
        backend.advance(matchers, [row_walks[i][step] for i in live])
    return costs


def part_costs(config: dict, walks: list[list[int]], args) -> None:
    """Print the split fill's busiest thread against an even share (`--part-costs`)."""
    from phloem.structured_output.split_fill import split_by_group

    costs = _row_costs(config, walks, args)
    print(f"{args.rows} rows, {len(costs)} steps: busiest thread / (step's mask time / T)")
    for threads in (int(t) for t in args.part_costs.split(",")):
        for per in (4, 16):
            groups = [i % (per * threads) for i in range(args.rows)]
            parts = split_by_group(groups, threads)
            static = pull = even = 0.0
            for times in costs:
                static += max(sum(times[i] for i in p) for p in parts)
                busy = [0.0] * threads
                for template in split_by_group(groups, len(groups)):  # largest first
                    busy[busy.index(min(busy))] += sum(times[i] for i in template)
                pull += max(busy)
                even += sum(times) / threads
            print(
                f"T={threads:3d} templates {per:2d}/thread: static {static / even:.3f}  "
                f"pull {pull / even:.3f}  (even share {even * 1e3 / len(costs):.2f} ms/step)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_walk_args(parser, 64, "distinct recorded walks")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--assign", choices=("random", "cyclic"), default="random")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--threads", default="1,2", help="comma list of fill threads")
    parser.add_argument("--makes", default="copies,one,apart", help="comma list (docstring)")
    parser.add_argument("--fills", default="pool", help="comma list: pool, split (docstring)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part-costs", help="comma list of T: the split's balance (docstring)")
    parser.add_argument("--walks-file", type=Path,
                        help="replay these walks instead of recording --walks: the engine's own "
                        "(structured_outputs.py --save-token-ids; with --assign cyclic and "
                        "--rows = their number, row i walks the engine's request i)")  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    configs, eos = build_configs(args)
    first = configs[0]
    text = first["backend"].compile(first["params"]).text
    if args.walks_file:
        walks = json.loads(args.walks_file.read_text())["token_ids"]
    else:
        walks = record_walks(first["backend"].tokenizer, text, first["vocab_size"], eos, args)
    from llguidance.numpy import allocate_token_bitmask

    for config in configs:
        config["bitmask"] = allocate_token_bitmask(args.rows, config["vocab_size"])
    if args.part_costs:
        return part_costs(first, walks, args)
    for round_ in range(args.repeats):
        decode_round(configs, walks, args, round_)
    _report(configs, args)


def _report(configs: list[dict], args) -> None:
    """Print the medians and write `args.out`."""
    rows = []
    for c in configs:
        keys = ("make_ms", "fill_ms", "fill_cpu_ms", "fill_vcsw", "advance_ms")
        med = {k: statistics.median(r[k] for r in c["rounds"]) for k in keys}
        for k in ("fill_ms_by_quarter", "advance_ms_by_quarter"):  # quarter by quarter
            med[k] = [statistics.median(q) for q in zip(*(r[k] for r in c["rounds"]))]
        rows.append({"make": c["make"], "threads": c["threads"], "median": med,
                     "masks": c["rounds"][0]["masks"], "digest": c["rounds"][0]["digest"],
                     "rounds": c["rounds"]})  # fmt: skip
    base = {r["make"]: r["median"]["fill_ms"] for r in rows if r["threads"] == min(
        c["threads"] for c in configs)}  # fmt: skip
    print(f"{args.rows} rows, {rows[0]['masks']} masks; medians of {args.repeats} rounds")
    print("make           thr  make_ms  fill_ms  cpu/wall  speedup  vcsw/step  advance_ms  digest")
    for r in rows:
        m = r["median"]
        speedup = base.get(r["make"], float("nan")) / m["fill_ms"]
        print(f"{r['make']:14s} {r['threads']:3d} {m['make_ms']:8.1f} {m['fill_ms']:8.1f} "
              f"{m['fill_cpu_ms'] / m['fill_ms']:9.2f} {speedup:8.2f} "
              f"{m['fill_vcsw'] / args.steps:10.1f} {m['advance_ms']:11.1f}  "
              f"{r['digest']}")  # fmt: skip
    print("ms a fill / an advance by quarter of the steps (first .. last)")
    for r in rows:
        fills, advances = (r["median"][f"{k}_ms_by_quarter"] for k in ("fill", "advance"))
        print(f"{r['make']:14s} {r['threads']:3d}  fill " + " ".join(f"{v:7.2f}" for v in fills)
              + "   advance " + " ".join(f"{v:6.2f}" for v in advances))  # fmt: skip
    if args.out:
        machine = platform.processor() or platform.machine()
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine,
                  "configs": rows}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
