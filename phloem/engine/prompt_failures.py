"""The prompts of sequences that failed alone in a step: each finishes with all its sequences
(`LLMEngine._fail_prompts`, the engine's failure isolation)."""

from __future__ import annotations

import logging
import time

from phloem.core.request import RequestStatus
from phloem.core.scheduler import Scheduler
from phloem.engine.prompt_entry import PromptEntry, SequenceEntry

logger = logging.getLogger("phloem.engine.llm_engine")  # where these errors were logged before


def fail_prompts(
    failures: dict[str, str],
    sequences: dict[str, SequenceEntry],
    prompts: dict[str, PromptEntry],
    scheduler: Scheduler,
) -> list[PromptEntry]:
    """Finish the prompts of the failed sequences ({seq id: reason}): every unfinished sibling
    of a failed sequence finishes with it (FINISHED_ERROR, blocks freed through `scheduler`);
    each prompt is marked finished with `error` holding its first reason. Returns the prompts,
    once each, for the engine to forget and report. Ids of prompts already gone (finished,
    aborted, failed in an earlier step) are ignored. Mutates the entries and the scheduler."""
    now = time.monotonic()
    entries: dict[str, PromptEntry] = {}
    for seq_id, message in failures.items():
        seq = sequences.get(seq_id)
        entry = prompts.get(seq.prompt_id) if seq is not None else None
        if entry is None:
            continue
        if entry.error is None:
            entry.error = message
            logger.error("request %s failed: %s", entry.request_id, message)
        entries[entry.request_id] = entry
    for entry in entries.values():
        for seq in entry.sequences:
            if not seq.request.is_finished:
                scheduler.finish_request(seq.request, RequestStatus.FINISHED_ERROR)
        entry.finished = True
        entry.metrics.finished_time = now
    return list(entries.values())
