"""`phloem generate`: the offline batch job, JSONL in, JSONL out (one line per input line).

Every line is validated on its own: a bad line yields `{"id", "error"}` and the rest of the job
runs. Good lines are handed to `LLM` as one batch, so the engine sees the whole job at once.

Crash-safe and resumable: each finished line is appended and flushed to `<output>.partial`
(`phloem.entrypoints.resumable.ResultLog`) as it finishes; the ordered output file is written
from those records at the end (atomically) and the partial file removed. Rerunning the same
command after a crash (even `kill -9` mid-write) drops a torn last record, skips the lines
already done and runs the rest. The partial file starts with a fingerprint of the input lines
and sampling defaults; a partial file of another job is discarded.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from phloem.engine.gc_control import gc_frozen, gc_paused
from phloem.sampling_params import SamplingParams

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
    """
    line_id = str(line_number)
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        return ParsedLine(
            line_id, error=f"line {line_number}: invalid JSON: {e.msg} (column {e.colno})"
        )
    if not isinstance(record, dict):
        return ParsedLine(line_id, error=f"line {line_number}: expected a JSON object")
    if "id" in record:
        if not isinstance(record["id"], (str, int)) or isinstance(record["id"], bool):
            return ParsedLine(line_id, error="field 'id' must be a string")
        line_id = str(record["id"])
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
    except ValueError as e:
        return ParsedLine(line_id, error=str(e))
    except Exception as e:  # a tokenizer or template failure is this line's problem only
        return ParsedLine(line_id, error=f"{type(e).__name__}: {e}")
    return ParsedLine(line_id, text, ids, params)


def output_record(parsed: ParsedLine, output) -> dict[str, Any]:
    """The output line of a finished request (a list under "outputs" when n > 1)."""
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


def run_generate(llm, input_path: str, output_path: str, defaults: dict[str, Any], use_tqdm=True):
    """Run the job; returns the summary dict (see `phloem.engine.metrics.summarize`)."""
    from phloem.engine.metrics import summarize
    from phloem.entrypoints.resumable import write_atomically

    start = time.monotonic()
    with open(input_path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    engine = llm.llm_engine
    computed_before = engine.num_computed_prompt_tokens
    outputs = []
    with contextlib.ExitStack() as frozen:
        with gc_paused() as gc_enabled:  # building the batch: see phloem/engine/gc_control.py
            parsed = [parse_line(llm, raw, i + 1, defaults) for i, raw in enumerate(lines)]
            good = [p for p in parsed if p.error is None]
            log, done = _open_partial(output_path + ".partial", lines, parsed, defaults)
            todo = [i for i, p in enumerate(parsed) if p.error is None and i not in done]
            if len(done) > 1:
                logger.info("resuming: %d lines already done, %d to run", len(done) - 1, len(todo))
            request_ids = llm.add_requests(
                [(parsed[i].prompt_text, parsed[i].prompt_token_ids) for i in todo],
                [parsed[i].sampling_params for i in todo],
                validated=True,  # parse_line ran validate_prompt on every good line
            )
            if gc_enabled:  # frozen before collection resumes, for the whole run
                frozen.enter_context(gc_frozen())
        line_of = dict(zip(request_ids, todo))
        try:
            for output in llm.iter_outputs(request_ids, use_tqdm=use_tqdm):
                i = line_of[output.request_id]
                done[i] = {"line": i, "record": output_record(parsed[i], output)}
                log.append(done[i])
                outputs.append(output)
        finally:
            log.close()
    write_atomically(
        output_path,
        [
            json.dumps({"id": p.id, "error": p.error} if p.error else done[i]["record"],
                       ensure_ascii=False)
            for i, p in enumerate(parsed)
        ],
    )  # fmt: skip
    os.remove(log.path)
    plan = llm.last_plan
    return summarize(
        outputs,
        time.monotonic() - start,
        num_failed_requests=len(parsed) - len(good),
        num_computed_prompt_tokens=engine.num_computed_prompt_tokens - computed_before,
        planned_reuse_ratio=plan.planned_reuse_ratio if plan is not None else 0.0,
    )


def _open_partial(path: str, lines: list[str], parsed: list[ParsedLine], defaults: dict):
    """The job's partial-results log and its finished records {line index: record} plus the
    header under the key "header". Discards a partial file of a different job."""
    from phloem.entrypoints.resumable import ResultLog

    digest = hashlib.sha256(json.dumps([lines, defaults], sort_keys=True).encode()).hexdigest()
    header = {"phloem_generate_partial": 1, "fingerprint": digest}

    def key_of(record: dict):
        if record == header:
            return "header"
        i, inner = record.get("line"), record.get("record")
        if isinstance(i, int) and 0 <= i < len(parsed) and isinstance(inner, dict):
            if parsed[i].error is None and inner.get("id") == parsed[i].id:
                return i
        return None

    if os.path.exists(path):
        with open(path, "rb") as f:
            first = f.readline()
        try:
            same_job = json.loads(first) == header
        except ValueError:
            same_job = False
        if not same_job:
            logger.warning("%s belongs to another job (or is torn at its start): discarded", path)
            os.remove(path)
    log = ResultLog(path, key_of)
    done = log.load()
    if "header" not in done:
        log.append(header)
        done["header"] = header
    return log, done


def run_plan_only(llm, input_path: str, defaults: dict[str, Any]) -> str:
    """The global prefix plan of a job, as text, without running the model."""
    with open(input_path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    parsed = [parse_line(llm, raw, i + 1, defaults) for i, raw in enumerate(lines)]
    good = [p for p in parsed if p.error is None]
    plan = llm.plan([p.prompt_token_ids for p in good], [p.sampling_params for p in good])
    failed = (
        f"\n  {len(parsed) - len(good)} lines failed validation" if len(good) < len(parsed) else ""
    )
    return plan.describe() + failed


def register(subparsers) -> None:
    """Add `phloem generate` to the CLI."""
    from phloem.entrypoints.cli import add_engine_args, add_sampling_args

    gen = subparsers.add_parser("generate", help="run an offline JSONL batch job")
    gen.add_argument("--input", "-i", required=True, help="JSONL: {id?, prompt | messages, ...}")
    gen.add_argument("--output", "-o", required=True, help="JSONL, one line per input line")
    gen.add_argument("--summary-json", default=None, help="write the job summary here")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.add_argument(
        "--plan-only",
        action="store_true",
        help="print the global prefix-sharing plan and exit without running the model",
    )
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from phloem.engine.metrics import format_summary
    from phloem.entrypoints.cli import build_llm, sampling_defaults

    defaults = sampling_defaults(args)
    try:
        SamplingParams.from_dict(defaults)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = build_llm(args)
    if args.plan_only:
        print(run_plan_only(llm, args.input, defaults))
        return 0
    summary = run_generate(llm, args.input, args.output, defaults, use_tqdm=not args.no_progress)
    print(format_summary(summary), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0
