"""What a batch job (`phloem generate`, `phloem run-batch`) checks before it loads the model and
holds while it runs: its paths, an exclusive lock on its output, and a fingerprint that says
whether results saved by an earlier run belong to this job.

Order, so that a job that cannot run fails at once and writes nothing:

    check_paths -> job_options (model files) -> OutputLock -> resume_results -> load model -> run

The fingerprint (`<output>.job.json`, written atomically) holds every option that changes outputs
(model path and files, load format, dtype, device, KV cache dtype, seeds, max_model_len, sampling
defaults, served model name) and a digest of each input line. A rerun whose options or input
lines differ from the saved ones refuses, naming what changed, unless `--recompute-changed` is
given: then the saved results of the changed lines (all of them when an option changed) are
dropped and recomputed. While a job runs, an interrupt (SIGINT), a termination (SIGTERM, inside
`sigterm_interrupts()`) or a full disk ends it with one line saying what is saved and how to
finish, and an exit code of its own (`EXIT_*`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import signal
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
KeyT = TypeVar("KeyT", bound=Hashable)  # a result record's key (`resume_results`)

EXIT_USAGE = 2  # the job cannot run as given (paths, options, fingerprint): nothing written
EXIT_NO_SPACE = 74  # a write failed for lack of space (EX_IOERR); finished lines are kept
EXIT_LOCKED = 75  # another process holds the output's lock (EX_TEMPFAIL); try again later
EXIT_INTERRUPTED = 130  # SIGINT (128 + 2); finished lines are kept
EXIT_TERMINATED = 143  # SIGTERM (128 + 15); finished lines are kept
EXIT_CODES_HELP = (
    "exit codes: 0 done; 1 a data-parallel replica failed or died (finished lines are kept: "
    "rerun the same command to finish); 2 cannot run as given (bad paths or options, or saved results of "
    "another input or options: nothing written); 74 out of disk space, 130 interrupted (finished "
    "lines are kept: rerun the same command to finish), 143 terminated (likewise); 75 another job "
    "holds the output's lock"
)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: a file size limit (ulimit -f)
_MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.json", "chat_template.jinja", "tokenizer.model",
    "vocab.json", "merges.txt",
)  # fmt: skip


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread inside `sigterm_interrupts()`: an interrupt, so every
    `except KeyboardInterrupt` cleanup runs, with an exit code of its own."""


@contextlib.contextmanager
def sigterm_interrupts():
    """Within this block SIGTERM raises `Terminated` in the main thread (instead of killing the
    process without a word), so a job stops as on SIGINT: its lock released, one line saying
    what is saved. The previous handler is restored on exit. Call from the main thread."""

    def raise_terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_job(job: Callable[[], T], report: Callable[[T], int | None]) -> int:
    """Run a batch command's `job()` (paths, lock, model, lines), then `report(result)`; return
    the exit code: `report`'s (0 if None), or a JobError's after printing it as one line, or 130
    / 143 after saying that an interrupt or SIGTERM before the job's first line saved nothing.
    SIGTERM is an interrupt throughout (`sigterm_interrupts`). Call from the main thread."""
    import sys

    try:
        with sigterm_interrupts():
            result = job()
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        word = "terminated" if terminated else "interrupted"
        print(f"{word} before the job started: nothing saved", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    return report(result) or 0


class JobError(Exception):
    """A job that stops with a one-line message (what is saved, how to go on) and an exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def check_paths(input_path: str, output_path: str | None, written: Iterable[str] = ()) -> None:
    """Check the job's input and output paths without writing anything.

    Args:
        input_path: must be a readable regular file.
        output_path: None when the job writes no output (`--plan-only`); else must not be a
            directory, nor the input, and its directory must exist and be writable.
        written: other files the job writes at its end (e.g. `--summary-json`), checked the same.
    Raises:
        JobError (EXIT_USAGE) naming the path and the problem.
    """
    if os.path.isdir(input_path):
        raise JobError(f"input {input_path} is a directory, not a JSONL file", EXIT_USAGE)
    try:
        with open(input_path, "rb"):
            pass
    except OSError as e:
        raise JobError(f"cannot read input {input_path}: {e.strerror}", EXIT_USAGE) from None
    for path in ([output_path] if output_path is not None else []) + list(written):
        _check_output_path(path, input_path)


def _check_output_path(path: str, input_path: str) -> None:
    if os.path.isdir(path):
        raise JobError(f"output {path} is a directory; name a file in it", EXIT_USAGE)
    if os.path.exists(path) and os.path.samefile(path, input_path):
        raise JobError(f"output {path} is the input file; name another output", EXIT_USAGE)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise JobError(f"the directory of output {path} does not exist: {directory}", EXIT_USAGE)
    if not os.access(directory, os.W_OK | os.X_OK) or (
        os.path.exists(path) and not os.access(path, os.W_OK)
    ):
        raise JobError(f"output {path} is not writable", EXIT_USAGE)


def model_identity(model: str | None) -> dict[str, Any]:
    """The model a job runs, as files: the resolved path and (size, mtime) of each weight,
    config and tokenizer file, so a checkpoint swapped in place counts as another model.
    Reads no file contents. Raises as `resolve_model` does for a missing or invalid model."""
    from phloem.models.loader import resolve_model

    source = resolve_model(model)
    if source.gguf_file is not None:
        names = [source.gguf_file]
    else:
        names = sorted(
            n for n in os.listdir(source.path) if n in _MODEL_FILES or n.endswith(".safetensors")
        )
    files = {}
    for name in names:
        st = os.stat(os.path.join(source.path, name))
        files[name] = [st.st_size, st.st_mtime_ns]
    path = source.gguf_path if source.gguf_file is not None else source.path
    return {"path": os.path.abspath(path), "files": files}


def job_options(args: Any, **extra: Any) -> dict[str, Any]:
    """The options of a CLI job that change its outputs, keyed by flag name (`extra`: the
    command's own, e.g. sampling defaults). Engine options that change only speed (block size,
    batch limits, attention backend, KV layout, async scheduling) are left out."""
    return {
        "--model": model_identity(args.model),
        "--load-format": args.load_format,
        "--dtype": args.dtype,
        "--device": args.device,
        "--kv-cache-dtype": args.kv_cache_dtype,
        "--max-model-len": args.max_model_len,
        "--seed": args.seed,
        **extra,
    }


def line_digest(raw: str) -> str:
    """A short digest of one input line (surrogates from undecodable bytes hash too)."""
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _describe_option(flag: str, old: Any, new: Any) -> str:
    if flag == "--model" and isinstance(old, dict) and old.get("path") == new.get("path"):
        return f"the files of --model {new['path']} changed"
    if flag == "--model":
        old, new = (v.get("path") if isinstance(v, dict) else v for v in (old, new))
    return f"{flag} changed (was {json.dumps(old)}, now {json.dumps(new)})"


class Fingerprint:
    """The saved options and input-line digests of a job, beside its output (`<output>.job.json`).

    Args:
        path: the fingerprint file.
        options: this run's options (JSON-able, keyed by flag name; see `job_options`).
        lines: this run's input lines by line number (as the job numbers them in its records).
    """

    def __init__(self, path: str, options: dict[str, Any], lines: dict[Hashable, str]) -> None:
        self.path = path
        self.options = options
        self.digests = {str(k): line_digest(raw) for k, raw in lines.items()}

    def load(self) -> dict[str, Any] | None:
        """The saved fingerprint, or None when there is none. Raises JobError if unreadable."""
        try:
            with open(self.path, encoding="utf-8") as f:
                saved = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise JobError(
                f"cannot read the job fingerprint {self.path} ({e}); delete it and the output "
                "to start the job over",
                EXIT_USAGE,
            ) from None
        if not isinstance(saved, dict) or not {"options", "lines"} <= set(saved):
            raise JobError(
                f"{self.path} is not a phloem job fingerprint; delete it and the output to start "
                "the job over",
                EXIT_USAGE,
            )
        return saved

    def stale_keys(self, saved: dict[str, Any], saved_results: str, recompute_changed: bool):
        """The keys (as str) of lines whose saved results are stale: all of them when an option
        changed, else those whose line changed or is gone. Raises JobError (EXIT_USAGE) naming the
        change when there is one and `recompute_changed` is off."""
        changed_options = [
            _describe_option(flag, saved["options"].get(flag), value)
            for flag, value in self.options.items()
            if saved["options"].get(flag) != value
        ] + [f"{flag} was given before" for flag in saved["options"] if flag not in self.options]
        old = saved["lines"]
        changed = [k for k in old if self.digests.get(k) != old[k]]
        added = [k for k in self.digests if k not in old]
        if not changed_options and not changed and not added:
            return set()
        if changed_options:
            what = "; ".join(changed_options)
            stale = set(old)
        else:
            shown = ", ".join(f"line {k}" for k in (changed + added)[:5])
            more = "" if len(changed) + len(added) <= 5 else ", ..."
            what = f"{len(changed) + len(added)} input lines changed ({shown}{more})"
            stale = set(changed)
        if not recompute_changed:
            raise JobError(
                f"refusing to resume: {what} since the results in {saved_results} were saved; "
                "rerun with the same input and options, add --recompute-changed to recompute "
                f"what changed, or delete {saved_results} to start over",
                EXIT_USAGE,
            )
        return stale

    def save(self) -> None:
        """Write this run's fingerprint (atomically: a crash leaves the old one or the new one)."""
        from phloem.entrypoints.resumable import write_atomically

        record = {"phloem_job": 1, "options": self.options, "lines": self.digests}
        write_atomically(self.path, [json.dumps(record, ensure_ascii=False)])

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


def resume_results(
    path: str,
    key_of: Callable[[dict], KeyT | None],
    line_of: Callable[[KeyT], str],
    fingerprint: Fingerprint,
    recompute_changed: bool,
    foreign_refused: bool,
):
    """Open a job's result log and the results it already holds that are still valid.

    Args:
        path: the result log (run-batch: the output; generate: `<output>.partial`).
        key_of: a record's key, None for records of no line of this input (see `ResultLog`).
        line_of: the line number (as in the fingerprint) of a key.
        fingerprint: this run's; compared with the saved one, and saved when they differ.
        recompute_changed: drop the results of changed lines instead of refusing.
        foreign_refused: a non-empty log with no saved fingerprint refuses (run-batch: it may
            be another job's results); else it is discarded (generate's partial file).
    Returns:
        (ResultLog, {key: record}).
    Raises:
        JobError (EXIT_USAGE) when saved results are not this job's (see `Fingerprint`).
    Mutates: drops stale, torn and foreign lines from the log; writes the fingerprint. The log is
    rewritten before the fingerprint, so a crash between the two never leaves stale results
    under a fingerprint that vouches for them (the rerun with the flag finishes the job).
    """
    from phloem.entrypoints.resumable import ResultLog

    saved = fingerprint.load()
    has_results = os.path.exists(path) and os.path.getsize(path) > 0
    stale: set[str] = set()
    if has_results and saved is None:
        if foreign_refused:
            raise JobError(
                f"output {path} already holds lines that no phloem fingerprint "
                f"({fingerprint.path}) says are this job's; choose another --output, or delete "
                f"{path} to start over",
                EXIT_USAGE,
            )
        logger.warning("%s has no fingerprint (another job's, or older): discarded", path)
        os.remove(path)
    elif has_results:
        assert saved is not None
        stale = fingerprint.stale_keys(saved, path, recompute_changed)
        if stale:
            logger.warning("recomputing %d lines whose results in %s are stale", len(stale), path)

    def fresh_key_of(record: dict) -> KeyT | None:
        key = key_of(record)
        return None if key is None or line_of(key) in stale else key

    log = ResultLog(path, fresh_key_of)
    done = log.load()
    if saved is None or (saved["options"], saved["lines"]) != (
        fingerprint.options,
        fingerprint.digests,
    ):
        fingerprint.save()
    return log, done


class OutputLock:
    """An exclusive `flock` on `<output>.lock`, held while a job writes its output.

    A second job on the same output refuses at once (JobError, EXIT_LOCKED) naming the process
    that holds it. The lock file is removed on release; a process that opened it just before
    the removal notices (its file is no longer the one at the path) and tries again, so two
    processes never both hold a lock.
    """

    def __init__(self, output_path: str) -> None:
        self.output_path = output_path
        self.path = output_path + ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise JobError(
                    f"another phloem job (pid {holder}) is writing {self.output_path} (it holds "
                    f"{self.path}); wait for it to end, or choose another --output",
                    EXIT_LOCKED,
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file after we opened it: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)  # while still holding it: see the class docstring
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class JobProgress:
    """Turns an interrupt or a full disk inside its `with` block into a JobError that says what
    is saved and how to finish. The job keeps `num_saved` up to date."""

    def __init__(self, saved_path: str, num_lines: int) -> None:
        self.saved_path = saved_path
        self.num_lines = num_lines
        self.num_saved = 0

    def __enter__(self) -> JobProgress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        saved = f"{self.num_saved} of {self.num_lines} lines saved in {self.saved_path}"
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            terminated = issubclass(exc_type, Terminated)
            raise JobError(
                f"{'terminated' if terminated else 'interrupted'}: {saved}; rerun the same "
                "command to finish",
                EXIT_TERMINATED if terminated else EXIT_INTERRUPTED,
            ) from None
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            where = f" writing {exc.filename}" if exc.filename else ""
            raise JobError(
                f"{exc.strerror}{where}: {saved}; free space and rerun the same command to finish",
                EXIT_NO_SPACE,
            ) from None
