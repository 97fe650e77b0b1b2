"""Executors run the scheduler's output on the workers and return their sampled tokens.

`UniProcExecutor` runs one worker in this process. Tensor-parallel and multi-node executors
implement the same methods: `execute_model` (run and wait), and for async scheduling `launch`
(enqueue, return a handle), `collect` (wait for a handle's tokens) and `needs_token_history`.
"""

from __future__ import annotations

from typing import Any, Protocol

from phloem.core.scheduler import SchedulerOutput
from phloem.worker.model_runner import ModelRunnerOutput
from phloem.worker.worker import Worker


class Executor(Protocol):
    num_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def launch(self, scheduler_output: SchedulerOutput) -> Any: ...

    def collect(self, launched: Any) -> ModelRunnerOutput: ...

    def needs_token_history(self, scheduler_output: SchedulerOutput) -> bool: ...


class UniProcExecutor:
    """One worker in the engine's own process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.num_blocks = worker.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.model_runner.execute_model(scheduler_output)

    def launch(self, scheduler_output: SchedulerOutput):
        return self.worker.model_runner.launch(scheduler_output)

    def collect(self, launched) -> ModelRunnerOutput:
        return self.worker.model_runner.collect(launched)

    def needs_token_history(self, scheduler_output: SchedulerOutput) -> bool:
        return self.worker.model_runner.needs_token_history(scheduler_output)
