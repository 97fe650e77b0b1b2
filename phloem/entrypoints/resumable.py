"""Crash-safe, resumable job output: an append-only JSONL log of finished records.

Used by `phloem run-batch` (the log is the output file) and `phloem generate` (the log is
`<output>.partial`; the ordered output is written from it at the end).

Crash model: the process may die at any byte (kill -9, OOM). Each record is one line, written
with a single `write` and flushed right away, so a dead process leaves every finished record on
disk but the last line possibly torn (no newline, cut JSON, cut UTF-8). `ResultLog.load()`
keeps the complete, valid, first-seen record of each key and drops everything else (a torn
tail, garbage, duplicates, records of other jobs), rewriting the file atomically if it dropped
anything, so appending can resume at a line boundary.

    |-- valid record \\n --|-- valid record \\n --|-- torn tail (dropped) --|
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

logger = logging.getLogger(__name__)


class ResultLog:
    """Append-only JSONL records keyed by `key_of(record)` (None: not this job's record).

    Args:
        path: the log file; created on the first append.
        key_of: a record's key; records with a None key or a key seen before are dropped.
        fsync_interval_s: fsync at most this often while appending (process death needs only the
            flush; fsync guards against losing the machine).
    """

    def __init__(
        self, path: str, key_of: Callable[[dict], Hashable | None], fsync_interval_s: float = 1.0
    ) -> None:
        self.path = path
        self.key_of = key_of
        self.fsync_interval_s = fsync_interval_s
        self._file: io.FileIO | None = None
        self._last_sync = 0.0

    def load(self) -> dict[Hashable, dict]:
        """Read the finished records (key -> record). Mutates the file only to drop bad lines."""
        if not os.path.exists(self.path):
            return {}
        with open(self.path, "rb") as f:
            data = f.read()
        *lines, tail = data.split(b"\n")
        dropped = len(tail) > 0
        records: dict[Hashable, dict] = {}
        kept: list[bytes] = []
        for raw in lines:
            try:
                record = json.loads(raw)
                key = self.key_of(record) if isinstance(record, dict) else None
            except (ValueError, UnicodeDecodeError, TypeError):
                key = None
            if key is None or key in records:
                dropped = True
                continue
            records[key] = record
            kept.append(raw)
        if dropped:
            logger.warning(
                "%s: kept %d finished records, dropped %d torn, invalid or duplicate lines",
                self.path,
                len(kept),
                len(lines) + (1 if tail else 0) - len(kept),
            )
            self._rewrite(kept)
        return records

    def _rewrite(self, lines: list[bytes]) -> None:
        _replace_atomically(self.path, (line + b"\n" for line in lines))

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as one line (the line is complete once this returns).

        Unbuffered: a failed write (a full disk) leaves no bytes behind in a buffer to be
        flushed later; what reached the file is at worst a torn last line, dropped by `load`.
        """
        if self._file is None:
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        data = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        while data:
            data = data[self._file.write(data) :]
        now = time.monotonic()
        if now - self._last_sync >= self.fsync_interval_s:
            os.fsync(self._file.fileno())
            self._last_sync = now

    def close(self) -> None:
        """fsync and close the file (closed even when the fsync fails)."""
        if self._file is not None:
            file, self._file = self._file, None
            try:
                os.fsync(file.fileno())
            finally:
                file.close()


def write_atomically(path: str, lines: list[str]) -> None:
    """Write `lines` (each without its newline) to `path` via a temporary file and a rename.
    On failure (e.g. a full disk) the temporary file is removed and `path` is left as it was."""
    _replace_atomically(path, ((line + "\n").encode("utf-8") for line in lines))


def _replace_atomically(path: str, chunks: Iterable[bytes]) -> None:
    """`path` becomes the concatenated `chunks`, written one by one to a temporary file that is
    fsynced and renamed into place; on any failure the temporary file is removed and `path` is
    left as it was."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
