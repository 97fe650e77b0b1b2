"""What a Ray processor runs: the model and engine settings of each replica actor, how many
actors, their resources and how a failed one is retried (`PhloemProcessorConfig`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from phloem.engine_args import EngineArgs

# EngineArgs fields a processor sets itself: the model from `model_source`, the replica count
# from `concurrency`
_OWN_FIELDS = {"model": "model_source", "data_parallel_size": "concurrency"}


@dataclass(frozen=True)
class PhloemProcessorConfig:
    """A processor of `phloem.ray.build_processor` (the shape of Ray Data's LLM processor
    configs: model source, engine kwargs, concurrency, batch size).

    Attributes:
        model_source: an HF checkpoint directory or a `.gguf` file, readable at the same path on
            every node of the cluster and on the driver (the driver reads its tokenizer and
            config to plan); None for the embedded default model.
        engine_kwargs: the other engine settings, exactly the fields of
            `phloem.engine_args.EngineArgs` (dtype, block_size, max_num_seqs, ...), each
            actor's `LLM(model_source, **engine_kwargs)`.
        concurrency: replica actors (>= 1): the global plan's groups are dealt to this many
            shares, one per actor.
        batch_size: None (the default) hands each actor its whole share as one batch (one
            engine call, one Ray task); an int >= 1 cuts each share into batches of whole plan
            groups of at most this many rows (a larger group stays whole), which the actor pool
            hands to whichever actor is free: smaller units to retry, dynamic balance.
        num_gpus / num_cpus: Ray resources per actor; None: one GPU when the engine's device
            is "cuda", or "auto" on a cluster with GPUs, else none; one CPU.
        max_restarts: times Ray restarts a dead actor, and retries the batch it was running,
            before the job fails (>= 0).
        actor_start_timeout_s: how long the job waits for all actors to load their model before
            it starts dealing batches (and fails, naming the timeout) [s].
        debug_columns: add `phloem_actor_id` (the Ray actor that ran the row), `phloem_share`
            and `phloem_group` (its share and its group in the global plan) to the output rows.
    """

    model_source: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int | None = None
    num_gpus: float | None = None
    num_cpus: float | None = None
    max_restarts: int = 3
    actor_start_timeout_s: int = 900
    debug_columns: bool = False

    def engine_args(self) -> EngineArgs:
        """The validated engine settings of the actors, data_parallel_size = `concurrency`.

        Raises:
            ValueError: naming the field, for an invalid value here or in `engine_kwargs`
                (`model` / `data_parallel_size` there: use model_source / concurrency).
            TypeError: naming an engine_kwargs key that is not an `EngineArgs` field.
        """
        self.validate()
        for name, own in _OWN_FIELDS.items():
            if name in self.engine_kwargs:
                raise ValueError(f"engine_kwargs['{name}']: set it as {own} instead")
        args = EngineArgs.from_kwargs(
            model=self.model_source, data_parallel_size=self.concurrency, **self.engine_kwargs
        )
        args.create_engine_config()
        return args

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit for an invalid value."""

        def count(name: str, low: int, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if allow_none and value is None:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

        count("concurrency", 1)
        count("batch_size", 1, allow_none=True)
        count("max_restarts", 0)
        count("actor_start_timeout_s", 1)
        for name in ("num_gpus", "num_cpus"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not isinstance(self.engine_kwargs, dict):
            raise ValueError(f"engine_kwargs must be a dict, got {type(self.engine_kwargs)}")

    def actor_resources(self, cluster_gpus: float) -> dict[str, float]:
        """{"num_gpus", "num_cpus"} of one actor (class docstring), given the GPUs of the
        cluster."""
        device = self.engine_kwargs.get("device", "auto")
        gpus = self.num_gpus
        if gpus is None:
            gpus = 1 if device == "cuda" or (device == "auto" and cluster_gpus > 0) else 0
        return {"num_gpus": gpus, "num_cpus": 1 if self.num_cpus is None else self.num_cpus}

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **options: Any) -> PhloemProcessorConfig:
        """The config whose actors run `args` (`concurrency` = its data_parallel_size);
        `options`: the other fields of this class."""
        kwargs = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(args)
            if f.name not in _OWN_FIELDS and getattr(args, f.name) != f.default
        }
        return cls(args.model, kwargs, args.data_parallel_size, **options)
