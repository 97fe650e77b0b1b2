"""Iteration-level scheduling: which requests compute how many tokens this step.

One loop, no prefill or decode phases (vLLM v1's contract): every request has
`num_tokens - num_computed_tokens` tokens still to compute, and each step hands out at most
`max_num_batched_tokens` of them, running requests first (decode tokens and the rest of their
prompt chunks), then waiting requests in arrival order (continuous batching: Yu et al., Orca,
OSDI 2022; chunked prefill mixed with decode: Agrawal et al., Sarathi-Serve, arXiv 2308.16369).
When blocks run out, idle groups' held prefixes are released first (a `SharedPrefix` with no
running member: recomputed later), then the most recently admitted running request is
preempted: its blocks are freed and it recomputes from scratch later, with its outputs kept
(recompute preemption, PagedAttention §4.5).

One step path (vLLM v1's `_update_after_schedule`): `schedule()` advances `num_computed_tokens`
of what it schedules and counts each token the step will sample as pending
(`Request.num_pending_tokens`) until `update_from_output` appends it. Synchronous engines update
right after each step; async scheduling calls `schedule()` for step N+1 before the update of N:

    schedule(N) -> [device runs N] -> schedule(N+1) -> [device runs N+1] -> update(N) -> ...

A request whose pending tokens already reach its `max_tokens` (or the context) is not scheduled
again; one that stops on a sampled token (EOS, stop ids) gets one wasted token in the step
after, which its update skips.

Failure isolation: an exception while admitting one waiting request, or while applying the stop
rules to one request's new token, fails that request alone (FINISHED_ERROR, its blocks freed,
the message in `failed_requests` for the engine to report); the step goes on for the others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from phloem.config import SchedulerConfig
from phloem.core.admission import Admission
from phloem.core.arrival_groups import ArrivalGroups
from phloem.core.draft_tokens import NO_DRAFTS, apply_verified, take_drafts
from phloem.core.kv_manager import KVManager
from phloem.core.prefill_cap import PrefillCap
from phloem.core.prefix_groups import PrefixGroups
from phloem.core.request import Request, RequestStatus, table_prefix
from phloem.core.scheduler_output import (
    NO_BLOCKS,
    NewSequenceData,
    ScheduledSequence,
    SchedulerOutput,
)
from phloem.core.stop_checker import check_stop

NO_TABLE: list[int] = []  # the table of a request without blocks (never mutated)
NO_ACCEPTED: Mapping[str, int] = {}  # a step without drafts (never mutated)

__all__ = ["NewSequenceData", "ScheduledSequence", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Continuous batching with chunked prefill and recompute preemption.

    Args:
        config: token budget, sequence limit, context length.
        kv_manager: the block tables; the scheduler is the only caller that allocates or frees.
        prefix_groups: the runtime prefix groups' lifecycle (default: `PrefixGroups` over
            `kv_manager` with `Admission(config, kv_manager)`); tests pass their own.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVManager,
        prefix_groups: PrefixGroups | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.prefix_groups = prefix_groups or PrefixGroups(
            kv_manager, Admission(config, kv_manager)
        )
        self.admission = self.prefix_groups.admission
        self.prefill_cap = PrefillCap()  # the prompt tokens of a step while streams run
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        # id(output) -> (output, its requests in row order) for outputs not yet updated: the
        # update applies tokens to these objects (a finished sequence's id may be reused)
        self._unapplied: dict[int, tuple[SchedulerOutput, list[Request]]] = {}
        self.num_preemptions = 0  # since start, all requests
        self.num_computed_prompt_tokens = 0  # prompt tokens the model ran (updated steps)
        self.num_reused_prompt_tokens = 0  # prompt tokens admitted requests started with
        # online prefix groups of requests arriving together (radix cache on, not planned)
        self.arrival_groups: ArrivalGroups | None = None
        if kv_manager.prefix_cache is not None and config.online_prefix_grouping:
            self.arrival_groups = ArrivalGroups(kv_manager)
        # request id -> error message of requests failed alone since the engine last took them
        self.failed_requests: dict[str, str] = {}
        # seq id -> tokens the last update appended, for the requests that verified drafts
        # (every other updated request got exactly one)
        self.num_new_tokens: dict[str, int] = {}
        # False for a waiting request that may not start yet (its grammar still compiling:
        # vLLM's WAITING_FOR_FSM); it keeps its place while later ones are admitted
        self.admission_gate: Callable[[Request], bool] | None = None

    # -- queue management -------------------------------------------------------------------

    def add_request(self, request: Request, planned: bool = False) -> None:
        """Queue a new request (WAITING). Unless `planned` (its batch was planned for prefix
        sharing as a whole: the offline path) or already in a group, it is grouped with the
        requests arriving in the same step (`ArrivalGroups`). Raises ValueError on a duplicate
        id or a prompt that leaves no room to generate within the context."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context holds "
                f"{self.config.max_model_len} (max_model_len), leaving no room to generate"
            )
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt must contain at least one token")
        capacity = self.kv.num_blocks * self.kv.block_size
        if request.num_prompt_tokens >= capacity:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the whole KV cache holds "
                f"{capacity} tokens"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.arrival_groups is not None and not planned and request.shared_prefix is None:
            self.arrival_groups.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests as aborted and free their blocks (unknown ids are ignored)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens. Mutates block tables, the queues, request status, and the
        scheduled requests' `num_computed_tokens` and `num_pending_tokens` (the step counts as
        computed from here on). New arrivals are first grouped by shared prefix."""
        if self.arrival_groups is not None and self.arrival_groups.has_arrivals:
            self.arrival_groups.plan()
        output = SchedulerOutput(finished_seq_ids=self._finished_ids)
        self._finished_ids = []
        requests: list[Request] = []  # the scheduled requests, in row order
        budget, prefill_left = self._schedule_running(
            output,
            requests,
            self.config.max_num_batched_tokens,
            self.prefill_cap(self.config, self.running, self.waiting),
        )
        num_running_scheduled = len(requests)
        if not output.preempted_seq_ids:
            budget = self._admit_capped(output, requests, budget, prefill_left)
            if (
                not output.scheduled
                and self.waiting
                and self.prefix_groups.release_idle(self.running)
            ):
                budget = self._admit_capped(output, requests, budget, prefill_left)
        self._update_after_schedule(output, requests, num_running_scheduled)
        return output

    def _admit_capped(
        self, output: SchedulerOutput, requests: list[Request], budget: int, prefill: int | None
    ) -> int:
        """`_admit_waiting` within `prefill` (None: all) of `budget`; returns what is left."""
        allowed = budget if prefill is None else min(budget, prefill)
        return budget - allowed + self._admit_waiting(output, requests, allowed)

    def _schedule_running(
        self, output: SchedulerOutput, requests: list[Request], budget: int, prefill: int | None
    ) -> tuple[int, int | None]:
        """Schedule the running requests in admission order under `budget` tokens (appended to
        `output.scheduled` and `requests`; each counts as computed at once); returns the budget
        and prefill tokens left. Chunks of more than one token take at most `prefill` (None: no
        cap, `prefill_cap`), never the token each later running request may need. Calls
        nothing per request in the common case (a decode in its block, no drafts)."""
        kv, max_model_len = self.kv, self.config.max_model_len
        block_size, tables = kv.block_size, kv.block_tables
        running, index = self.running, 0  # preemption removes from this same list
        while index < len(running) and budget > 0:
            request = running[index]
            index += 1
            num_output, pending = len(request.output_token_ids), request.num_pending_tokens
            num_tokens = request.num_prompt_tokens + num_output + pending
            if pending and (
                num_tokens >= max_model_len
                or num_output + pending >= (request.sampling_params.max_tokens or num_tokens + 1)
            ):  # (max_tokens >= 1: `SamplingParams.validate`)
                continue  # its pending token ends it (length): computing another would be waste
            num_computed = request.num_computed_tokens
            num_new = min(num_tokens - num_computed, budget)
            if num_new > 1 and prefill is not None:  # a prompt chunk while streams decode
                num_new = min(num_new, prefill, budget - (len(running) - index))
                prefill -= max(num_new, 0)
            if num_new <= 0:
                continue
            drafts, guess = NO_DRAFTS, -1
            if request.draft_token_ids:  # speculative decoding: verify them in this step
                drafts, guess = take_drafts(request, num_new, budget - len(running) + index,
                                            max_model_len)  # fmt: skip
                num_new += len(drafts)
            block_ids = tables.get(request.request_id, NO_TABLE)
            if len(block_ids) * block_size < num_computed + num_new:
                if not kv.allocate_slots(request, num_new) and not self._preempt_until_allocated(
                    request, num_new, output
                ):
                    break  # the request itself was preempted: nothing later can fit either
                block_ids = kv.block_ids(request.request_id)  # a first block creates the table
            new_blocks: Sequence[int] = NO_BLOCKS
            if len(block_ids) > request.num_sent_blocks:
                new_blocks = block_ids[request.num_sent_blocks :]
                request.num_sent_blocks = len(block_ids)
            sample = num_computed + num_new >= num_tokens  # (> with drafts)
            prefix_len, group_id, group = 0, -1, request.shared_prefix
            if group is not None:
                cached = request.table_prefix
                if cached is None or cached[0] is not group.block_ids:
                    cached = request.table_prefix = table_prefix(group, block_ids)
                prefix_len, group_id = cached[1], cached[2]
            # every field positional: keywords double the construction's cost (~0.1 us a row)
            output.scheduled.append(ScheduledSequence(request.request_id, num_computed, num_new,
                sample, new_blocks, prefix_len, group_id, None, drafts, guess))  # fmt: skip
            request.num_computed_tokens = num_computed + num_new
            if sample:  # a verify row's drafts count as pending until its update
                request.num_pending_tokens = pending + 1 + len(drafts)
            requests.append(request)
            budget -= num_new
        return budget, prefill

    def _update_after_schedule(
        self, output: SchedulerOutput, requests: list[Request], start: int
    ) -> None:
        """The step is as good as computed for what follows (its update may come later, vLLM
        v1's `_update_after_schedule`): advance `num_computed_tokens` and count each sample as
        pending for the admitted requests (rows `start:`; the running loop did it for its own
        rows as it went), and remember the scheduled requests for `update_from_output`."""
        for scheduled, request in zip(output.scheduled[start:], requests[start:]):
            request.num_computed_tokens += scheduled.num_tokens
            if scheduled.sample:
                request.num_pending_tokens += 1
        if requests:
            self._unapplied[id(output)] = (output, requests)

    def _preempt_until_allocated(
        self, request: Request, num_new: int, out: SchedulerOutput
    ) -> bool:
        """`allocate_slots(request, num_new)` just failed: release idle groups' held prefixes,
        then preempt the most recently admitted running requests, retrying after each, until it
        succeeds. A preempted request's group may become idle, so its prefix goes before the
        next victim. Returns False (allocating nothing) when `request` itself had to be
        preempted.

        Idle prefixes go first because they are only an optimization: they can be recomputed,
        while holding them could leave the only running request short of blocks forever (it
        would preempt itself, be readmitted onto its group's prefix and run short again).
        """
        while True:
            if self.prefix_groups.release_idle_until_allocated(
                request, num_new, self.running, self.waiting
            ):
                return True
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted_seq_ids.append(victim.request_id)
            if victim is request:
                return False
            if self.kv.allocate_slots(request, num_new):
                return True

    def _admit_waiting(self, output: SchedulerOutput, requests: list[Request], budget: int) -> int:
        """Admit waiting requests in queue order while the budget, the sequence limit and KV
        memory allow. With memory-centric admission, a request is admitted only if the blocks
        it will need to finish (prompt + max_tokens, net of shared prefix blocks) fit beside
        what the running requests still need (BatchLLM §4.3)."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return budget
        skipped: list[Request] = []
        reserved = self.admission.reserved_blocks(self.running, self.waiting)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            try:
                admitted = self._admit(output, requests, request, budget, reserved, skipped)
            except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone
                self.fail_request(request, e)
                continue
            if admitted is None:
                break
            budget, reserved = admitted
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _admit(
        self,
        output: SchedulerOutput,
        requests: list[Request],
        request: Request,
        budget: int,
        reserved: int,
        skipped: list[Request],
    ) -> tuple[int, int] | None:
        """Admit one request taken from the head of the queue, if it fits: returns the budget
        and reserved blocks left, or None (the request is back at the head) to stop admitting.
        A request waiting for its group's prefix or held by `admission_gate` goes to
        `skipped`."""
        if self.admission_gate is not None and not self.admission_gate(request):
            skipped.append(request)
            return budget, reserved
        groups = self.prefix_groups
        admissible = groups.held_prefix_admissible(request, budget, reserved, self.running)
        if admissible is False:
            self.waiting.appendleft(request)  # not attached: nothing to undo
            return None
        if not groups.attach(request):
            skipped.append(request)  # its shared prefix is being computed: wait for it
            return budget, reserved
        num_computed = request.num_computed_tokens
        if admissible is None:
            admissible = self.admission.admissible(
                request, budget, reserved, num_computed, self.running
            )
        num_new = min(request.num_tokens - num_computed, budget)
        if not admissible or not self.kv.allocate_slots(request, num_new):
            groups.detach(request)
            self.waiting.appendleft(request)
            return None
        if self.config.memory_centric_admission:
            reserved += self.admission.blocks_to_finish((request,))
        self.num_reused_prompt_tokens += min(num_computed, request.num_prompt_tokens)
        groups.on_admitted(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._add(output, request, num_new)
        requests.append(request)
        return budget - num_new, reserved

    def _add(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        """Schedule a just admitted request: sent in full (the worker has no state for it)."""
        num_computed = request.num_computed_tokens
        block_ids = self.kv.block_ids(request.request_id)
        request.num_sent_blocks = len(block_ids)
        scheduled = ScheduledSequence(
            request.request_id,
            num_computed,
            num_new,
            num_computed + num_new == request.num_tokens,
            list(block_ids),
            new_sequence=NewSequenceData(
                request.prompt_token_ids, list(request.output_token_ids), request.sampling_params
            ),
        )
        if request.shared_prefix is not None:
            request.table_prefix = table_prefix(request.shared_prefix, block_ids)
            scheduled.prefix_len, scheduled.group_id = request.table_prefix[1:]
        output.scheduled.append(scheduled)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.prefix_groups.on_preempted(request)
        self.kv.free(request, cache=True)
        request.status = RequestStatus.PREEMPTED
        request.num_sent_blocks = 0
        request.table_prefix = None
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the model ran ----------------------------------------------------------------

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        num_accepted_drafts: Mapping[str, int] = NO_ACCEPTED,
    ) -> list[Request]:
        """Apply a step the worker ran (each output of `schedule` once, in order): count its
        prompt tokens, append each sampled token (a pending one stops being pending) to the
        request objects that were scheduled, and apply the token stop rules. A request that
        verified drafts gets its first `num_accepted_drafts[seq id]` drafts, then its sampled
        token, the stop rules after each (a stop drops the rest), and its rejected drafts'
        KV rolled back (`draft_tokens.apply_verified`); `num_new_tokens` says how many it got. Returns
        the requests that got new tokens this step (finished ones included).

        Raises:
            KeyError: if a request that had to sample is missing from `sampled_token_ids`.
        """
        updated: list[Request] = []
        self.num_new_tokens = {}
        entry = self._unapplied.pop(id(output), None)
        if entry is None:
            return updated  # an empty step, or one dropped by `forget_unapplied`
        max_model_len = self.config.max_model_len
        is_running = RequestStatus.RUNNING
        for scheduled, request in zip(output.scheduled, entry[1]):
            start = scheduled.num_computed_tokens
            prompt_chunk = start < request.num_prompt_tokens
            if prompt_chunk:
                end = min(start + scheduled.num_tokens, request.num_prompt_tokens)
                self.num_computed_prompt_tokens += end - start
            running = request.status is is_running  # async: may be preempted since
            if (not running and request.is_finished) or request.void_next_row:
                request.void_next_row = False  # (void: stacked on rejected drafts, draft_tokens)
                continue  # aborted (or stopped, async) meanwhile
            if running:
                group = request.shared_prefix
                if group is not None and group.leader is request:  # (most members: no call)
                    self.prefix_groups.on_computed(request)
                if prompt_chunk:
                    self.kv.cache_prompt_blocks(request)
            if not scheduled.sample:
                continue
            token_id = sampled_token_ids[request.request_id]
            try:
                if scheduled.draft_token_ids:
                    status, self.num_new_tokens[request.request_id] = apply_verified(
                        request, scheduled, token_id, num_accepted_drafts, self.kv, max_model_len
                    )
                else:  # `Request.append_output_token`, inline: once per row per step
                    request.output_token_ids.append(token_id)
                    if request.num_pending_tokens:
                        request.num_pending_tokens -= 1
                    status = check_stop(request, max_model_len)
            except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone
                self.fail_request(request, e)
                continue
            if status is not None:
                self._finish(request, status)
            updated.append(request)
        return updated

    def forget_unapplied(self) -> None:
        """Drop the outputs not yet passed to `update_from_output` (after a failed step, whose
        requests the engine aborts)."""
        self._unapplied.clear()

    def finish_request(self, request: Request, status: RequestStatus, stop_reason=None) -> None:
        """Finish a request for a reason decided outside (a stop string). Frees its blocks. A
        request that already finished by length or EOS in the same update (its blocks freed
        already) takes the outside reason instead; an aborted one stays aborted."""
        if not request.is_finished:
            request.stop_reason = stop_reason
            self._finish(request, status)
        elif request.status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            request.status, request.stop_reason = status, stop_reason

    def fail_request(self, request: Request, error: BaseException | str) -> None:
        """Finish one request as FINISHED_ERROR (freeing its blocks) and record why in
        `failed_requests`, for a fault of its own: the rest of the step goes on. A request that
        already finished keeps its blocks freed and takes the error status."""
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.failed_requests.setdefault(request.request_id, message)
        if request.is_finished:
            request.status = RequestStatus.FINISHED_ERROR
            return
        if request.status is RequestStatus.RUNNING and request not in self.running:
            request.status = RequestStatus.WAITING  # failed between its status and the list
        self._finish(request, RequestStatus.FINISHED_ERROR)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request, cache=True)
        self.prefix_groups.on_finished(request)
        if self.arrival_groups is not None:
            self.arrival_groups.forget(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def check_integrity(self) -> None:
        """Assert the block pool and the queues agree (call after any step in tests)."""
        live = list(self.running) + list(self.waiting)
        assert len(live) == len(self.requests), "queues and request table disagree"
        assert all(r.status is RequestStatus.RUNNING for r in self.running)
        assert all(
            r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting
        )
        self.kv.check_integrity(live)
