"""The step trace file: one JSON line per engine step, written by a step observer of the engine
(`phloem serve --step-trace PATH` installs it in the engine core process), read back by
`phloem bench step-trace` (`phloem.bench.step_analysis`).

The first line is a header (`"trace": "phloem-steps"`, the engine's limits); then one line per
non-empty step, in the order the steps were collected:

    step            0-based index of the engine's non-empty steps
    t0, t1          time.monotonic() [s] when the step's step() call began (scheduling) and when
                    its tokens were applied (the observer ran); the host's clock, so a client on
                    the same host (`phloem bench serve`'s "window_monotonic_s") compares with it
    seqs            sequences scheduled
    decode_seqs     of them, sequences computing one new token (drafts being verified included)
    prefill_tokens  prompt tokens computed (chunks of prompts, recomputation after preemption)
    prefill_chunks  sequences computing a prompt chunk
    tokens          all tokens computed (prefill_tokens + the decodes' tokens)
    shared_seqs     decoding sequences reading a runtime prefix group's shared blocks
    graph           the step may replay CUDA graphs (on CUDA with graphs on, enforce_eager off):
                    a decode graph (decode-only with one token a sequence, no drafts, within the
                    captured batch sizes), or piecewise graphs (any other step of at most the
                    largest token bucket, `cuda_graph_mode` "piecewise": the header's
                    "piecewise_max_tokens"). The runner still runs a decode step eagerly when the
                    backend sends a prefix-shared step down its cascade path (see shared_seqs) or
                    graph capture failed at start; the worker reports neither.
    schedule_ms, launch_ms, wait_ms, update_ms
                    host phases of the step (`phloem.engine.step_observer`); schedule + launch is
                    the host time before the step is on the device

A sequence counts as a prompt chunk when it is admitted this step, computes more than one token
beyond its drafts, or has fewer computed tokens than it had when admitted (its prompt, and the
outputs it recomputes after preemption: a later chunk of exactly one prompt token).

Lines are kept in memory and written every `flush_every` steps and at `close()`: the step loop
pays one pass over the scheduled sequences and one formatted line per step (about 17 us a step
of 256 sequences on a slow shared CPU core, 0.2-0.3% of a 6 ms decode step), and one write per
`flush_every` steps. A process killed with SIGKILL loses the unwritten lines;
a reader skips a torn last line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from phloem.core.scheduler_output import SchedulerOutput
from phloem.engine.step_observer import StepRecord

TRACE_FORMAT = "phloem-steps"


def step_counts(
    sched: SchedulerOutput, known: dict[str, int] | None = None
) -> tuple[int, int, int, int, int, int]:
    """(seqs, decode_seqs, prefill_tokens, prefill_chunks, tokens, shared_seqs) of one step (see
    the module docstring for what counts as a prompt chunk). `known`: seq id -> tokens it held
    when admitted, kept up to date here from the step's admissions and departures (None: a
    one-token later chunk counts as a decode). One pass over the sequences: it runs on the
    engine's thread every step."""
    tokens = prefill_tokens = prefill_chunks = shared = 0
    if known is not None:
        for seq_id in sched.finished_seq_ids:
            known.pop(seq_id, None)
    for s in sched.scheduled:
        n = s.num_tokens
        tokens += n
        new = s.new_sequence
        if known is not None and new is not None:
            known[s.seq_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        in_prompt = known is not None and s.num_computed_tokens < known.get(s.seq_id, 0)
        if new is not None or n - len(s.draft_token_ids) > 1 or in_prompt:
            prefill_tokens += n
            prefill_chunks += 1
        elif s.prefix_len:
            shared += 1
    seqs = len(sched.scheduled)
    return seqs, seqs - prefill_chunks, prefill_tokens, prefill_chunks, tokens, shared


class StepTraceFile:
    """A step observer that writes the step trace (module docstring) to `path`.

    Args:
        path: the file (truncated); its folder must exist.
        header: engine facts for the first line (limits, flags); JSON-serializable.
        cuda_graphs: decode steps may replay CUDA graphs (CUDA device, enforce_eager off).
        max_graph_seqs: the largest captured decode batch [sequences].
        max_piece_tokens: the largest piecewise token bucket [tokens] (0: no piecewise graphs).
        flush_every: steps between writes (>= 1).
    Raises:
        ValueError: flush_every < 1. OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path, header: dict, cuda_graphs: bool = False,
                 max_graph_seqs: int = 0, flush_every: int = 256,
                 max_piece_tokens: int = 0) -> None:  # fmt: skip
        if flush_every < 1:
            raise ValueError(f"flush_every must be at least 1, got {flush_every}")
        self.path = Path(path)
        self.flush_every = flush_every
        self._graph_seqs = max_graph_seqs if cuda_graphs else 0
        self._piece_tokens = max_piece_tokens if cuda_graphs else 0
        self._lines: list[str] = []
        self._known: dict[str, int] = {}  # seq id -> tokens when admitted (`step_counts`)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        first = {"trace": TRACE_FORMAT, "version": 1, "clock": "monotonic",
                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **header}  # fmt: skip
        self._file.write(json.dumps(first) + "\n")
        self._file.flush()

    @classmethod
    def for_engine(cls, path: str | Path, engine, flush_every: int = 256) -> StepTraceFile:
        """A trace of `engine` (an `LLMEngine`), registered as its step observer; the header
        holds its scheduler limits and whether decode steps may replay CUDA graphs."""
        from phloem.spec_decode.drafter import device_type
        from phloem.worker.piecewise_graph import piecewise_token_sizes

        config, sched = engine.config, engine.scheduler_config
        graphs = device_type(config.model.device) == "cuda" and not config.model.enforce_eager
        pieces = config.model.cuda_graph_mode == "piecewise" and graphs
        piece_tokens = piecewise_token_sizes(sched.max_num_batched_tokens)[-1] if pieces else 0
        header = {
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_prefill_tokens_per_step": sched.max_prefill_tokens_per_step,
            "async_scheduling": sched.async_scheduling,
            "cuda_graphs": graphs,
            "piecewise_max_tokens": piece_tokens,
            "tensor_parallel_size": config.parallel.tensor_parallel_size,
        }
        trace = cls(path, header, graphs, sched.max_num_seqs, flush_every, piece_tokens)
        engine.add_step_observer(trace)
        return trace

    def __call__(self, record: StepRecord) -> None:
        """The step observer: one line per step, a write every `flush_every` steps."""
        end = time.monotonic()
        sched = record.scheduler_output
        seqs, decode, prefill, chunks, tokens, shared = step_counts(sched, self._known)
        decode_graph = tokens == seqs <= self._graph_seqs and not chunks
        pieces = not decode_graph and tokens <= self._piece_tokens
        graph = "true" if decode_graph or pieces else "false"
        self._lines.append(
            f'{{"step":{record.step_index},"t0":{record.started_at:.6f},"t1":{end:.6f},'
            f'"seqs":{seqs},"decode_seqs":{decode},"prefill_tokens":{prefill},'
            f'"prefill_chunks":{chunks},"tokens":{tokens},'
            f'"shared_seqs":{shared},"graph":{graph},'
            f'"schedule_ms":{record.schedule_s * 1e3:.3f},"launch_ms":{record.launch_s * 1e3:.3f},'
            f'"wait_ms":{record.wait_s * 1e3:.3f},"update_ms":{record.update_s * 1e3:.3f}}}\n'
        )
        if len(self._lines) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the lines kept so far."""
        if self._lines and not self._file.closed:
            self._file.write("".join(self._lines))
            self._file.flush()
        self._lines.clear()

    def close(self) -> None:
        """Write what is left and close the file (idempotent)."""
        if not self._file.closed:
            self.flush()
            self._file.close()


def read_step_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, steps) of a step trace file; a torn last line (a killed writer) is skipped.

    Raises:
        ValueError: naming the file, when its first line is not a phloem step trace header.
    """
    header: dict | None = None
    steps = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line of a writer killed mid-write
            if header is None:
                if record.get("trace") != TRACE_FORMAT:
                    raise ValueError(f"{path}: not a phloem step trace (first line {line[:80]!r})")
                header = record
            else:
                steps.append(record)
    if header is None:
        raise ValueError(f"{path}: empty file, not a phloem step trace")
    return header, steps
