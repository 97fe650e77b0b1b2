"""Data-parallel replicas of the offline engine under one global prefix plan (issue 16).

`LLM(data_parallel_size=N)` with N > 1 holds a `DataParallelEngine` instead of an `LLMEngine`:

```
parent (tokenizer + model config, no weights)          replica r (spawned process)
  tokenize, validate ──► ONE PrefixPlan of the batch      LLM(**args, data_parallel_size=1)
  group_costs_s ──► partition_groups (LPT) ──► share r ─► add_requests(share, plan=its groups)
  merge: (index, output) in completion order ◄── pipe ◄── (index, output) as each finishes
```

Routing (`data_parallel_routing`): "prefix" (the default) deals the global plan's groups by
`core.replica_partition.partition_groups`: whole groups by longest-processing-time-first over
their roofline cost (Graham 1969; after BatchLLM arXiv 2412.03594 §4), so each shared prefix is
computed once in the whole cluster; each replica queues its share under the global plan's groups
as dealt (`core.replica_partition.share_plan`: no second planning, and exactly the prompt tokens
one engine computes); only a group costlier than the mean replica load is split (each replica
holding a piece computes its prefix once; the report counts those tokens). The costs are taken
at nominal ceilings, of which only the ratios matter. "contiguous" cuts the request list into N
contiguous slices of near-equal counts (vLLM's data-parallel example), each replica planning
its own slice: the baseline prefix routing is measured against.

Dispatch: the shares are packed (`engine.replica_share`: token ids in one array, each prefix
once) and sent to all replicas at once (a thread each); outputs come back without their prompt,
which the parent puts back. The report times each replica's share sent, unpacked and queued.

Processes: the `spawn` context; replica r runs on CUDA device r (CUDA_VISIBLE_DEVICES set to
that one device) when the engine's device is CUDA, else on the CPU with the parent's torch
threads divided among the replicas. Each replica talks to the parent over one duplex pipe:
parent -> replica ("batch", Share) | ("abort",) | ("stop",); replica -> parent ("ready",
info) | ("output", index, RequestOutput) | ("done", stats) | ("error", text).
The parent waits on the pipes and the processes' sentinels together, so a replica that dies
(killed, or crashed) is noticed at once and raised as `ReplicaError` naming it (with the
replica's traceback when an exception in it was the cause); a batch's outputs that arrived
before are yielded first, as each replica finishes each request (a resumable job saves them,
and its rerun runs the rest). A dead or unresponsive replica is started again at the next
batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import weakref
from array import array
from collections.abc import Generator, Iterator, Sequence
from multiprocessing.connection import wait

from phloem.core.prefix_planner import PrefixPlan, plan_prefix_groups
from phloem.core.replica_partition import cost_terms_s, partition_groups
from phloem.engine.input_checks import check_params, check_prompt
from phloem.engine.replica_process import Replica, ReplicaError, receive, shutdown
from phloem.engine.replica_report import BatchProgress, Deal, ReplicaReport
from phloem.engine.replica_share import encode_share
from phloem.engine_args import EngineArgs
from phloem.outputs import RequestOutput
from phloem.sampling_params import SamplingParams

# Nominal ceilings the plan's group costs are expressed against (an H100's dense bf16 FLOP/s and
# HBM bytes/s); the LPT deal depends only on the costs' ratios.
NOMINAL_FLOPS_PER_S = 989e12
NOMINAL_BYTES_PER_S = 3.35e12
START_TIMEOUT_S = 900.0  # a replica must load its model within this [s]
ABORT_GRACE_S = 5.0  # after an early end, a busy replica must answer within this [s] (it looks
# at its pipe after every step), else it is stopped and started again at the next batch


def replica_placement(
    device: str,
    num_replicas: int,
    num_cuda_devices: int,
    visible: str | None,
    devices_per_replica: int = 1,
) -> list[dict[str, str]]:
    """Where each replica runs: per replica, the environment it starts with (`PHLOEM_DEVICE`
    "cuda" or "cpu", and on CUDA the CUDA_VISIBLE_DEVICES of its `devices_per_replica`
    devices: one, or one per rank of a tensor-parallel group, consecutive).

    Args:
        device: the engine's device setting ("auto", "cuda", "cpu").
        num_cuda_devices: CUDA devices visible to the parent; visible: its CUDA_VISIBLE_DEVICES.
        devices_per_replica: the tensor-parallel size.
    Raises:
        ValueError: naming the numbers, when the replicas need more CUDA devices than there are
            on CUDA, or when device is "cuda" and there is none.
    """
    on_cuda = device == "cuda" or (device == "auto" and num_cuda_devices > 0)
    if not on_cuda:
        return [{"PHLOEM_DEVICE": "cpu"} for _ in range(num_replicas)]
    per = devices_per_replica
    if num_replicas * per > num_cuda_devices:
        each = "one device per replica" if per == 1 else f"{per} devices per replica (TP={per})"
        raise ValueError(
            f"data_parallel_size={num_replicas} needs {num_replicas * per} CUDA devices ({each}); "
            f"{num_cuda_devices} are visible"
        )
    ids = [d for d in (visible or "").split(",") if d.strip()] or [
        str(i) for i in range(num_cuda_devices)
    ]
    return [
        {"PHLOEM_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ",".join(ids[r * per : (r + 1) * per])}
        for r in range(num_replicas)
    ]


class DataParallelEngine:
    """N replica processes behind one global prefix plan (module docstring); the parent side
    of `LLM(data_parallel_size=N)`. It offers what the offline path reads of an `LLMEngine`
    (`tokenizer`, `hf_config`, `config`, `max_model_len`, `validate_prompt`,
    `validate_params`, `num_computed_prompt_tokens`) and runs batches with `run`.

    Args:
        args: the engine settings (data_parallel_size > 1); each replica builds its engine from
            them with data_parallel_size=1 on its own device.
        start: start the replicas now (and wait until each has loaded its model); False starts
            none until the first batch (`phloem generate --plan-only` plans without them), with
            `max_model_len` the model's own until then.
    Raises:
        ValueError: more replicas than CUDA devices on CUDA (naming both numbers), or what
            loading the model's config and tokenizer raises.
        ReplicaError: a replica failed to start (naming it, with its error) or died starting.
    """

    def __init__(self, args: EngineArgs, start: bool = True) -> None:
        import torch

        from phloem.models.loader import (
            load_hf_config,
            load_tokenizer,
            resolve_model,
            startup_source,
        )

        self.config = args.create_engine_config()
        self.num_replicas = args.data_parallel_size
        self.routing = args.data_parallel_routing
        env = replica_placement(
            args.device,
            self.num_replicas,
            torch.cuda.device_count() if torch.cuda.is_available() else 0,
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            args.tensor_parallel_size,
        )
        # a GGUF model is converted here once, before the replicas would race to convert it
        source = startup_source(resolve_model(args.model), self.config.model)
        self.hf_config = load_hf_config(source)
        self.tokenizer = load_tokenizer(source)
        # the context length until the replicas report theirs (capped by their KV pools)
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(self.config.model.max_model_len or model_len, model_len)
        threads = max(1, torch.get_num_threads() // self.num_replicas)
        self._specs = [
            (dataclasses.replace(args, data_parallel_size=1, device=e["PHLOEM_DEVICE"]), e, threads)
            for e in env
        ]
        self._replicas: list[Replica | None] = [None] * self.num_replicas
        self._num_computed_prompt_tokens = 0
        self.last_report: ReplicaReport | None = None
        self.replica_engines: list[dict] = []  # each replica's resolved settings, once started
        self._finalizer = weakref.finalize(self, shutdown, [])
        if start:
            self._start_missing()

    # -- what the offline path reads of an engine -------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError naming the limit when a prompt cannot run (on every replica): the
        errors of `input_checks.check_prompt`. The parent checks the whole batch alone before
        any replica works, so the id range is checked in one pass in C (the ids packed as
        4-byte ints, then numpy's max) instead of Python's min and max; `check_prompt` runs
        only to name a failure."""
        import numpy as np

        vocab = self.hf_config.vocab_size
        ids = prompt_token_ids
        if not ids or len(ids) >= self.max_model_len:
            check_prompt(ids, self.max_model_len, vocab)
            return
        try:
            top = int(np.frombuffer(array("I", ids), dtype=np.uint32).max())
        except (OverflowError, TypeError):  # negative, >= 2**32 or not an int
            top = vocab
        if top >= vocab:
            check_prompt(ids, self.max_model_len, vocab)

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
        started: list[Replica] = []
        for rank, replica in enumerate(self._replicas):
            if replica is None or not replica.process.is_alive():
                if replica is not None:
                    replica.stop()
                self._replicas[rank] = replica = Replica(rank, *self._specs[rank])
                started.append(replica)
        if not started:
            return
        self._finalizer.detach()
        running = [r for r in self._replicas if r is not None]  # all of them, now
        self._finalizer = weakref.finalize(self, shutdown, running)
        try:
            self._await_ready(started)
        except BaseException:
            shutdown(started)
            raise
        self.max_model_len = min(r.max_model_len for r in self._replicas if r is not None)
        self.replica_engines = [r.engine_info for r in self._replicas if r is not None]

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
                        raise ReplicaError(rank, f"failed to start: {message[1]}", message[2])
                    replica.max_model_len = message[1]["max_model_len"]
                    replica.engine_info = message[1]["engine"]
                    del waiting[rank]

    def close(self) -> None:
        """Stop the replica processes (idempotent; also at exit and when collected). When it
        returns every replica process has exited (`replica_process.shutdown`)."""
        self._finalizer()

    # -- batches ----------------------------------------------------------------------------------

    def deal(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        plan: PrefixPlan,
    ) -> Deal:
        """Which requests each replica runs under this engine's routing (module docstring), with
        the costs at the nominal ceilings; runs no model and starts no replica.

        Args:
            encoded / params: the batch's (text, token ids) pairs and sampling parameters.
            plan: the global plan of `encoded` (every request in one group).
        """
        from phloem.bench.roofline import ModelShape

        lens = [len(ids) for _, ids in encoded]
        max_tokens = [
            (p.max_tokens if p.max_tokens is not None else self.max_model_len - n) * p.n
            for n, p in zip(lens, params)
        ]
        shape = ModelShape.from_hf(self.hf_config)
        ceilings = NOMINAL_FLOPS_PER_S, NOMINAL_BYTES_PER_S
        sharing = self.config.cache.enable_prefix_caching
        if self.routing == "prefix":
            terms = cost_terms_s(plan, lens, max_tokens, shape, *ceilings)
            a = partition_groups(plan, *terms, self.num_replicas)
            share_groups = [a.replica_share(plan, r) for r in range(self.num_replicas)]
            shares = [[i for _, members in s for i in members] for s in share_groups]
            computed = plan.num_physical_prompt_tokens + a.extra_prefix_tokens(plan)
            groups = [len(g) for g in a.replica_groups]
            return Deal(self.routing, shares, groups, a.planned_cost_s, len(a.split_groups),
                        computed if sharing else sum(lens), share_groups)  # fmt: skip
        bounds = [len(encoded) * r // self.num_replicas for r in range(self.num_replicas + 1)]
        shares = [list(range(bounds[r], bounds[r + 1])) for r in range(self.num_replicas)]
        costs, groups, computed = [], [], 0
        for share in shares:  # each slice planned as its replica will plan it
            local = plan_prefix_groups([encoded[i][1] for i in share],
                                       [max_tokens[i] for i in share], plan.block_size)  # fmt: skip
            local_lens, local_out = [lens[i] for i in share], [max_tokens[i] for i in share]
            prefix, member = cost_terms_s(local, local_lens, local_out, shape, *ceilings)
            costs.append(sum(prefix) + sum(member))
            groups.append(len(local.groups))
            computed += local.num_physical_prompt_tokens if sharing else sum(local_lens)
        return Deal(self.routing, shares, groups, costs, 0, computed)

    def run(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        plan: PrefixPlan,
    ) -> Generator[tuple[int, RequestOutput], None, None]:
        """Deal the planned batch to the replicas (`deal`), send each its share and yield
        (index, output) as the replicas finish requests. Sets `last_report` when the iteration
        ends (early too). On an early end (break, an exception) the busy replicas are told to
        abort; one that does not answer within `ABORT_GRACE_S` is stopped and started again at
        the next batch.

        Args:
            encoded / params: the batch's (text, token ids) pairs, validated, and their
                sampling parameters. plan: the global plan of `encoded` (every request in one
                group); its groups are the units of the prefix routing.
        Raises:
            ReplicaError: naming a replica that died or whose batch raised (outputs that arrived
                before were yielded).
        """
        self._start_missing()
        progress = BatchProgress(time.monotonic(), self.num_replicas)
        deal = self.deal(encoded, params, plan)
        progress.deal_s = time.monotonic() - progress.start
        busy: dict[int, Replica] = {}
        try:
            self._send_shares(encoded, params, plan.block_size, deal, progress, busy)
            while busy:
                for rank, message in self._next_messages(busy):
                    if message[0] == "output":  # sent without its prompt: the driver has it
                        text, ids = encoded[message[1]]
                        yield (
                            message[1],
                            dataclasses.replace(
                                message[2], prompt=text, prompt_token_ids=list(ids)
                            ),
                        )
                        continue
                    del busy[rank]
                    if message[0] == "error":
                        raise ReplicaError(rank, f"failed in a batch: {message[1]}", message[2])
                    self._num_computed_prompt_tokens += progress.done(rank, message[1])
        finally:
            if busy:
                self._abort(busy, progress)
            self.last_report = progress.report(plan, deal)

    def _send_shares(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        block_size: int,
        deal: Deal,
        progress: BatchProgress,
        busy: dict[int, Replica],
    ) -> None:
        """Pack each non-empty share (`replica_share.encode_share`: under prefix routing with
        the deal's groups as its plan) and send them all at once, one thread per replica, so
        that one replica reading its share holds up no other; adds each replica sent to to
        `busy`. Raises ReplicaError naming the lowest replica that died before its share was
        sent, or what sending it raised otherwise (the others are busy then, and aborted by
        the caller)."""
        groups = deal.share_groups
        planned = groups is not None
        messages = {
            rank: encode_share(encoded, params, groups[rank] if groups is not None
                               else [(0, (i,)) for i in share], block_size, planned)
            for rank, share in enumerate(deal.shares) if share
        }  # fmt: skip
        failed: dict[int, BaseException] = {}

        def send(rank: int) -> None:
            try:
                self._replica(rank).conn.send(("batch", messages[rank]))
                progress.sent(rank)
            except BaseException as e:  # raised below, in the caller's thread
                failed[rank] = e

        threads = [threading.Thread(target=send, args=(rank,)) for rank in messages]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        busy.update((rank, self._replica(rank)) for rank in messages if rank not in failed)
        if failed:
            rank = min(failed)
            if isinstance(failed[rank], OSError):
                raise self._replica(rank).died("before its share was sent") from None
            raise failed[rank]

    def _replica(self, rank: int) -> Replica:
        replica = self._replicas[rank]
        assert replica is not None, "started by _start_missing"
        return replica

    def _next_messages(self, busy: dict[int, Replica]) -> Iterator[tuple[int, tuple]]:
        """Wait until a busy replica's pipe or process sentinel is ready; yield (rank, message)
        for each ready one. Raises ReplicaError for one that died."""
        objects = [o for r in busy.values() for o in (r.conn, r.process.sentinel)]
        wait(objects)
        for rank, replica in list(busy.items()):
            if replica.conn.poll() or not replica.process.is_alive():
                yield rank, receive(replica, "during a batch")

    def _abort(self, busy: dict[int, Replica], progress: BatchProgress) -> None:
        """Tell the busy replicas to abort their share and wait for their "done" (dropping
        their outputs, recording their stats in `progress`); stop those that do not answer
        within ABORT_GRACE_S or died (they are started again at the next batch)."""
        for replica in busy.values():
            try:
                replica.conn.send(("abort",))
            except OSError:
                pass
        deadline = time.monotonic() + ABORT_GRACE_S
        while busy and (remaining := deadline - time.monotonic()) > 0:
            wait([o for r in busy.values() for o in (r.conn, r.process.sentinel)], remaining)
            for rank, replica in list(busy.items()):
                if not replica.conn.poll() and replica.process.is_alive():
                    continue
                try:
                    message = receive(replica, "while aborting")
                    kind = message[0]
                except ReplicaError:
                    kind = "died"
                if kind == "done":
                    self._num_computed_prompt_tokens += progress.done(rank, message[1])
                if kind != "output":  # "done" or "error": idle again; "died": stopped below
                    del busy[rank]
                if kind == "died":
                    replica.stop()
        shutdown(list(busy.values()))  # unresponsive: started again at the next batch


def with_progress(
    outputs: Generator[tuple[int, RequestOutput], None, None], total: int, use_tqdm: bool
) -> Generator[tuple[int, RequestOutput], None, None]:
    """`outputs` (the replicas' merged stream) under a progress bar of prompts done."""
    from tqdm.auto import tqdm

    with (
        contextlib.closing(outputs),
        tqdm(total=total, desc="Processed prompts", disable=not use_tqdm) as bar,
    ):
        for item in outputs:
            bar.update(1)
            yield item
