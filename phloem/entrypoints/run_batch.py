"""`phloem run-batch`: OpenAI Batch API files, planned globally, crash-safe and resumable.

Input, one JSON object per line (OpenAI's batch input format):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`url` is /v1/completions or /v1/chat/completions; `body` is that endpoint's request, validated
exactly as the server validates it (`body.model` is not checked: a batch runs one model).

Output, one line per input line (OpenAI's batch output format, in completion order):

    {"id": "batch_req_<line>", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A bad line gets `status_code` 400 and an OpenAI error body; the job goes on. All good lines go to
the engine at once (`LLM.run_batch`, planned for prefix sharing). Results are appended and
flushed as they finish; rerunning the same command after a crash (even `kill -9` mid-write)
drops a torn last line, skips the lines already answered and runs the rest, so every input line
ends with exactly one output line. `id` carries the input line number, which is how a rerun
knows what is done (together with `custom_id`). Before the model loads, the job checks its
paths, locks the output and compares its fingerprint (every option that changes outputs, and
each input line) with the one kept beside the output (`<output>.job.json`, left there when the
job ends so that a rerun is a no-op): a rerun that differs, or an output no fingerprint vouches
for, refuses; `--recompute-changed` recomputes the changed lines (see `job_guard`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phloem.entrypoints import jsonl_input

if TYPE_CHECKING:
    from phloem.entrypoints.job_guard import JobProgress
    from phloem.entrypoints.resumable import ResultLog

logger = logging.getLogger(__name__)

URLS = ("/v1/completions", "/v1/chat/completions")
_LINE_KEYS = {"custom_id", "method", "url", "body"}


@dataclass
class BatchLine:
    """One input line: its number, custom_id, and either a prepared request or an error."""

    line_number: int
    custom_id: str | None
    url: str | None = None
    prep: Any = None  # server._Prepared
    error: Any = None  # protocol.APIError
    outputs: dict[int, Any] = field(default_factory=dict)  # prompt index -> RequestOutput


def record_id(line_number: int) -> str:
    return f"batch_req_{line_number}"


def parse_batch_line(
    front,
    raw: str,
    line_number: int,
    first_line: dict[str, int],
    check_params: Callable[[Any], None] | None = None,
) -> BatchLine:
    """Validate one line (never raises: errors land in `BatchLine.error` as a 400).

    `first_line` maps each custom_id to the first input line holding it; later lines with the
    same custom_id fail as duplicates (decided over the whole file, so resuming agrees).
    `check_params` (the engine's `validate_params`) checks each prompt's sampling parameters
    against the model; its ValueError fails the line. `raw` is the line as
    `jsonl_input.read_lines` returns it: undecodable bytes fail the line, naming the byte.
    """
    from phloem.entrypoints.openai.protocol import APIError

    line = BatchLine(line_number, None)
    try:
        data = _check_envelope(line, raw, first_line)
        _prepare_body(front, line, data, check_params)
    except APIError as e:
        line.error = e
    except Exception as e:  # noqa: BLE001 - a tokenizer or template failure is this line's only
        line.error = APIError(400, jsonl_input.clean(f"{type(e).__name__}: {e}"))
    return line


def _check_envelope(line: BatchLine, raw: str, first_line: dict[str, int]) -> dict[str, Any]:
    """The line's JSON object with its custom_id, method and url checked (setting
    `line.custom_id` and `line.url`); raises APIError (400) naming the problem."""
    from phloem.entrypoints.openai.protocol import APIError

    line_number = line.line_number
    byte_problem = jsonl_input.text_problem(raw)
    try:
        data = jsonl_input.loads(raw)
    except ValueError as e:
        line.custom_id = _custom_id_of(raw)  # kept even when nested too deeply to parse
        message = jsonl_input.clean(f"line {line_number}: {byte_problem or e}")
        raise APIError(400, message) from None
    if not isinstance(data, dict):
        raise APIError(400, f"line {line_number}: expected a JSON object")
    custom_id = data.get("custom_id")
    if isinstance(custom_id, str) and custom_id:
        line.custom_id = custom_id = jsonl_input.clean(custom_id)
    else:
        raise APIError(400, "custom_id must be a non-empty string", param="custom_id")
    problem = byte_problem or jsonl_input.value_problem(data)
    if problem is not None:
        raise APIError(400, f"line {line_number}: {problem}")
    if first_line.get(custom_id, line_number) != line_number:
        raise APIError(
            400,
            f"duplicate custom_id {custom_id!r} (first on line {first_line[custom_id]})",
            param="custom_id",
        )
    unknown = sorted(set(data) - _LINE_KEYS)
    if unknown:
        raise APIError(400, f"Unrecognized batch line field: {unknown[0]}", param=unknown[0])
    if data.get("method", "POST") != "POST":
        raise APIError(400, "method must be POST", param="method")
    url = data.get("url")
    if url not in URLS:
        raise APIError(400, f"url must be one of {', '.join(URLS)}, got {url!r}", param="url")
    line.url = url
    return data


def _prepare_body(front, line: BatchLine, data: dict[str, Any], check_params) -> None:
    """Validate the line's body as its url's request and prepare it (`line.prep`); raises
    APIError (400) naming the field."""
    from pydantic import ValidationError  # lazy: `phloem` runs without the server extras

    from phloem.entrypoints.openai.protocol import (
        APIError,
        ChatCompletionRequest,
        CompletionRequest,
        sampling_field_of,
        validation_error,
    )
    from phloem.entrypoints.openai.serving import prepare_chat, prepare_completion

    body = data.get("body")
    if not isinstance(body, dict):
        raise APIError(400, "body must be a JSON object", param="body")
    completion = line.url == URLS[0]
    model_cls = CompletionRequest if completion else ChatCompletionRequest
    try:
        request = model_cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    if request.stream:
        raise APIError(400, "stream is not supported in batch jobs", param="stream")
    if isinstance(request, CompletionRequest):  # `completion` chose its class
        line.prep = prepare_completion(front, request)
    else:
        line.prep = prepare_chat(front, request)
    if check_params is not None:
        for params in line.prep.params:
            try:
                check_params(params)
            except ValueError as e:
                raise APIError(400, str(e), param=sampling_field_of(e)) from None


def error_record(line: BatchLine) -> dict[str, Any]:
    return {
        "id": record_id(line.line_number),
        "custom_id": line.custom_id,
        "response": {"status_code": line.error.status_code, "request_id": None,
                     "body": line.error.body()},
        "error": None,
    }  # fmt: skip


def success_record(front, line: BatchLine, created: int) -> dict[str, Any]:
    from phloem.entrypoints.openai.responses import chat_response, completion_response

    finals = [line.outputs[i] for i in range(len(line.prep.prompts))]
    failure = next((o.error for o in finals if o.error is not None), None)
    if failure is not None:  # the request failed alone in the engine: a 500 for this line only
        from phloem.entrypoints.openai.protocol import APIError

        failed = BatchLine(line.line_number, line.custom_id, line.url)
        failed.error = APIError(500, failure, code="request_failed")
        return error_record(failed)
    request_id = line.prep.request_ids[0]
    if line.url == URLS[0]:
        response_id = request_id.rsplit("-", 1)[0] if len(finals) > 1 else request_id
        body = completion_response(front, line.prep, finals, response_id, created)
    else:
        body = chat_response(front, line.prep, finals, created)
    return {
        "id": record_id(line.line_number),
        "custom_id": line.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def read_lines(input_path: str) -> list[tuple[int, str]]:
    """(physical line number, text) of the non-blank input lines; a BOM is dropped and
    undecodable bytes are kept for `parse_batch_line` to report (`jsonl_input.read_lines`)."""
    return jsonl_input.read_lines(input_path)


def _custom_id_of(raw: str) -> str | None:
    """The line's custom_id (lone surrogates replaced, so it can be written), or None."""
    try:
        data = jsonl_input.loads(raw)
    except ValueError:
        data = jsonl_input.top_level(raw)  # nested too deeply: the top level still parses
    value = data.get("custom_id") if isinstance(data, dict) else None
    return jsonl_input.clean(value) if isinstance(value, str) and value else None


@dataclass
class BatchJob:
    """A job opened before the model loads (`open_batch_job`): its input lines, the custom_id
    of each (None where the line has none), the output log and the records it already holds."""

    lines: list[tuple[int, str]]
    custom_ids: dict[int, str | None]  # line number -> custom_id
    log: ResultLog
    done: dict[str, dict]  # record id -> record
    progress: JobProgress


@contextlib.contextmanager
def open_batch_job(
    input_path: str, output_path: str, options: dict[str, Any], recompute_changed: bool = False
) -> Iterator[BatchJob]:
    """Lock the output, check its results against this job's fingerprint (`options` and the
    input lines, kept in `<output>.job.json`; see `phloem.entrypoints.job_guard`) and open it.

    Raises:
        JobError: the output is locked by another job, holds results of another job or of an
            earlier input or options (unless `recompute_changed`); inside the block, an
            interrupt or a full disk.
    """
    from phloem.entrypoints.job_guard import Fingerprint, JobProgress, OutputLock, resume_results

    lines = read_lines(input_path)
    custom_ids = {n: _custom_id_of(raw) for n, raw in lines}
    expected = {record_id(n): custom_id for n, custom_id in custom_ids.items()}

    def key_of(record: dict):
        rid = record.get("id")
        if rid in expected and record.get("custom_id") == expected[rid] and "response" in record:
            return rid
        return None

    with OutputLock(output_path), JobProgress(output_path, len(lines)) as progress:
        fingerprint = Fingerprint(output_path + ".job.json", options, dict(lines))
        log, done = resume_results(
            output_path, key_of, _line_of_record_id, fingerprint, recompute_changed, True
        )
        progress.num_saved = len(done)
        try:
            yield BatchJob(lines, custom_ids, log, done, progress)
        finally:
            log.close()


def _frontend(llm, model_name: str):
    """The request preparation of the server (`openai.serving.Frontend`) over this LLM, with the
    server's character bound on prompts."""
    from phloem.entrypoints.openai.limits import max_prompt_chars
    from phloem.entrypoints.openai.serving import Frontend

    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    return Frontend(
        tokenizer,
        engine.max_model_len,
        engine.validate_prompt,
        model_name,
        max_prompt_chars=max_prompt_chars(tokenizer, engine.max_model_len),
    )


def _line_of_record_id(rid: str) -> str:
    return rid.removeprefix("batch_req_")


def run_batch(
    llm,
    input_path: str,
    output_path: str,
    model_name: str,
    use_tqdm: bool = True,
    job: BatchJob | None = None,
):
    """Run (or resume) the job; returns counts {"num_lines", "num_resumed", "num_failed", ...}.

    `job`: opened before the model loaded, as `cmd_run_batch` does; None opens one here whose
    fingerprint holds the input lines and `model_name` only (not the model).
    """
    if job is None:
        options = {"--served-model-name": model_name}
        with open_batch_job(input_path, output_path, options) as job:
            return run_batch(llm, input_path, output_path, model_name, use_tqdm, job)
    engine = llm.llm_engine
    front = _frontend(llm, model_name)
    lines, done, log = job.lines, job.done, job.log
    start = time.monotonic()
    first_line: dict[str, int] = {}
    for n, custom_id in job.custom_ids.items():
        if custom_id is not None:
            first_line.setdefault(custom_id, n)
    failed: list[BatchLine] = []
    good: list[BatchLine] = []
    owners: list[tuple[BatchLine, int]] = []  # (line, prompt index) of each queued prompt

    def build():  # runs with collection paused (LLM.run_batch)
        for n, raw in lines:
            if record_id(n) not in done:
                b = parse_batch_line(front, raw, n, first_line, engine.validate_params)
                (good if b.error is None else failed).append(b)
        encoded, params = [], []
        for b in good:
            for i, (text, ids) in enumerate(b.prep.prompts):
                encoded.append((text, ids))  # validate_prompt ran in the prepare_* functions
                params.append(b.prep.params[i])
                owners.append((b, i))
        for b in failed:  # written before the first result
            log.append(error_record(b))
            job.progress.num_saved += 1
        return encoded, params

    created = int(time.time())
    for k, output in llm.run_batch(build, use_tqdm):
        b, i = owners[k]
        b.outputs[i] = output
        if len(b.outputs) == len(b.prep.prompts):
            log.append(success_record(front, b, created))
            job.progress.num_saved += 1
    log.close()
    return {
        "num_lines": len(lines),
        "num_resumed": len(done),
        "num_failed": len(failed),
        "num_completed": len(good),
        "wall_s": time.monotonic() - start,
    }


def register(subparsers) -> None:
    """Add `phloem run-batch` to the CLI."""
    from phloem.entrypoints.cli import add_engine_args
    from phloem.entrypoints.job_guard import EXIT_CODES_HELP

    p = subparsers.add_parser(
        "run-batch",
        help="run an OpenAI Batch API JSONL file (crash-safe, resumable)",
        epilog=EXIT_CODES_HELP,
    )
    p.add_argument("--input", "-i", required=True, help="OpenAI batch input JSONL")
    p.add_argument(
        "--output",
        "-o",
        required=True,
        help="OpenAI batch output JSONL: results are appended as they finish; a rerun resumes it",
    )
    p.add_argument("--served-model-name", default=None, help="model name in response bodies")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--recompute-changed",
        action="store_true",
        help="resume even though input lines or options changed: recompute the changed lines "
        "(every line when an option changed) instead of refusing",
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    """Exit codes as `phloem generate`'s: 0 done; 1 a data-parallel replica failed; 2 the job
    cannot run as given (nothing written); 74 out of disk space, 75 the output is locked by
    another job, 130 interrupted, 143 terminated (finished lines are kept: rerun the same
    command to finish)."""
    from phloem.entrypoints.cli import build_llm
    from phloem.entrypoints.generate import replica_failures
    from phloem.entrypoints.job_guard import check_paths, job_options, run_job
    from phloem.entrypoints.openai.serving import default_model_name

    def job() -> dict:
        check_paths(args.input, args.output)
        name = args.served_model_name or default_model_name(args.model)
        options = job_options(args, **{"--served-model-name": name})
        with (
            open_batch_job(args.input, args.output, options, args.recompute_changed) as opened,
            replica_failures(opened.progress),
            build_llm(args) as llm,  # stops data-parallel replicas when the job ends
        ):
            return run_batch(llm, args.input, args.output, name, not args.no_progress, opened)

    def report(counts: dict) -> None:
        print(
            f"run-batch: {counts['num_lines']} requests: {counts['num_resumed']} already done, "
            f"{counts['num_completed']} completed, {counts['num_failed']} failed "
            f"({counts['wall_s']:.1f} s) -> {args.output}",
            file=sys.stderr,
        )

    return run_job(job, report)
