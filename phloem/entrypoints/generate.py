"""`phloem generate`: the offline batch job, JSONL in, JSONL out (one line per input line).

Every line is validated on its own: a bad line yields `{"id", "error"}` and the rest of the job
runs. Good lines are handed to `LLM` as one batch, so the engine sees the whole job at once.

Crash-safe and resumable: each finished line is appended and flushed to `<output>.partial`
(`phloem.entrypoints.resumable.ResultLog`) as it finishes; the ordered output file is written
from those records at the end (atomically) and the partial file removed. Rerunning the same
command after a crash (even `kill -9` mid-write) drops a torn last record, skips the lines
already done and runs the rest. Before the model loads, the job checks its paths, locks its
output and compares its fingerprint (every option that changes outputs, and each input line) with
the one saved beside the output (`<output>.job.json`): a mismatching rerun refuses, naming what
changed, or with `--recompute-changed` recomputes the changed lines (see `job_guard`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phloem.entrypoints.jsonl_input import (
    clean,
    loads,
    read_lines,
    text_problem,
    top_level,
    value_problem,
)
from phloem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from phloem.entrypoints.job_guard import JobProgress
    from phloem.entrypoints.resumable import ResultLog

_LINE_KEYS = {"id", "prompt", "messages"}
logger = logging.getLogger(__name__)


@dataclass
class ParsedLine:
    """One input line: its id and either a prepared prompt or an error."""

    id: str
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None
    error: str | None = None


def parse_line(llm, raw: str, line_number: int, defaults: dict[str, Any]) -> ParsedLine:
    """Parse and validate one JSONL line (never raises: errors land in `ParsedLine.error`).

    Accepted: {"id"?: str, "prompt": str} or {"id"?: str, "messages": [...]}, plus any
    SamplingParams field (max_tokens, temperature, ...) overriding the job's defaults.
    `line_number` is the line's physical number in the file (the default id). `raw` is the
    line as `jsonl_input.read_lines` returns it: undecodable bytes fail the line, naming the
    byte, with its id kept when the rest of the line parses.
    """
    line_id = str(line_number)
    byte_problem = text_problem(raw)
    try:
        record = loads(raw)
    except ValueError as e:
        shallow = top_level(raw)  # a line nested too deeply to parse still has its id
        if isinstance(shallow, dict):
            line_id = _line_id(shallow, line_id) or line_id
        return ParsedLine(line_id, error=clean(f"line {line_number}: {byte_problem or e}"))
    if not isinstance(record, dict):
        return ParsedLine(line_id, error=f"line {line_number}: expected a JSON object")
    parsed_id = _line_id(record, line_id)
    if parsed_id is None:
        return ParsedLine(line_id, error="field 'id' must be a string")
    line_id = parsed_id
    problem = byte_problem or value_problem(record)
    if problem is not None:
        return ParsedLine(line_id, error=f"line {line_number}: {problem}")
    try:
        has_prompt, has_messages = "prompt" in record, "messages" in record
        if has_prompt == has_messages:
            raise ValueError("each line needs exactly one of the fields 'prompt' or 'messages'")
        if has_prompt:
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise ValueError("field 'prompt' must be a non-empty string")
            text, ids = record["prompt"], llm.get_tokenizer().encode(record["prompt"])
        else:
            text, ids = llm.encode_chat(record["messages"])
        overrides = {k: v for k, v in record.items() if k not in _LINE_KEYS}
        params = SamplingParams.from_dict({**defaults, **overrides})
        llm.llm_engine.validate_prompt(ids)
        llm.llm_engine.validate_params(params)
    except ValueError as e:
        return ParsedLine(line_id, error=clean(str(e)))
    except Exception as e:  # a tokenizer or template failure is this line's problem only
        return ParsedLine(line_id, error=clean(f"{type(e).__name__}: {e}"))
    return ParsedLine(line_id, text, ids, params)


def _line_id(record: dict, default: str) -> str | None:
    """The record's id as output text (a string, or an int written as one; lone surrogates
    replaced), `default` without one, None when it is of another type."""
    value = record.get("id", default)
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        return None
    try:
        return clean(str(value))
    except ValueError:  # an int beyond the conversion limit
        return None


def output_record(parsed: ParsedLine, output) -> dict[str, Any]:
    """The output line of a finished request (a list under "outputs" when n > 1); a request
    that failed in the engine gets {"id", "error"} like a bad line."""
    if output.error is not None:
        return {"id": parsed.id, "error": output.error}
    completions = [
        {
            "text": c.text,
            "finish_reason": c.finish_reason,
            "num_output_tokens": len(c.token_ids),
        }
        for c in output.outputs
    ]
    record: dict[str, Any] = {"id": parsed.id}
    if len(completions) == 1:
        record.update(completions[0])
    else:
        record["outputs"] = completions
    record["num_prompt_tokens"] = len(output.prompt_token_ids)
    return record


@dataclass
class GenerateJob:
    """A job opened before the model loads (`open_generate_job`): its input lines, the partial
    log and the records it already holds ({line number: {"line", "record"}})."""

    lines: list[tuple[int, str]]
    log: ResultLog
    done: dict[int, dict]
    progress: JobProgress


@contextlib.contextmanager
def open_generate_job(
    input_path: str, output_path: str, options: dict[str, Any], recompute_changed: bool = False
) -> Iterator[GenerateJob]:
    """Lock the output, check the saved results against this job's fingerprint (`options` and
    the input lines; see `phloem.entrypoints.job_guard`) and open `<output>.partial`.

    Raises:
        JobError: the output is locked by another job, or saved results belong to another job
            (unless `recompute_changed`); inside the block, an interrupt or a full disk.
    """
    from phloem.entrypoints.job_guard import Fingerprint, JobProgress, OutputLock, resume_results

    lines = read_lines(input_path)
    partial = output_path + ".partial"
    with OutputLock(output_path), JobProgress(partial, len(lines)) as progress:
        fingerprint = Fingerprint(output_path + ".job.json", options, dict(lines))
        numbers = {n for n, _ in lines}

        def key_of(record: dict) -> int | None:
            n, inner = record.get("line"), record.get("record")
            return n if n in numbers and isinstance(inner, dict) else None

        log, done = resume_results(partial, key_of, str, fingerprint, recompute_changed, False)
        progress.num_saved = len(done)
        try:
            yield GenerateJob(lines, log, done, progress)
        finally:
            log.close()
        fingerprint.remove()


def run_generate(
    llm,
    input_path: str,
    output_path: str,
    defaults: dict[str, Any],
    use_tqdm=True,
    job: GenerateJob | None = None,
):
    """Run (or resume) the job; returns the summary dict (see `phloem.engine.metrics.summarize`;
    with data_parallel_size > 1 it has a "data_parallel" object, `ReplicaReport.to_dict`).

    `job`: opened before the model loaded, as `cmd_generate` does; None opens one here whose
    fingerprint holds the input lines and `defaults` only (not the model).
    """
    if job is None:
        with open_generate_job(input_path, output_path, {"sampling flags": defaults}) as job:
            return run_generate(llm, input_path, output_path, defaults, use_tqdm, job)
    from phloem.engine.metrics import summarize

    start, engine, outputs, done = time.monotonic(), llm.llm_engine, [], job.done
    computed_before = engine.num_computed_prompt_tokens
    parsed: list[ParsedLine] = []
    todo: list[int] = []  # indices into parsed of the good lines not done yet

    def build():  # runs with collection paused (LLM.run_batch)
        parsed.extend(parse_line(llm, raw, n, defaults) for n, raw in job.lines)
        todo.extend(
            i for i, p in enumerate(parsed) if p.error is None and job.lines[i][0] not in done
        )
        if done:
            logger.info("resuming: %d lines already done, %d to run", len(done), len(todo))
        # parse_line ran validate_prompt on every good line
        encoded = [(parsed[i].prompt_text, parsed[i].prompt_token_ids) for i in todo]
        return encoded, [parsed[i].sampling_params for i in todo]

    for k, output in llm.run_batch(build, use_tqdm=use_tqdm):
        i = todo[k]
        n = job.lines[i][0]
        done[n] = {"line": n, "record": output_record(parsed[i], output)}
        job.log.append(done[n])
        job.progress.num_saved += 1
        outputs.append(output)
    good = [p for p in parsed if p.error is None]
    _write_output(output_path, parsed, job)
    plan = llm.last_plan
    summary = summarize(
        outputs,
        time.monotonic() - start,
        num_failed_requests=len(parsed) - len(good),
        num_computed_prompt_tokens=engine.num_computed_prompt_tokens - computed_before,
        planned_reuse_ratio=plan.planned_reuse_ratio if plan is not None else 0.0,
        load_s=llm.load_s,
    )
    if (report := llm.last_replica_report) is not None:  # planned vs achieved per replica
        summary["data_parallel"] = report.to_dict()
    return summary


def _write_output(output_path: str, parsed: list[ParsedLine], job: GenerateJob) -> None:
    """Write the job's output atomically, one line per input line (its record, or its error),
    then remove the finished-record log it came from."""
    from phloem.entrypoints.resumable import write_atomically

    job.log.close()
    write_atomically(
        output_path,
        [
            json.dumps({"id": p.id, "error": p.error} if p.error else job.done[n]["record"],
                       ensure_ascii=False)
            for p, (n, _) in zip(parsed, job.lines)
        ],
    )  # fmt: skip
    with contextlib.suppress(FileNotFoundError):  # absent when no line was good
        os.remove(job.log.path)


def run_plan_only(llm, input_path: str, defaults: dict[str, Any]) -> str:
    """The global prefix plan of a job, as text, without running the model; with
    data_parallel_size > 1 also the deal of its requests to the replicas
    (`DataParallelEngine.deal`)."""
    from phloem.engine.data_parallel import DataParallelEngine

    parsed = [parse_line(llm, raw, n, defaults) for n, raw in read_lines(input_path)]
    good = [p for p in parsed if p.error is None]
    ids, params = [p.prompt_token_ids for p in good], [p.sampling_params for p in good]
    plan = llm.plan(ids, params)
    failed = (
        f"\n  {len(parsed) - len(good)} lines failed validation" if len(good) < len(parsed) else ""
    )
    text = plan.describe() + failed
    if isinstance(llm.llm_engine, DataParallelEngine):
        encoded = [(p.prompt_text, p.prompt_token_ids) for p in good]
        text += "\n" + llm.llm_engine.deal(encoded, params, plan).describe()
    return text


EXIT_REPLICA_FAILED = 1  # a data-parallel replica failed or died; finished lines are kept


@contextlib.contextmanager
def replica_failures(progress: JobProgress) -> Iterator[None]:
    """Turn a `ReplicaError` inside the block into a JobError (exit `EXIT_REPLICA_FAILED`):
    one line naming the replica and saying what is saved, then the replica's traceback when an
    exception in it was the cause (`phloem generate` and `phloem run-batch`)."""
    from phloem.engine.replica_process import ReplicaError
    from phloem.entrypoints.job_guard import JobError

    try:
        yield
    except ReplicaError as e:
        saved = f"{progress.num_saved} of {progress.num_lines} lines saved in {progress.saved_path}"
        message = f"{e}; {saved}; rerun the same command to finish"
        if e.remote_traceback:
            message += f"\nreplica {e.replica}'s traceback:\n{e.remote_traceback.rstrip()}"
        raise JobError(message, EXIT_REPLICA_FAILED) from None


def register(subparsers) -> None:
    """Add `phloem generate` to the CLI."""
    from phloem.entrypoints.cli import add_engine_args, add_sampling_args
    from phloem.entrypoints.job_guard import EXIT_CODES_HELP

    gen = subparsers.add_parser(
        "generate", help="run an offline JSONL batch job", epilog=EXIT_CODES_HELP
    )
    gen.add_argument("--input", "-i", required=True, help="JSONL: {id?, prompt | messages, ...}")
    gen.add_argument("--output", "-o", required=True, help="JSONL, one line per input line")
    gen.add_argument("--summary-json", default=None, help="write the job summary here")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.add_argument(
        "--plan-only",
        action="store_true",
        help="print the global prefix-sharing plan and exit without running the model",
    )
    gen.add_argument(
        "--recompute-changed",
        action="store_true",
        help="resume even though input lines or options changed: recompute the changed lines "
        "(every line when an option changed) instead of refusing",
    )
    gen.add_argument(
        "--ray-address",
        default=None,
        help="run the job on this Ray cluster ('auto' or HOST:PORT; pip install 'phloem[ray]'): "
        "--data-parallel-size replica actors under one prefix plan made here (phloem.ray)",
    )
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Exit codes: 0 done; 1 a data-parallel replica failed; 2 the job cannot run as given
    (nothing written); 74 out of disk space, 75 the output is locked by another job, 130
    interrupted, 143 terminated (finished lines are kept: rerun the same command to finish).
    See `phloem.entrypoints.job_guard`."""
    from phloem.entrypoints.job_guard import check_paths, job_options, run_job

    def plan_only() -> int:
        defaults = _checked_sampling_defaults(args)
        check_paths(args.input, None)
        return _plan_only(args, defaults)

    def job():
        if args.ray_address is not None:  # before any work: Ray installed, the cluster there
            _connect_ray(args.ray_address)
        defaults = _checked_sampling_defaults(args)
        written = [args.summary_json] if args.summary_json else []
        check_paths(args.input, args.output, written)
        options = job_options(args, **{"sampling flags": defaults})
        with open_generate_job(args.input, args.output, options, args.recompute_changed) as opened:
            with replica_failures(opened.progress):
                return _run(args, defaults, opened)

    if args.plan_only:
        return run_job(plan_only, lambda code: code)
    return run_job(job, lambda summary: _report(args, summary))


def _checked_sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as SamplingParams fields. Raises JobError (exit 2) when invalid."""
    from phloem.entrypoints.cli import sampling_defaults
    from phloem.entrypoints.job_guard import EXIT_USAGE, JobError

    defaults = sampling_defaults(args)
    try:
        SamplingParams.from_dict(defaults)
    except ValueError as e:
        raise JobError(str(e), EXIT_USAGE) from None
    return defaults


def _plan_only(args: argparse.Namespace, defaults: dict[str, Any]) -> int:
    from phloem.engine.llm import LLM
    from phloem.engine_args import EngineArgs

    with LLM.for_planning(EngineArgs.from_cli_args(args)) as llm:  # starts no replica
        print(run_plan_only(llm, args.input, defaults))
    return 0


def _connect_ray(address: str) -> None:
    """Connect to the Ray cluster of --ray-address. Raises JobError (exit 2) naming the flag
    when Ray is not installed or no cluster answers there."""
    from phloem.entrypoints.job_guard import EXIT_USAGE, JobError
    from phloem.ray import connect

    try:
        connect(address, "--ray-address")
    except ValueError as e:
        raise JobError(str(e), EXIT_USAGE) from None


def _run(args: argparse.Namespace, defaults: dict[str, Any], job: GenerateJob) -> dict:
    from phloem.engine_args import EngineArgs
    from phloem.entrypoints.cli import build_llm
    from phloem.ray import PhloemProcessorConfig, RayLLM

    if args.ray_address is not None:  # planned here, generated by Ray actors
        config = PhloemProcessorConfig.from_engine_args(EngineArgs.from_cli_args(args))
        llm = RayLLM(config)
    else:
        llm = build_llm(args)
    with llm:  # stops data-parallel replicas when the job ends
        use_tqdm = not args.no_progress
        return run_generate(llm, args.input, args.output, defaults, use_tqdm, job)


def _report(args: argparse.Namespace, summary: dict) -> None:
    from phloem.engine.metrics import format_summary

    print(format_summary(summary), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
