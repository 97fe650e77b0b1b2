"""Host-side time of one engine step, without the model: the new tree against an older one.

What it measures, per step and phase (median ms over the measured steps), for two steps shaped
like the BatchLLM GPU runs (2,200-token prompts in groups of 16 sharing a 2,048-token prefix,
16-token blocks, budget 8,192 tokens, async scheduling, the shared-prefix backend):

- decode: 714 sequences decoding (~140-block tables), every input token pending (async);
- mixed: 600 decoding sequences plus prompt chunks of newly admitted groups filling the budget.

Phases (one step each, in the engine's async order: schedule N+1, launch N+1, collect N, update N):

- schedule: `Scheduler.schedule()`.
- launch: `ModelRunner.needs_token_history()` and `ModelRunner.launch()` with a stand-in model (zeros; no layers run) and, for decode
  steps, a stand-in CUDA-graph runner whose replay does nothing, so the real host path runs:
  per-sequence state, host inputs, slot mapping, block tables, `plan_decode`, the graph's
  input copy, sampling rows and the sampler's launch (on the CPU, over an 8-token vocabulary).
  `inputs` is the input building alone (timed apart on the same step: the worker's state
  update, `HostStep.build` / the old `_HostStep` or graph-path loop).
- collect: `ModelRunner.collect()` (tokens to the sequences).
- update: `Scheduler.update_from_output()`.
- outputs: the engine's output processing (`LLMEngine._process_outputs`, offline mode) on an
  engine object holding only what that method reads.

`--core` measures the serving engine core's path instead (DELTA mode: `outputs` builds the
per-request `RequestDelta`s, `PromptEntry.to_delta`) and adds, per step:

- send: the core's per-step work after `step()`: its step observer (`EngineCore._observe_step`)
  and `EngineCore._send` (stats, and the msgpack encoding of the `CoreStep`) into a socket that
  drops the bytes.

The offline runs measure with the garbage collector off (the batch frozen, as `LLM.generate`
runs); `--core` runs keep it on with only the start-up frozen (`freeze_start_up`: its young
threshold too), as the engine core process runs, so the step's collections count where they
fall (the medians hide the rare full ones).

`--num-seqs N` sets the decode step's sequences (default 714; `--core` runs use 800, the H200
shared-prefix burst's decode).

Not measured: the model, the backend's per-step planning into device buffers (`begin_step`,
`prepare_replay`), and copies to a GPU (the CPU has none).

Run from the repository root, with the old tree extracted beside it:

    git archive b541b0b phloem | tar -x -C /tmp/old
    python benchmarks/host_step.py --old /tmp/old --json OUT.json

    python benchmarks/host_step.py --old /tmp/old --core --num-seqs 800 --rounds 5

Each tree runs in its own process from its own directory (so `import phloem` finds that tree);
the old tree's APIs are reached through the small shim below (`_OldTree`).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BLOCK_SIZE = 16
PROMPT_LEN = 2200
PREFIX_LEN = 2048
GROUP_SIZE = 16
BUDGET = 8192
NUM_BLOCKS = 80_000
VOCAB = 8
PHASES = ("schedule", "launch", "inputs", "collect", "update", "outputs", "send")
_CORE_ENV = "PHLOEM_HOST_STEP_CORE"  # "1": the engine core's DELTA path (`--core`)
_NUM_SEQS_ENV = "PHLOEM_HOST_STEP_NUM_SEQS"


# -- the stand-ins (both trees) -----------------------------------------------------------------


def _fake_model():
    import torch
    from torch import nn

    class FakeModel(nn.Module):
        """Zeros for hidden states and logits: the host path runs, no layer does."""

        num_layers, num_kv_heads, head_dim, hidden = 1, 1, 2, 4

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(1))
            self.config = argparse.Namespace(vocab_size=VOCAB)

        def forward(self, input_ids, positions):
            return torch.zeros(input_ids.shape[0], self.hidden)

        def compute_logits(self, hidden):
            return torch.zeros(hidden.shape[0], VOCAB)

    return FakeModel()


class _FakeGraph:
    def replay(self) -> None:
        pass


class _NoPlanBackend:
    """What the stand-in graph runner's replays plan with: nothing (device-buffer planning is
    not host work this benchmark measures)."""

    def begin_step(self, *args, **kwargs) -> None:
        pass

    def plan_decode(self, *args, **kwargs):
        """Every decode step replays the plain graph (the interface's default)."""
        from phloem.ops.attention.interface import DecodePath, DecodePlan

        return DecodePlan(DecodePath.GRAPH)

    def prepare_replay(self, *args, **kwargs) -> None:
        pass


def _fake_graph_runner(cls, max_num_seqs: int, block_size: int, scratch_block: int):
    """A real `CUDAGraphRunner` (its host code runs) built without capturing: every bucket's
    graph replays nothing and returns zeros."""
    import torch

    from phloem.worker.cuda_graph import graph_batch_sizes

    runner = object.__new__(cls)
    runner.backend = _NoPlanBackend()
    runner.block_size = block_size
    runner.scratch_block = scratch_block
    runner.scratch_slot = scratch_block * block_size
    runner.device = torch.device("cpu")
    runner.batch_sizes = graph_batch_sizes(max_num_seqs)
    runner.max_batch_size = runner.batch_sizes[-1]
    try:  # the static input buffer: this tree's `GraphInputs`, the old tree's plain tensor
        from phloem.worker.graph_inputs import GraphInputs

        runner._inputs = GraphInputs(runner.max_batch_size, runner.device)
    except ImportError:
        runner._static_inputs = torch.zeros(3, runner.max_batch_size, dtype=torch.int64)
    runner.variants = {"plain": 1, "shared_prefix": 16}  # as on the GPU with Triton
    keys = [(v, b) for v in runner.variants for b in runner.batch_sizes]
    runner._graphs = {key: _FakeGraph() for key in keys}
    runner._outputs = {key: torch.zeros(key[1], 4) for key in keys}
    runner._pool = None
    runner._static_out = runner._static_logits = None  # no logits inside the graphs
    runner.logits_max_batch = 0
    return runner


# -- one tree ------------------------------------------------------------------------------------


class _Tree:
    """The pieces of one tree's step, built the same way in both trees."""

    def __init__(self) -> None:
        import torch

        from phloem.config import SchedulerConfig
        from phloem.core.kv_manager import KVManager
        from phloem.core.scheduler import Scheduler
        from phloem.worker.cuda_graph import CUDAGraphRunner
        from phloem.worker.model_runner import ModelRunner

        torch.set_num_threads(1)
        config = SchedulerConfig(
            max_num_seqs=2048,
            max_num_batched_tokens=BUDGET,
            max_model_len=4096,
            async_scheduling=True,
        )
        self.kv = KVManager(NUM_BLOCKS, BLOCK_SIZE)
        self.scheduler = Scheduler(config, self.kv)
        backend = self.backend()
        self.runner = ModelRunner(
            _fake_model(), 1, BLOCK_SIZE, torch.float32, torch.device("cpu"), backend
        )
        self.runner.num_blocks = NUM_BLOCKS  # the KV cache itself is never touched
        self.runner.graph_runner = _fake_graph_runner(CUDAGraphRunner, 2048, BLOCK_SIZE, NUM_BLOCKS)
        self.engine = self.engine_stub()
        self.core = self.core_stub() if os.environ.get(_CORE_ENV) == "1" else None
        self._next_id = 0

    def add_group(self, size: int) -> None:
        from phloem.core.request import Request, SharedPrefix
        from phloem.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
        group = SharedPrefix(prefix_len=PREFIX_LEN, num_unfinished=size)
        base = self._next_id * 7919
        prefix = [(base + i) % 30000 for i in range(PREFIX_LEN)]
        for _ in range(size):
            rid = str(self._next_id)
            self._next_id += 1
            suffix = [(self._next_id * 31 + i) % 30000 for i in range(PROMPT_LEN - PREFIX_LEN)]
            request = Request(rid, prefix + suffix, params, shared_prefix=group)
            self.scheduler.add_request(request)
            self.register(request)

    def run(self, num_steps: int, measure) -> list[dict[str, float]]:
        """`num_steps` steps in the engine's async order; the timings of those `measure(sched)`
        accepts."""
        timings = []
        in_flight = None
        for _ in range(num_steps):
            t0 = time.perf_counter()
            sched = self.scheduler.schedule()
            t1 = time.perf_counter()
            keep = measure(sched)
            inputs_s = self.time_inputs(sched) if keep else 0.0
            t2 = time.perf_counter()
            if in_flight is not None:  # the engine asks before it launches beside a step
                self.runner.needs_token_history(sched)
            launched = self.runner.launch(sched)
            t3 = time.perf_counter()
            step = {"schedule": t1 - t0, "launch": t3 - t2, "inputs": inputs_s}
            if in_flight is not None:
                step.update(self.finish(*in_flight))
            in_flight = (sched, launched)
            if keep:
                timings.append(step)
        if in_flight is not None:
            self.finish(*in_flight)
        return timings

    def finish(self, sched, launched) -> dict[str, float]:
        t0 = time.perf_counter()
        out = self.runner.collect(launched)
        t1 = time.perf_counter()
        updated = self.scheduler.update_from_output(sched, out.sampled_token_ids)
        t2 = time.perf_counter()
        deltas = self.engine._process_outputs(sched, updated, out)
        t3 = time.perf_counter()
        step = {"collect": t1 - t0, "update": t2 - t1, "outputs": t3 - t2}
        if self.core is not None:
            self.core._observe_step(argparse.Namespace(scheduler_output=sched))
            self.core._send(deltas)
            step["send"] = time.perf_counter() - t3
        return step


class _NewTree(_Tree):
    def backend(self):
        from phloem.ops.attention import get_attention_backend

        return get_attention_backend("shared_prefix", device="cpu")

    def engine_stub(self):
        from phloem.engine.llm_engine import LLMEngine

        engine = object.__new__(LLMEngine)
        engine._sequences, engine._prompts = {}, {}
        engine.scheduler = self.scheduler
        try:
            engine.stream_outputs = False
        except AttributeError:  # the engine being rebuilt: an output mode instead
            from phloem.engine.llm_engine import OutputMode

            core = os.environ.get(_CORE_ENV) == "1"
            engine.output_mode = OutputMode.DELTA if core else OutputMode.FINAL
        engine.kv_manager, engine.drafter, engine._step_observers = self.kv, None, []
        return engine

    def core_stub(self):
        """The engine core's loop object over the stand-in engine, sending into a socket that
        drops the bytes (its step observer is called by `finish`, as the engine would)."""
        from phloem.engine.engine_core import EngineCore

        class _DropSocket:
            """Keeps only a digest of the bytes sent (the trees' messages must be identical)."""

            digest = hashlib.sha256()

            def send(self, data, copy=True) -> None:
                self.digest.update(data)

        return EngineCore(self.engine, None, _DropSocket())

    def register(self, request) -> None:
        from phloem.engine.detokenizer import IncrementalDetokenizer
        from phloem.engine.prompt_entry import PromptEntry, SequenceEntry
        from phloem.outputs import RequestMetrics

        rid = request.request_id
        detok = None  # the engine core (DELTA mode) has no detokenizer
        if self.core is None:
            detok = IncrementalDetokenizer(None, request.prompt_token_ids, incremental=False)
        seq = SequenceEntry(request, 0, rid, detok)
        entry = PromptEntry(rid, None, request.prompt_token_ids, [seq], RequestMetrics(0.0))
        self.engine._prompts[rid] = entry
        self.engine._sequences[rid] = seq

    def time_inputs(self, sched) -> float:
        """The worker's state update and host-input building of this step, on a copy of the
        worker's state (the real launch applies the step after)."""
        import copy

        from phloem.worker.input_batch import HostStep, InputBatch

        batch = InputBatch()
        batch.states = {k: copy.copy(v) for k, v in self.runner.input_batch.states.items()}
        for state in batch.states.values():
            state.block_ids = list(state.block_ids)
        t0 = time.perf_counter()
        states = batch.update(sched)
        host = HostStep.build(sched, states, BLOCK_SIZE, self.runner.backend.reads_prefix_lens)
        if host.is_decode:
            host.padded(self.runner.graph_runner.bucket(len(states)), NUM_BLOCKS, BLOCK_SIZE)
        return time.perf_counter() - t0


class _OldTree(_Tree):
    """The shim over commit b541b0b's APIs."""

    def backend(self):
        from phloem.ops.attention.interface import get_attention_backend

        return get_attention_backend("shared_prefix", device="cpu")

    def engine_stub(self):
        from phloem.engine.llm_engine import LLMEngine

        engine = object.__new__(LLMEngine)
        engine._sequences, engine._prompts = {}, {}
        engine.scheduler = self.scheduler
        engine.stream_outputs = False
        engine.num_computed_prompt_tokens = 0
        return engine

    def register(self, request) -> None:
        from phloem.engine.detokenizer import IncrementalDetokenizer
        from phloem.engine.llm_engine import _Prompt, _Sequence
        from phloem.outputs import RequestMetrics

        rid = request.request_id
        detok = IncrementalDetokenizer(None, request.prompt_token_ids, incremental=False)
        seq = _Sequence(request, 0, rid, detok)
        entry = _Prompt(rid, None, request.prompt_token_ids, [seq], RequestMetrics(0.0))
        self.engine._prompts[rid] = entry
        self.engine._sequences[rid] = seq

    def time_inputs(self, sched) -> float:
        """The old runner's host-input building: the graph path's list loop for decode steps
        (up to the replay), `_HostStep.build` otherwise."""
        from phloem.worker.model_runner import _HostStep

        t0 = time.perf_counter()
        scheduled = sched.scheduled
        if all(s.num_tokens == 1 and s.sample for s in scheduled):
            bs = BLOCK_SIZE
            ids, positions, slots, seq_lens, tables, pending = [], [], [], [], [], []
            for s in scheduled:
                pos = s.num_computed_tokens
                if pos < s.request.num_known_tokens:
                    ids.append(s.request.token_ids(pos, pos + 1)[0])
                else:
                    pending.append((len(ids), s.request.request_id))
                    ids.append(0)
                positions.append(pos)
                slots.append(s.block_ids[pos // bs] * bs + pos % bs)
                seq_lens.append(pos + 1)
                tables.append(s.block_ids)
        else:
            _HostStep.build(sched, BLOCK_SIZE, True)
        return time.perf_counter() - t0


def _measure_tree() -> dict:
    new = importlib.util.find_spec("phloem.core.scheduler_output") is not None
    tree = (_NewTree if new else _OldTree)()
    core = tree.core is not None
    if core:  # as the engine core does once built: later objects stay collectable, gc on
        from phloem.engine.gc_control import freeze_start_up

        freeze_start_up()
    # decode: `num_seqs` sequences past their prompts
    num_seqs = int(os.environ.get(_NUM_SEQS_ENV, "714"))
    for _ in range(num_seqs // GROUP_SIZE):
        tree.add_group(GROUP_SIZE)
    tree.add_group(num_seqs % GROUP_SIZE)
    tree.run(40, lambda sched: False)  # prefill, then decode starts
    assert tree.scheduler.num_running == num_seqs and not tree.scheduler.num_waiting
    gc.collect()
    if not core:
        gc.freeze()
        gc.disable()
    decode = tree.run(60, lambda sched: all(s.num_tokens == 1 for s in sched.scheduled))
    gc.enable()
    # mixed: new groups' prompt chunks beside the decoding sequences
    tree.scheduler.abort_requests([r.request_id for r in tree.scheduler.running[600:]])
    for _ in range(12):
        tree.add_group(GROUP_SIZE)
    gc.collect()
    if not core:
        gc.disable()
    mixed = tree.run(
        12,
        lambda sched: (
            len(sched.scheduled) >= 600 and any(s.num_tokens > 1 for s in sched.scheduled)
        ),
    )
    gc.enable()
    return {
        "tree": "new" if new else "old",
        "steps": {"decode": _summary(decode), "mixed": _summary(mixed)},
        "num_steps": {"decode": len(decode), "mixed": len(mixed)},
        "sent_sha256": tree.core.output.digest.hexdigest() if core else None,
    }


def _summary(timings: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for phase in PHASES:
        values = [t[phase] for t in timings if phase in t]
        out[phase] = round(statistics.median(values) * 1e3, 3) if values else None
    out["total"] = round(sum(out[p] or 0.0 for p in PHASES if p != "inputs"), 3)
    return out


# -- the comparison -------------------------------------------------------------------------------


def _run_in(directory: Path) -> dict:
    env = dict(
        os.environ, PYTHONPATH=str(directory), OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1"
    )
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure"]
    proc = subprocess.run(cmd, cwd=directory, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the run in {directory} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="directory holding the old tree's phloem/")
    parser.add_argument("--rounds", type=int, default=2, help="old/new pairs, interleaved")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--core", action="store_true", help="the engine core's DELTA path")
    parser.add_argument("--num-seqs", type=int, default=714, help="decode step's sequences")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ[_CORE_ENV] = "1" if args.core else os.environ.get(_CORE_ENV, "0")
    os.environ.setdefault(_NUM_SEQS_ENV, str(args.num_seqs))
    if args.measure:
        print(json.dumps(_measure_tree()))
        return
    root = Path(__file__).resolve().parent.parent
    runs: dict[str, list[dict]] = {"new": [], "old": []}
    for _ in range(args.rounds):
        if args.old is not None:
            runs["old"].append(_run_in(args.old.resolve()))
        runs["new"].append(_run_in(root))
    # per tree, the best (lowest) median of its rounds, per phase
    best = {
        name: {
            kind: {
                p: min(
                    (r["steps"][kind][p] for r in rs if r["steps"][kind][p] is not None),
                    default=None,
                )
                for p in (*PHASES, "total")
            }
            for kind in ("decode", "mixed")
        }
        for name, rs in runs.items()
        if rs
    }
    for kind in ("decode", "mixed"):
        print(f"{kind} step (us per phase: median over steps, best of {args.rounds} rounds)")
        print(f"  {'phase':10s} {'old':>9s} {'new':>9s} {'new/old':>8s}")
        for phase in (*PHASES, "total"):
            new_ms = best["new"][kind][phase]
            if new_ms is None:
                continue
            old_ms = best["old"][kind][phase] if "old" in best else None
            ratio = f"{new_ms / old_ms:8.3f}" if old_ms else f"{'':8s}"
            old_s = f"{old_ms * 1e3:9.0f}" if old_ms is not None else f"{'':9s}"
            print(f"  {phase:10s} {old_s} {new_ms * 1e3:9.0f} {ratio}")
    digests = {name: {r["sent_sha256"] for r in rs} for name, rs in runs.items() if rs}
    if args.core:
        print(f"CoreStep bytes sent, sha256 per tree: {digests}")
    if args.json is not None:
        args.json.write_text(json.dumps({"best": best, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
