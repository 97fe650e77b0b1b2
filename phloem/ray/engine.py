"""phloem's data-parallel engine on a Ray cluster: the driver plans, Ray actors generate.

```
driver (tokenizer + model config, no weights)            Ray actor pool (N = concurrency)
  tokenize, validate -> ONE PrefixPlan -> deal (LPT) --->  PhloemReplica: LLM.generate(batch)
  batches = whole groups of one share, one Ray block        (any free actor takes a block)
  (index, output) <--------------- Dataset rows, as blocks finish <------+
```

`RayEngine` is `DataParallelEngine`'s driver side (the same `deal`: the global plan's groups,
each prefix computed once in the cluster) with the replicas replaced by a Ray Data actor pool:
each share (or, with a batch_size, each run of whole groups of a share) becomes one block of a
`ray.data.Dataset`, and `map_batches` over an actor pool of `concurrency` `PhloemReplica` actors
runs each block as one batch, so a group's rows always meet on one actor. The pool waits until
every actor has loaded its model, and gives an actor one block at a time, so the N shares go
to the N actors. A dead actor is restarted by Ray and the block it was running is retried
(`max_restarts`): a job still yields one output per row. `RayLLM` is the `LLM` over it.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import socket
import time
from collections.abc import Generator, Sequence
from typing import Any

from phloem.core.prefix_planner import PrefixPlan
from phloem.engine.data_parallel import DataParallelEngine
from phloem.engine.llm import LLM
from phloem.engine.replica_report import Deal, replica_report
from phloem.outputs import RequestOutput
from phloem.ray.config import PhloemProcessorConfig
from phloem.ray.replica_actor import (
    GROUP,
    PARAMS,
    REQUEST_OUTPUT,
    ROW,
    SHARE,
    STATS,
    TOKEN_IDS,
    PhloemReplica,
)
from phloem.sampling_params import SamplingParams

CONNECT_TIMEOUT_S = 5.0  # an address must accept a TCP connection within this [s]


def connect(address: str, name: str = "address") -> bool:
    """Connect this process to the Ray cluster at `address` ("auto", "HOST:PORT" or
    "ray://HOST:PORT"); nothing when Ray is already initialized here. Returns True when it
    connected (the caller may `ray.shutdown()` when done).

    Raises:
        ValueError: naming `name`, when Ray is not installed (`pip install 'phloem[ray]'`), or
            when no Ray cluster answers at `address` (a TCP check first, so that a wrong port
            fails within CONNECT_TIMEOUT_S instead of Ray's own retries).
    """
    try:
        import ray
    except ImportError:
        raise ValueError(
            f"{name} {address!r} needs Ray, which is not installed: pip install 'phloem[ray]'"
        ) from None
    if ray.is_initialized():
        return False
    if address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as e:
            raise ValueError(f"{name} {address!r}: no Ray cluster answers there ({e})") from None
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"{name} {address!r}: cannot connect to a Ray cluster ({e})") from None
    return True


def share_blocks(deal: Deal, request_group: Sequence[int], batch_size: int | None):
    """The blocks of a deal: (share, request indices) per block, one block per non-empty share
    when `batch_size` is None, else each share cut into runs of at most `batch_size` requests,
    cut only where a group ends (a larger group stays whole); blocks of the shares interleaved
    so that the first ones dealt cover every share."""
    per_share = []
    for share, requests in enumerate(deal.shares):
        blocks: list[list[int]] = []
        for i in requests:
            new_group = not blocks or request_group[i] != request_group[blocks[-1][-1]]
            if not blocks or (batch_size is not None and len(blocks[-1]) >= batch_size
                              and new_group):  # fmt: skip
                blocks.append([])
            blocks[-1].append(i)
        per_share.append([(share, b) for b in blocks])
    longest = max((len(b) for b in per_share), default=0)
    return [s[k] for k in range(longest) for s in per_share if k < len(s)]


def routing_row(i: int, token_ids: list[int], params: SamplingParams, share: int, group: int):
    """The routing columns of request `i` (`replica_actor`'s module docstring)."""
    return {ROW: i, TOKEN_IDS: token_ids, PARAMS: pickle.dumps(params), SHARE: share, GROUP: group}


def generation_stage(blocks: list[list[dict[str, Any]]], config: PhloemProcessorConfig,
                     request_outputs: bool):  # fmt: skip
    """The lazy `ray.data.Dataset` of the generated rows: one input block per entry of
    `blocks` (rows carrying the routing columns), `map_batches` over the actor pool of
    `config` (module docstring). Needs a connected Ray."""
    import ray
    import ray.data

    parts = [ray.data.from_items(rows, override_num_blocks=1) for rows in blocks if rows]
    if not parts:
        return ray.data.from_items([])
    dataset = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    resources = config.actor_resources(ray.cluster_resources().get("GPU", 0))
    actor_kwargs = {**config.engine_kwargs, "data_parallel_size": 1}
    out = dataset.map_batches(
        PhloemReplica,
        fn_constructor_kwargs=dict(
            model=config.model_source,
            engine_kwargs=actor_kwargs,
            request_outputs=request_outputs,
            debug_columns=config.debug_columns,
        ),
        batch_size=None,  # a block is one batch: one LLM.generate over whole groups
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(
            size=config.concurrency, max_tasks_in_flight_per_actor=1
        ),
        max_restarts=config.max_restarts,
        max_task_retries=config.max_restarts,
        **resources,
    )
    out.context.wait_for_min_actors_s = config.actor_start_timeout_s  # our dataset's context
    return out


class RayEngine(DataParallelEngine):
    """The driver of a Ray job (module docstring): `DataParallelEngine`'s planning and deal,
    batches run by a Ray Data actor pool. Starts no process of its own and loads no weights;
    needs a connected Ray (`connect`) when a batch runs.

    Raises:
        ValueError, TypeError: as `PhloemProcessorConfig.engine_args`, or what loading the
            model's config and tokenizer raises.
    """

    def __init__(self, config: PhloemProcessorConfig) -> None:
        args = config.engine_args()
        # the driver plans only: no device of its own
        super().__init__(dataclasses.replace(args, device="cpu"), start=False)
        self.ray_config = config

    def run(
        self,
        encoded: Sequence[tuple[str | None, list[int]]],
        params: Sequence[SamplingParams],
        plan: PrefixPlan,
    ) -> Generator[tuple[int, RequestOutput], None, None]:
        """Deal the planned batch (`deal`), run its blocks on the actor pool and yield (index,
        output) as blocks finish. Sets `last_report` when the iteration ends (achieved: when a
        share's last row arrived; computed prompt tokens as its actors reported them).

        Raises:
            ray.exceptions.RayError: a block failed beyond its retries (Ray names the actor).
        """
        deal = self.deal(encoded, params, plan)
        blocks = share_blocks(deal, plan.request_group, self.ray_config.batch_size)
        rows = [
            [routing_row(i, encoded[i][1], params[i], share, plan.request_group[i]) for i in b]
            for share, b in blocks
        ]
        owner = {i: share for share, b in blocks for i in b}
        left = [len(s) for s in deal.shares]
        achieved, computed = [0.0] * self.num_replicas, [0] * self.num_replicas
        counted: set[int] = set()  # blocks (by their first row) whose stats are counted
        start = time.monotonic()
        try:
            stage = generation_stage(rows, self.ray_config, request_outputs=True)
            for row in stage.iter_rows():
                i = int(row["row_index"])
                share = owner[i]
                left[share] -= 1
                if left[share] == 0:
                    achieved[share] = time.monotonic() - start
                stats = json.loads(row[STATS])
                if stats["first_row"] not in counted:
                    counted.add(stats["first_row"])
                    computed[share] += stats["num_computed_prompt_tokens"]
                yield i, pickle.loads(row[REQUEST_OUTPUT])
        finally:
            self._num_computed_prompt_tokens += sum(computed)
            attention: list[dict | None] = [None] * self.num_replicas
            self.last_report = replica_report(plan, deal, achieved, computed, attention)


class RayLLM(LLM):
    """`LLM` whose batches run on a Ray cluster (`RayEngine`): `generate`, `chat` and
    `run_batch` as on one machine, planned once on this driver, one actor per replica.

    Args:
        config: the actors' model, engine settings, count and resources.
    Raises:
        ValueError, TypeError: as `RayEngine`.
    """

    llm_engine: RayEngine  # what `_init_state` is handed

    def __init__(self, config: PhloemProcessorConfig) -> None:
        start = time.perf_counter()
        self._init_state(RayEngine(config), time.perf_counter() - start)
