"""Executors run the scheduler's output on the workers and return their sampled tokens.

`Executor` declares every method the engine calls; `UniProcExecutor` runs one worker in this
process. Tensor-parallel and multi-node executors implement the same methods: `launch` (enqueue
a step, return a handle), `collect` (wait for a handle's tokens), `execute_model` (both) and
`needs_token_history`. The engine takes a factory (`LLMEngine(config, executor_factory=...)`),
so a test can wrap or replace the executor without patching the engine.
"""

from __future__ import annotations

import abc
from typing import Any

from phloem.core.scheduler import SchedulerOutput
from phloem.worker.model_runner import ModelRunnerOutput
from phloem.worker.worker import Worker


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

    @abc.abstractmethod
    def collect(self, launched: Any) -> ModelRunnerOutput:
        """Wait for a launched step's tokens; an empty output for None."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it."""
        return self.collect(self.launch(scheduler_output))

    @abc.abstractmethod
    def needs_token_history(self, scheduler_output: SchedulerOutput) -> bool:
        """True if sampling this step reads earlier output tokens (penalties), so the step in
        flight must be collected before this one is launched."""


class UniProcExecutor(Executor):
    """One worker in the engine's own process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.num_blocks = worker.num_blocks

    def launch(self, scheduler_output: SchedulerOutput):
        return self.worker.model_runner.launch(scheduler_output)

    def collect(self, launched) -> ModelRunnerOutput:
        return self.worker.model_runner.collect(launched)

    def needs_token_history(self, scheduler_output: SchedulerOutput) -> bool:
        return self.worker.model_runner.needs_token_history(scheduler_output)
