"""Executors run the scheduler's output on the workers and return their sampled tokens.

`Executor` declares every method the engine calls; `UniProcExecutor` runs one worker in this
process. Tensor-parallel and multi-node executors implement the same methods: `launch` (enqueue
a step, return a handle; `prepare` may do its host part ahead), `collect` (wait for a handle's tokens), `execute_model` (both),
`presample` and `sample` (a step with constrained samples: its noise, then its sampling under
the grammar bitmask), `needs_token_history`, and `shutdown`. The engine takes a factory (`LLMEngine(config,
executor_factory=...)`), so a test can wrap or replace the executor without patching the engine;
`build_executor` is the default: one in-process worker, or with tensor_parallel_size > 1 the
`phloem.engine.tp_executor.TensorParallelExecutor` over spawned rank processes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from phloem.config import EngineConfig, SchedulerConfig
from phloem.core.scheduler import SchedulerOutput
from phloem.structured_output.manager import GrammarBitmask
from phloem.worker.host_threads import cap_torch_threads
from phloem.worker.model_runner import ModelRunnerOutput
from phloem.worker.worker import Worker, resolve_device


class Executor(abc.ABC):
    """Runs steps on the workers.

    Attributes:
        num_blocks: KV blocks per layer each worker holds [blocks] (the scheduler's pool).
    """

    num_blocks: int

    @abc.abstractmethod
    def launch(self, scheduler_output: SchedulerOutput) -> Any:
        """Enqueue one step; returns a handle for `collect` (None for an empty step). Steps must
        be launched in the order the scheduler made them, every one (empty ones too: they carry
        the ids of requests that finished)."""

    def prepare(self, scheduler_output: SchedulerOutput) -> None:  # noqa: B027 - saves time only
        """Do the host-only part of the step's `launch` now (no device work, no sampled token
        read), before the step launched last gets its `sample`; `launch` of the same output
        must follow before any other step is prepared. The engine calls it for every step; an
        executor without such a part (the TP ranks build their steps at `launch`) does it all
        in `launch`."""

    @abc.abstractmethod
    def collect(self, launched: Any) -> ModelRunnerOutput:
        """Wait for a launched step's tokens; an empty output for None."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it (a step without constrained samples)."""
        return self.collect(self.launch(scheduler_output))

    def presample(self, launched: Any) -> None:  # noqa: B027 - optional: it only saves time
        """Enqueue the part of a launched constrained step's sampling that needs no bitmask
        (its random rows' noise and `Sampler.prepare`: non-finite flags, the float32 copy,
        bans, penalties, temperature, the per-row tensors), while the engine's threads fill the
        bitmask; before `sample`, which otherwise does it."""

    # True: `sample` takes `wait` (the worker in this process: `engine/device_wait.py`)
    device_wait = False

    @abc.abstractmethod
    def sample(self, launched: Any, grammar: GrammarBitmask, wait=None) -> None:
        """Enqueue the sampling of a launched step with constrained samples
        (`SchedulerOutput.structured_seq_ids`) under its grammar bitmask; before `collect` and
        before the next `launch`. `wait` (only where `device_wait`): enqueued before the
        bitmask's copy (`ModelRunner.sample`)."""

    @abc.abstractmethod
    def needs_token_history(self, scheduler_output: SchedulerOutput) -> bool:
        """True if sampling this step reads earlier output tokens (penalties), so the step in
        flight must be collected before this one is launched."""

    def shutdown(self) -> None:  # noqa: B027 - optional: executors without processes hold none
        """Stop what the executor started (processes, process groups); idempotent."""


class UniProcExecutor(Executor):
    """One worker in the engine's own process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.num_blocks = worker.num_blocks

    def launch(self, scheduler_output: SchedulerOutput):
        return self.worker.model_runner.launch(scheduler_output)

    def prepare(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.model_runner.prepare(scheduler_output)

    def collect(self, launched) -> ModelRunnerOutput:
        return self.worker.model_runner.collect(launched)

    def presample(self, launched) -> None:
        self.worker.model_runner.presample(launched)

    device_wait = True

    def sample(self, launched, grammar: GrammarBitmask, wait=None) -> None:
        self.worker.model_runner.sample(launched, grammar, wait)

    def needs_token_history(self, scheduler_output: SchedulerOutput) -> bool:
        return self.worker.model_runner.needs_token_history(scheduler_output)


def build_executor(
    config: EngineConfig,
    source,
    hf_config,
    eos_token_id: int | None,
    scheduler_config: SchedulerConfig,
    executor_factory: Callable[[Worker], Executor] | None = None,
) -> Executor:
    """The engine's executor: with tensor_parallel_size > 1 a `TensorParallelExecutor` (which
    starts the rank processes; `executor_factory` must be None), else `executor_factory` (default
    `UniProcExecutor`) over one `Worker` in this process. Once it has started, a CUDA engine's
    process runs torch on one CPU thread (`worker.host_threads.cap_torch_threads`).

    Raises:
        ValueError: for an executor_factory with tensor_parallel_size > 1, or a model that does
            not split over the ranks; see `start_tensor_parallel` and `Worker`.
    """
    executor: Executor
    if config.parallel.tensor_parallel_size > 1:
        if executor_factory is not None:
            raise ValueError("executor_factory cannot be combined with tensor_parallel_size > 1")
        from phloem.engine.tp_executor import start_tensor_parallel

        executor = start_tensor_parallel(config, source, hf_config, eos_token_id, scheduler_config)
    else:
        worker = Worker(
            config.model,
            config.cache,
            source,
            hf_config,
            config.seed,
            eos_token_id,
            scheduler_config=scheduler_config,
            speculative_config=config.speculative,
        )
        executor = (executor_factory or UniProcExecutor)(worker)
    cap_torch_threads(resolve_device(config.model.device).type)
    return executor
