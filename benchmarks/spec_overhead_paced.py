"""What speculative decoding costs the offline engine where drafts do not pay, on the CPU with
GPU-like step times (issue 20): the engine, its scheduler and its drafter run for real, the
forward pass is replaced by a step-time model of a GPU (as in `serving_paced.py`: `launch`
returns at once, `collect` waits until the step's modelled end), so host and device times are
comparable as they are on an H100.

    t_step = T0 + C_TOKEN x tokens computed (+ VERIFY if the step verifies drafts)   [s]

Scales (`--scale`): `smol` (SmolLM2-135M on an H100: T0 1.5 ms, C_TOKEN 3 us: a decode step of
32 sequences 1.6 ms, as measured in benchmarks/results/2026-11-26f-h100) and `8b`
(Llama-3.1-8B shapes: T0 45 ms, C_TOKEN 25 us). The cost rule's prior is the CUDA one of that
model's shape (`step_time.step_time_model(..., "cuda")`), corrected online by the paced steps.

The tokens the paced "model" emits (deterministic per sequence and output position, so outputs
are the same with and without speculation, as greedy ones are):

- `copy`: each prompt is a header, a passage of `--passage` random ordinary token ids and a
  tail; output token n copies passage token n, except that every `--edit-every`-th position
  (at a per-sequence offset) emits a fresh id instead (an edit), so drafts from the prompt are
  accepted between edits and rejected at them;
- `open`: output tokens are fresh ids (a hash of sequence and position) that the prompt does
  not hold: the proposers find (almost) nothing.

A verify row's accepted drafts are the longest prefix of its drafts equal to the tokens the
model emits at those positions; the row then emits the next one (as the rejection sampler's
greedy case does). As the worker does (`worker/stacked_rows.py`): a row whose drafts follow a
guess of its pending token (`pending_guess`) accepts none where the token sampled differs (and
is reported as verifying nothing, `ModelRunnerOutput.missed_guess_seq_ids`), and a
row launched while its sequence's row below was in flight is void (emits nothing) where that row
did not emit all its tokens (its input token is past those emitted: pending).

Reported per engine (off, ngram, suffix; k = `--k`; cost rule on; each engine built once and
run `--repeats` times, the order rotated; medians, and the ratio per repeat, `runs_ratio`: the
first repeat pays the first proposals, later ones start from what the drafter learned): wall
time, output tokens/s and the ratio to off, steps, steps whose in-flight step the engine collected before scheduling so
that the drafter could propose (`syncs`), proposals, verify steps, drafts verified and
accepted, and host milliseconds per step by phase (may_draft, propose, schedule + launch,
update; host = wall - the time `collect` slept).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/spec_overhead_paced.py --scale smol \
        --workload copy --batch 32 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phloem.engine.executor import UniProcExecutor  # noqa: E402
from phloem.worker.runner_output import ModelRunnerOutput  # noqa: E402

_LOW, _SPAN = 1000, 19000  # ordinary token ids [1000, 20000)
SCALES = {"smol": (1.5e-3, 3e-6), "8b": (45e-3, 25e-6)}
LLAMA_8B = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256)  # fmt: skip


def _fresh(seed: int, n: int) -> int:
    """An ordinary token id, a hash of (seed, n): no n-gram repeats across sequences (a linear
    formula made every sequence's outputs the same progression, which the suffix proposer's
    shared trie learned)."""
    return _LOW + hash((seed, n)) % _SPAN  # int tuples hash alike in every process


class Workload:
    """Prompts and the tokens the paced model emits for them (see the module docstring)."""

    def __init__(self, kind: str, batch: int, passage: int, edit_every: int) -> None:
        self.kind, self.edit_every = kind, edit_every
        self.passages: dict[str, list[int]] = {}
        self.prompts: list[tuple[str, list[int]]] = []
        self.batch, self.passage = batch, passage

    def new_batch(self, repeat: int) -> None:
        """The prompts of one repeat: request ids "<i>.<repeat>", texts and outputs of their
        own (so the suffix proposer's shared trie learns nothing from earlier repeats)."""
        self.prompts, self.passages = [], {}
        for i in range(self.batch):
            seed = i + 1000 * repeat
            body = [_fresh(10_000 + seed, j) for j in range(self.passage)]
            header = [_fresh(20_000 + seed, j) for j in range(16)]
            self.prompts.append((str(seed), header + body + header[:8]))
            self.passages[str(seed)] = body

    def token(self, seq_id: str, n: int) -> int:
        """Output token n of sequence `seq_id`."""
        name = seq_id.split("@")[0]
        seed = int(name)
        if self.kind == "open":
            return _fresh(30_000 + seed, n)
        body = self.passages[name]
        if (n + seed) % self.edit_every == self.edit_every - 1 or n >= len(body):
            return _fresh(40_000 + seed, n)
        return body[n]


class PacedSpecExecutor(UniProcExecutor):
    """The in-process executor with the forward pass replaced by the step-time model; verify
    rows accept the longest prefix of their drafts that the workload would emit."""

    workload: Workload
    t0 = c_token = verify_s = host_s = 0.0

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self._device_free = 0.0  # time.monotonic() when the last launched step ends
        self._counts: dict[str, int] = {}  # seq id -> tokens emitted so far
        self._full: dict[str, bool] = {}  # seq id -> its last collected row emitted all
        self._prompt_lens: dict[str, int] = {}  # seq id -> its prompt's length [tokens]
        self.slept_s = 0.0

    def launch(self, scheduler_output):
        scheduled = scheduler_output.scheduled
        for seq_id in scheduler_output.finished_seq_ids:
            self._counts.pop(seq_id, None)
            self._full.pop(seq_id, None)
            self._prompt_lens.pop(seq_id, None)
        if not scheduled:
            return None
        if self.host_s:  # the model runner's own host work (inputs, launch): the host is busy
            busy_until = time.perf_counter() + self.host_s
            while time.perf_counter() < busy_until:
                pass
        tokens = sum(s.num_tokens for s in scheduled)
        duration = self.t0 + self.c_token * tokens
        if any(s.draft_token_ids for s in scheduled):
            duration += self.verify_s
        end = max(time.monotonic(), self._device_free) + duration
        self._device_free = end
        rows = []
        for s in scheduled:
            if s.new_sequence is not None:
                self._prompt_lens[s.seq_id] = len(s.new_sequence.prompt_token_ids)
            if s.sample:  # stacked: its input token is not emitted yet (a row in flight's)
                known = self._prompt_lens[s.seq_id] + self._counts.get(s.seq_id, 0)
                stacked = s.num_computed_tokens + s.num_tokens - len(s.draft_token_ids) > known
                rows.append((s.seq_id, s.draft_token_ids, s.pending_guess, stacked))
        return end, rows

    def collect(self, launched) -> ModelRunnerOutput:
        if launched is None:
            return ModelRunnerOutput()
        end, rows = launched
        delay = end - time.monotonic()
        if delay > 0:
            self.slept_s += delay
            time.sleep(delay)
        out = ModelRunnerOutput()
        for seq_id, drafts, guess, stacked in rows:
            n = self._counts.get(seq_id, 0)
            if stacked and not self._full.get(seq_id, True):  # void: on rejected drafts
                self._full[seq_id] = False
                continue
            accepted = 0
            held = guess < 0 or (n and guess == self.workload.token(seq_id, n - 1))
            if held:
                while accepted < len(drafts) and drafts[accepted] == self.workload.token(
                    seq_id, n + accepted
                ):
                    accepted += 1
            if drafts and held:
                out.num_accepted_drafts[seq_id] = accepted
            elif drafts:  # its guess failed: it verified nothing (`stacked_rows.verify_counts`)
                out.missed_guess_seq_ids.append(seq_id)
            self._full[seq_id] = accepted == len(drafts)
            self._counts[seq_id] = n + accepted + 1
            out.sampled_token_ids[seq_id] = self.workload.token(seq_id, n + accepted)
            out.logprobs[seq_id] = None
        return out

    def sample(self, launched, grammar) -> None:
        raise NotImplementedError("the paced executor serves no structured outputs")

    def needs_token_history(self, scheduler_output) -> bool:
        return False


def build_engine(args, method: str | None):
    """An LLMEngine over the paced executor; the drafter's prior is the CUDA one of the scale's
    model shape."""
    from phloem.engine.llm_engine import LLMEngine
    from phloem.engine_args import EngineArgs
    from phloem.spec_decode.drafter import Drafter
    from phloem.spec_decode.step_time import step_time_model

    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": args.k, **args.spec_extra}
    config = EngineArgs.from_kwargs(
        model=args.model, load_format="dummy", speculative_config=spec,
        max_num_batched_tokens=2048, max_num_seqs=max(64, args.batch),
        num_gpu_blocks=args.batch * 80 + 256, device="cpu",
    ).create_engine_config()  # fmt: skip
    engine = LLMEngine(config, executor_factory=PacedSpecExecutor)
    if engine.drafter is not None:
        shape = LLAMA_8B if args.scale == "8b" else engine.hf_config
        prior = step_time_model(shape, "cuda")
        budget = engine.scheduler_config.max_num_batched_tokens
        engine.drafter = Drafter(config.speculative, prior, budget)
    return engine


def run_once(engine, workload: Workload, max_tokens: int) -> dict:
    """One batch to completion; returns its counters."""
    from phloem.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    executor, drafter = engine.executor, engine.drafter
    executor.slept_s = 0.0
    before = (drafter.stats.as_dict(), drafter.counters()) if drafter else None
    records = []
    engine.add_step_observer(records.append)
    outputs = {}
    start = time.perf_counter()
    for request_id, prompt in workload.prompts:
        engine.add_request(prompt, params, request_id=request_id + f"@{time.time_ns()}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id.split("@")[0]] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    engine.remove_step_observer(records.append)
    num_out = sum(len(v) for v in outputs.values())
    steps = len(records)
    result = {
        "wall_s": wall, "output_tokens": num_out, "tok_per_s": num_out / wall, "steps": steps,
        "host_ms_per_step": 1e3 * (wall - executor.slept_s) / max(steps, 1),
        "schedule_launch_ms_per_step": 1e3 * sum(r.schedule_s + r.launch_s for r in records)
        / max(steps, 1),
        "update_ms_per_step": 1e3 * sum(r.update_s for r in records) / max(steps, 1),
        "outputs": outputs,
    }  # fmt: skip
    if drafter is not None:
        stats, counters = drafter.stats.as_dict(), drafter.counters()
        for key in ("num_spec_steps", "num_draft_tokens", "num_accepted_tokens"):
            result[key] = stats[key] - before[0][key]
        for key, value in counters.items():
            result[key] = value - before[1][key]
        model = drafter.time_model  # what the step time learner holds at the end [ms]
        result["t_host_ms"] = 1e3 * model.t_host_s
        result["t_verify_ms"] = 1e3 * model.t_verify_s
        result["c_draft_us"] = 1e6 * model.c_draft_s
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="config dir (default: the embedded model)")
    parser.add_argument("--scale", choices=sorted(SCALES), default="smol")
    parser.add_argument("--workload", choices=("copy", "open"), default="copy")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passage", type=int, default=400)
    parser.add_argument("--edit-every", type=int, default=25)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--verify-ms", type=float, default=0.0,
                        help="extra device time of a step that verifies drafts [ms]")  # fmt: skip
    parser.add_argument("--host-ms", type=float, default=0.0,
                        help="host time the launch of every step spins (the model runner's "
                        "input preparation and launches on a GPU) [ms]")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=["off", "ngram", "suffix"])
    parser.add_argument(
        "--spec-extra",
        type=json.loads,
        default={},
        help='JSON of more speculative_config keys, e.g. {"suffix_decoding_max_spec_factor": 2}',
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    PacedSpecExecutor.t0, PacedSpecExecutor.c_token = SCALES[args.scale]
    PacedSpecExecutor.verify_s = args.verify_ms * 1e-3
    PacedSpecExecutor.host_s = args.host_ms * 1e-3
    workload = Workload(args.workload, args.batch, args.passage, args.edit_every)
    PacedSpecExecutor.workload = workload
    engines = {name: build_engine(args, None if name == "off" else name) for name in args.engines}
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        workload.new_batch(repeat)
        names = list(engines)[repeat % len(engines) :] + list(engines)[: repeat % len(engines)]
        for name in names:
            runs[name].append(run_once(engines[name], workload, args.max_tokens))
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "engines": {}}
    base = statistics.median(r["tok_per_s"] for r in runs[args.engines[0]])
    for name, rs in runs.items():
        row = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "outputs"}
        row["ratio"] = row["tok_per_s"] / base
        same = [r["outputs"] == b["outputs"] for r, b in zip(rs, runs[args.engines[0]])]
        # per repeat (the engines are reused: the first repeat pays the first proposals)
        row["runs_ratio"] = [
            round(r["tok_per_s"] / b["tok_per_s"], 3) for r, b in zip(rs, runs[args.engines[0]])
        ]
        row["same_outputs"] = all(same)
        summary["engines"][name] = row
        shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in row.items())  # fmt: skip
        print(f"{args.scale} {args.workload} b{args.batch} {name}: {shown}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
