"""Data-parallel replicas of the offline engine under one global prefix plan (issue 16).

`LLM(data_parallel_size=N)` with N > 1 holds a `DataParallelEngine` instead of an `LLMEngine`:

```
parent (tokenizer + model config, no weights)          replica r (spawned process)
  tokenize, validate ──► ONE PrefixPlan of the batch      LLM(**args, data_parallel_size=1)
  group_costs_s ──► assign_groups (LPT) ──► share r ────► run_batch(share): plans its share
  merge: (index, output) in completion order ◄── pipe ◄── (index, output) as each finishes
```

A group is never split, so each shared prefix is computed once in the whole cluster and each
replica's own planner finds exactly the groups it was dealt. Groups are dealt by
longest-processing-time-first over their roofline cost (Graham 1969; the cost model and the
partition are `core.replica_partition`, after BatchLLM arXiv 2412.03594 §4): the costs are
taken at nominal ceilings, of which only the ratios matter.

Processes: the `spawn` context; replica r runs on CUDA device r (CUDA_VISIBLE_DEVICES set to
that one device) when the engine's device is CUDA, else on the CPU with the parent's torch
threads divided among the replicas. Each replica talks to the parent over one duplex pipe:
parent -> replica ("batch", indices, encoded, params) | ("abort",) | ("stop",); replica ->
parent ("ready", info) | ("output", index, RequestOutput) | ("done", stats) | ("error", text).
The parent waits on the pipes and the processes' sentinels together, so a replica that dies
(killed, or crashed) is noticed at once and raised as `ReplicaError` naming it; a batch's
outputs that arrived before are yielded first (a resumable job keeps them, and its rerun
runs the rest). A dead or unresponsive replica is started again at the next batch.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from phloem.core.prefix_planner import PrefixPlan
from phloem.core.replica_partition import ReplicaAssignment, assign_groups, group_costs_s
from phloem.engine.input_checks import check_params, check_prompt
from phloem.engine.replica_process import Replica, ReplicaError, receive, shutdown
from phloem.engine_args import EngineArgs
from phloem.outputs import RequestOutput
from phloem.sampling_params import SamplingParams

# Nominal ceilings the plan's group costs are expressed against (an H100's dense bf16 FLOP/s and
# HBM bytes/s); the LPT deal depends only on the costs' ratios.
NOMINAL_FLOPS_PER_S = 989e12
NOMINAL_BYTES_PER_S = 3.35e12
START_TIMEOUT_S = 900.0  # a replica must load its model within this [s]
ABORT_TIMEOUT_S = 30.0  # after an early end, a busy replica must stop within this [s]


def replica_placement(
    device: str, num_replicas: int, num_cuda_devices: int, visible: str | None
) -> list[dict[str, str]]:
    """Where each replica runs: per replica, the environment it starts with (`PHLOEM_DEVICE`
    "cuda" or "cpu", and CUDA_VISIBLE_DEVICES for one device on CUDA).

    Args:
        device: the engine's device setting ("auto", "cuda", "cpu").
        num_cuda_devices: CUDA devices visible to the parent; visible: its CUDA_VISIBLE_DEVICES.
    Raises:
        ValueError: naming both numbers, when `num_replicas` exceeds the CUDA devices on CUDA,
            or when device is "cuda" and there is none.
    """
    on_cuda = device == "cuda" or (device == "auto" and num_cuda_devices > 0)
    if not on_cuda:
        return [{"PHLOEM_DEVICE": "cpu"} for _ in range(num_replicas)]
    if num_replicas > num_cuda_devices:
        raise ValueError(
            f"data_parallel_size={num_replicas} exceeds the {num_cuda_devices} visible CUDA "
            "devices (one device per replica)"
        )
    ids = [d for d in (visible or "").split(",") if d.strip()] or [
        str(i) for i in range(num_cuda_devices)
    ]
    return [{"PHLOEM_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ids[r]} for r in range(num_replicas)]


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's part of one batch.

    Attributes:
        replica: its index. num_requests / num_groups: what it was dealt (plan groups, whole).
        planned_cost_s: its groups' roofline cost at the nominal ceilings [s]; compare ratios.
        achieved_s: wall time from sending its share to its last output [s] (0 without work).
        num_computed_prompt_tokens: prompt tokens its engine ran for this batch [tokens].
    """

    replica: int
    num_requests: int
    num_groups: int
    planned_cost_s: float
    achieved_s: float
    num_computed_prompt_tokens: int


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class ReplicaReport:
    """Planned vs achieved work per replica for the last batch (`LLM.last_replica_report`).

    Attributes:
        replicas: one `ReplicaStats` per replica.
        request_replica: for each request of the batch (its index), the replica that ran it.
        request_group: for each request, its group in the batch's global plan.
    """

    replicas: list[ReplicaStats]
    request_replica: list[int]
    request_group: list[int]

    @property
    def planned_imbalance(self) -> float:
        """max / mean of the planned costs (1.0 is perfect)."""
        return _imbalance([s.planned_cost_s for s in self.replicas])

    @property
    def achieved_imbalance(self) -> float:
        """max / mean of the achieved wall times (1.0 is perfect)."""
        return _imbalance([s.achieved_s for s in self.replicas])

    def to_dict(self) -> dict[str, Any]:
        """The `data_parallel` object of the job summary (without the per-request lists)."""
        return {
            "num_replicas": len(self.replicas),
            "planned_imbalance": self.planned_imbalance,
            "achieved_imbalance": self.achieved_imbalance,
            "replicas": [dataclasses.asdict(s) for s in self.replicas],
        }


class DataParallelEngine:
    """N replica processes behind one global prefix plan (module docstring); the parent side
    of `LLM(data_parallel_size=N)`. It offers what the offline path reads of an `LLMEngine`
    (`tokenizer`, `hf_config`, `config`, `max_model_len`, `validate_prompt`,
    `validate_params`, `num_computed_prompt_tokens`) and runs batches with `run`.

    Args:
        args: the engine settings (data_parallel_size > 1); each replica builds its engine from
            them with data_parallel_size=1 on its own device.
    Raises:
        ValueError: more replicas than CUDA devices on CUDA (naming both numbers), or what
            loading the model's config and tokenizer raises.
        ReplicaError: a replica failed to start (naming it, with its error) or died starting.
    """

    def __init__(self, args: EngineArgs) -> None:
        import torch

        from phloem.models.loader import (
            load_hf_config,
            load_tokenizer,
            resolve_model,
            startup_source,
        )

        self.config = args.create_engine_config()
        self.num_replicas = args.data_parallel_size
        env = replica_placement(
            args.device,
            self.num_replicas,
            torch.cuda.device_count() if torch.cuda.is_available() else 0,
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
        # a GGUF model is converted here once, before the replicas would race to convert it
        source = startup_source(resolve_model(args.model), self.config.model)
        self.hf_config = load_hf_config(source)
        self.tokenizer = load_tokenizer(source)
        self.max_model_len = 0  # the replicas' resolved context length [tokens], once started
        threads = max(1, torch.get_num_threads() // self.num_replicas)
        self._specs = [
            (dataclasses.replace(args, data_parallel_size=1, device=e["PHLOEM_DEVICE"]), e, threads)
            for e in env
        ]
        self._replicas: list[Replica | None] = [None] * self.num_replicas
        self._num_computed_prompt_tokens = 0
        self.last_report: ReplicaReport | None = None
        self._finalizer = weakref.finalize(self, shutdown, [])
        self._start_missing()

    # -- what the offline path reads of an engine -------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError naming the limit when a prompt cannot run (on every replica)."""
        check_prompt(prompt_token_ids, self.max_model_len, self.hf_config.vocab_size)

    def validate_params(self, sampling_params: SamplingParams) -> None:
        """Raise ValueError naming the field when stop_token_ids lie outside the vocabulary."""
        check_params(sampling_params, self.hf_config.vocab_size)

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens the replicas ran since start, summed over replicas [tokens]."""
        return self._num_computed_prompt_tokens

    @property
    def pids(self) -> list[int | None]:
        """Each replica's process id (None for one not running)."""
        return [r.process.pid if r is not None else None for r in self._replicas]

    # -- processes ----------------------------------------------------------------------------------

    def _start_missing(self) -> None:
        """Start every replica that is not running (all at first; after a failure, the dead
        ones), then wait for each to load its model. Raises ReplicaError naming one that fails
        (the others started now are stopped)."""
        started = []
        for rank, replica in enumerate(self._replicas):
            if replica is None or not replica.process.is_alive():
                if replica is not None:
                    replica.stop()
                self._replicas[rank] = Replica(rank, *self._specs[rank])
                started.append(self._replicas[rank])
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, shutdown, list(self._replicas))
        try:
            self._await_ready(started)
        except BaseException:
            shutdown(started)
            raise
        self.max_model_len = min(r.max_model_len for r in self._replicas if r is not None)

    def _await_ready(self, replicas: list[Replica]) -> None:
        waiting = {r.rank: r for r in replicas}
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            objects = [o for r in waiting.values() for o in (r.conn, r.process.sentinel)]
            if not wait(objects, timeout=max(deadline - time.monotonic(), 0.0)):
                raise ReplicaError(min(waiting), f"did not start within {START_TIMEOUT_S:.0f} s")
            for rank, replica in list(waiting.items()):
                if replica.conn.poll() or not replica.process.is_alive():
                    message = receive(replica, "while starting")
                    if message[0] == "error":
                        raise ReplicaError(rank, f"failed to start: {message[1]}")
                    replica.max_model_len = message[1]["max_model_len"]
                    del waiting[rank]

    def close(self) -> None:
        """Stop the replica processes (idempotent; also at exit and when collected)."""
        self._finalizer()

    # -- batches ----------------------------------------------------------------------------------

    def run(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        plan: PrefixPlan,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Deal the planned batch's whole groups to the replicas by LPT over their roofline
        cost, send each its share and yield (index, output) as the replicas finish requests.
        Sets `last_report` when the iteration ends (early too). On an early end (break, an
        exception) the busy replicas are told to abort; one that does not stop within
        `ABORT_TIMEOUT_S` is stopped and started again at the next batch.

        Args:
            encoded / params: the batch's (text, token ids) pairs, validated, and their
                sampling parameters. plan: the global plan of `encoded` (every request in one
                group); its groups are the units of the deal.
        Raises:
            ReplicaError: naming a replica that died or whose batch raised (outputs that arrived
                before were yielded).
        """
        self._start_missing()
        assignment = assign_groups(self._group_costs(encoded, params, plan), self.num_replicas)
        shares = [assignment.replica_requests(plan, r) for r in range(self.num_replicas)]
        start = time.monotonic()
        achieved = [0.0] * self.num_replicas
        computed = [0] * self.num_replicas
        busy: dict[int, Replica] = {}
        try:
            for rank, share in enumerate(shares):
                if share:
                    replica = self._replica(rank)
                    batch = [encoded[i] for i in share], [params[i] for i in share]
                    try:
                        replica.conn.send(("batch", share, *batch))
                    except OSError:
                        raise replica.died("before its share was sent") from None
                    busy[rank] = replica
            while busy:
                for rank, message in self._next_messages(busy):
                    if message[0] == "output":
                        yield message[1], message[2]
                        continue
                    del busy[rank]
                    if message[0] == "error":
                        raise ReplicaError(rank, f"failed in a batch: {message[1]}")
                    achieved[rank] = time.monotonic() - start
                    computed[rank] = message[1]["num_computed_prompt_tokens"]
                    self._num_computed_prompt_tokens += computed[rank]
        finally:
            if busy:
                self._abort(busy)
            self.last_report = _report(plan, assignment, shares, achieved, computed)

    def _replica(self, rank: int) -> Replica:
        replica = self._replicas[rank]
        assert replica is not None, "started by _start_missing"
        return replica

    def _group_costs(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        plan: PrefixPlan,
    ) -> list[float]:
        """Each plan group's roofline cost [s] at the nominal ceilings: its prefix once, each
        member's prompt and its n sequences' max_tokens (the context's rest when unset)."""
        from phloem.bench.roofline import ModelShape

        prompt_lens = [len(ids) for _, ids in encoded]
        max_tokens = [
            (p.max_tokens if p.max_tokens is not None else self.max_model_len - n) * p.n
            for n, p in zip(prompt_lens, params)
        ]
        shape = ModelShape.from_hf(self.hf_config)
        return group_costs_s(
            plan, prompt_lens, max_tokens, shape, NOMINAL_FLOPS_PER_S, NOMINAL_BYTES_PER_S
        )

    def _next_messages(self, busy: dict[int, Replica]) -> Iterator[tuple[int, tuple]]:
        """Wait until a busy replica's pipe or process sentinel is ready; yield (rank, message)
        for each ready one. Raises ReplicaError for one that died."""
        objects = [o for r in busy.values() for o in (r.conn, r.process.sentinel)]
        wait(objects)
        for rank, replica in list(busy.items()):
            if replica.conn.poll() or not replica.process.is_alive():
                yield rank, receive(replica, "during a batch")

    def _abort(self, busy: dict[int, Replica]) -> None:
        """Tell the busy replicas to abort their share and wait for their "done" (dropping
        their outputs); stop those that do not answer within ABORT_TIMEOUT_S or died (they are
        started again at the next batch)."""
        for replica in busy.values():
            try:
                replica.conn.send(("abort",))
            except OSError:
                pass
        deadline = time.monotonic() + ABORT_TIMEOUT_S
        while busy and (remaining := deadline - time.monotonic()) > 0:
            wait([o for r in busy.values() for o in (r.conn, r.process.sentinel)], remaining)
            for rank, replica in list(busy.items()):
                if not replica.conn.poll() and replica.process.is_alive():
                    continue
                try:
                    kind = receive(replica, "while aborting")[0]
                except ReplicaError:
                    kind = "died"
                if kind != "output":  # "done" or "error": idle again; "died": stopped below
                    del busy[rank]
                if kind == "died":
                    replica.stop()
        for replica in busy.values():  # unresponsive: started again at the next batch
            replica.stop()


def _report(
    plan: PrefixPlan,
    assignment: ReplicaAssignment,
    shares: list[list[int]],
    achieved: list[float],
    computed: list[int],
) -> ReplicaReport:
    """The `ReplicaReport` of one batch from its deal (`ReplicaAssignment`) and what each
    replica reported."""
    request_replica = [0] * len(plan.request_group)
    for rank, share in enumerate(shares):
        for i in share:
            request_replica[i] = rank
    stats = [
        ReplicaStats(
            replica=rank,
            num_requests=len(shares[rank]),
            num_groups=len(assignment.replica_groups[rank]),
            planned_cost_s=assignment.planned_cost_s[rank],
            achieved_s=achieved[rank],
            num_computed_prompt_tokens=computed[rank],
        )
        for rank in range(assignment.num_replicas)
    ]
    return ReplicaReport(stats, request_replica, list(plan.request_group))
