"""The engine's per-token work after a step's update: log-probs, incremental text and stop
strings of each sequence's new tokens, and the prompts that step touched and may have finished
(`LLMEngine._process_outputs` calls it once a step)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from phloem.core.request import Request, RequestStatus
from phloem.core.scheduler import Scheduler
from phloem.engine.prompt_entry import PromptEntry, SequenceEntry

if TYPE_CHECKING:
    from phloem.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger("phloem.engine.llm_engine")


def apply_tokens(
    updated: list[Request],
    runner_output: ModelRunnerOutput,
    sequences: dict[str, SequenceEntry],
    prompts: dict[str, PromptEntry],
    scheduler: Scheduler,
    failed_prompts: set[str],
    now: float,
) -> tuple[dict[str, PromptEntry], set[str]]:
    """Log-probs, text and stop strings (not in DELTA mode) of each updated sequence's new
    tokens (one, or a verify step's run: `add_run`); returns the touched prompts and those with a
    sequence that finished. A sequence whose text or log-probs raise fails its prompt (added to
    `failed_prompts`); one that hits a stop string finishes "stop". Mutates the requests'
    status (through `scheduler`), the entries' metrics and `failed_prompts`."""
    touched: dict[str, PromptEntry] = {}
    maybe_done: set[str] = set()  # prompts with a sequence that finished this step
    runs = scheduler.num_new_tokens  # requests that got several tokens (drafts accepted)
    for request in updated:
        seq = sequences[request.request_id]
        if failed_prompts and seq.prompt_id in failed_prompts:
            continue
        entry = prompts[seq.prompt_id]
        finished = request.is_finished
        detok = seq.detokenizer
        stop = None
        try:
            if seq.logprobs is not None or seq.cumulative_logprob is not None:
                seq.record_logprobs(runner_output, request.output_token_ids[-1])
            if detok is not None:
                if runs and request.request_id in runs:
                    stop = add_run(request, detok, runs[request.request_id])
                else:
                    stop = detok.add_token(request.output_token_ids[-1])
                if stop is None and finished:
                    stop = detok.flush()
        except Exception as e:  # noqa: BLE001 - this sequence's fault: its prompt fails alone
            logger.exception("request %s: detokenizing failed", entry.request_id)
            scheduler.fail_request(request, e)
            failed_prompts.add(entry.request_id)
            touched.pop(entry.request_id, None)
            continue
        if stop is not None:  # wins over a length or EOS finish in this same update
            scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop)
            finished = True
        metrics = entry.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        touched[entry.request_id] = entry
        if finished:
            maybe_done.add(entry.request_id)
    return touched, maybe_done


def add_run(request: Request, detokenizer, num_tokens: int) -> str | None:
    """Feed a verify step's `num_tokens` new outputs of `request` (speculative decoding) to its
    detokenizer one at a time; at a stop string, drop the outputs after the token that completed
    it (without speculation they would never have been sampled) and return the stop string, else
    None. Mutates the request's `output_token_ids`."""
    outputs = request.output_token_ids
    first = len(outputs) - num_tokens
    hit = detokenizer.add_tokens(outputs[first:])
    if hit is None:
        return None
    i, stop = hit
    del outputs[first + i + 1 :]
    return stop
