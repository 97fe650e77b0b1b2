"""The grammar process's side of `grammar_process.GrammarProcessClient`: a
`StructuredOutputManager` in a process of its own (its own interpreter and GIL), serving the
engine's requests over one pipe and filling the bitmask into shared memory.

    engine (parent)                            grammar process (this module)
    ("ops", [("r", seq, params) | ("f", seq)]) register / forget; no reply
    ("buffers", shm name, rows)                  fill a larger segment from now on; no reply
    ("step", ids, tokens, fill_ids)          ─► accept_rows(ids, tokens) ─► ("advanced", ...)
                                                bitmask(fill_ids) into shm ─► ("filled", ...)
    ("stats",)                                ─► ("stats", GrammarStats fields)
    ("stop",)                                    returns (the parent joins it)
                                              ◄─ ("ready", [seq ids]) once their matchers are
                                                 built (after each message, and every
                                                 `_READY_POLL_S` while some are not)
                                              ◄─ ("fatal", reason): the backend did not build

Only this process's main thread reads and writes the pipe. Imports no torch (xgrammar does).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from dataclasses import dataclass

import numpy as np

from phloem.structured_output.backend import bitmask_width
from phloem.structured_output.bitmask_segment import AttachedSegment

_READY_POLL_S = 0.001  # how often matchers still being built are looked at [s]


@dataclass(frozen=True)
class GrammarProcessSpec:
    """What the grammar process builds its backend and manager from (picklable).

    Attributes:
        backend: the grammar library (`StructuredOutputsConfig.backend`).
        tokenizer_json: the model's tokenizer as the `tokenizers` library's JSON (what both
            libraries read of a transformers fast tokenizer).
        vocab_size: the logits' width [tokens].
        stop_token_ids: the ids that end a sequence (EOS).
        num_threads: the library's threads (compiles, fills and advances).
        max_rows: the most bitmask rows a step fills (the engine's `max_num_seqs`).
    """

    backend: str
    tokenizer_json: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    num_threads: int
    max_rows: int


def child_main(conn, spec: GrammarProcessSpec, shm_name: str, rows: int) -> None:
    """The grammar process (`multiprocessing` spawn target): build the backend and manager
    over the shared memory `shm_name` (two buffers of `rows` rows), then serve `conn` until
    "stop" or the parent is gone. A backend that does not build is reported ("fatal") and the
    process exits. SIGINT is left to the parent, which stops this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    width = bitmask_width(spec.vocab_size)
    segment = AttachedSegment(shm_name, rows, width)
    manager = None
    try:
        try:
            manager = _build(spec, segment.views)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails its rows
            conn.send(("fatal", f"{type(e).__name__}: {e}"))
            return
        segment = _serve(conn, manager, segment, width)
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        if manager is not None:
            manager.shutdown()
        manager = None
        segment.close()


def _build(spec: GrammarProcessSpec, views: tuple[np.ndarray, np.ndarray]):
    """The manager over the spec's backend, filling `views` in turn."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from phloem.structured_output import make_backend
    from phloem.structured_output.backend import TokenizerData
    from phloem.structured_output.manager import StructuredOutputManager

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec.tokenizer_json))
    data = TokenizerData(tokenizer, spec.vocab_size, spec.stop_token_ids)
    backend = make_backend(data, spec.num_threads, spec.backend)
    return StructuredOutputManager(backend, spec.vocab_size, spec.num_threads, buffers=views)


def _serve(conn, manager, segment: AttachedSegment, width: int) -> AttachedSegment:
    """Answer the parent's messages in order (module docstring) until "stop"; returns the
    segment in use then."""
    pending: set[str] = set()  # registered, matcher not built yet
    while True:
        if conn.poll(_READY_POLL_S if pending else None):
            message = conn.recv()
            kind = message[0]
            if kind == "step":
                _step(conn, manager, segment.first, *message[1:])
            elif kind == "ops":
                _apply(manager, message[1], pending)
            elif kind == "buffers":  # a larger segment: the old one is not filled again
                new = AttachedSegment(message[1], message[2], width)
                manager.use_buffers(new.views)
                segment.close()
                segment = new
            elif kind == "stats":
                conn.send(("stats", dataclasses.asdict(manager.stats)))
            elif kind == "reset_lag":
                manager.reset_max_ready_lag()
            elif kind == "stop":
                return segment
        if pending:
            ready = [seq_id for seq_id in pending if manager.is_ready(seq_id)]
            if ready:
                pending.difference_update(ready)
                conn.send(("ready", ready))


def _apply(manager, ops: list[tuple], pending: set[str]) -> None:
    """Register ("r", seq id, params) and forget ("f", seq id) sequences, in order."""
    for op in ops:
        if op[0] == "r":
            manager.register(op[1], op[2])
            pending.add(op[1])
        else:
            manager.forget(op[1])
            pending.discard(op[1])


def _step(conn, manager, first: int, ids, tokens, fill_ids) -> None:
    """Advance the rows (ids, tokens) and reply at once, then fill `fill_ids` and reply (either
    part skipped when its ids are None). A reply carries the exception's text instead of a
    result when the manager raised; "filled" carries which buffer was written and the times
    (perf_counter seconds, one clock for both processes on Linux): the message's arrival, the
    fill's start and end."""
    received = time.perf_counter()
    if ids is not None:
        try:
            conn.send(("advanced", manager.accept_rows(ids, tokens), None))
        except Exception as e:  # noqa: BLE001 - the parent raises it from `advance`
            conn.send(("advanced", None, f"{type(e).__name__}: {e}"))
    if fill_ids is None:
        return
    start = time.perf_counter()
    try:
        grammar, failed = manager.bitmask(fill_ids)
    except Exception as e:  # noqa: BLE001 - the parent raises it from `bitmask`
        conn.send(("filled", None, f"{type(e).__name__}: {e}", (received, start, start)))
        return
    turn = 0 if grammar.bitmask.ctypes.data == first else 1
    conn.send(("filled", (turn, failed), None, (received, start, time.perf_counter())))
