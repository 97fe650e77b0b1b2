"""Executors run the scheduler's output on the workers and return their sampled tokens.

`UniProcExecutor` runs one worker in this process. Tensor-parallel and multi-node executors
implement the same two methods.
"""

from __future__ import annotations

from typing import Protocol

from phloem.core.scheduler import SchedulerOutput
from phloem.worker.model_runner import ModelRunnerOutput
from phloem.worker.worker import Worker


class Executor(Protocol):
    num_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class UniProcExecutor:
    """One worker in the engine's own process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.num_blocks = worker.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.model_runner.execute_model(scheduler_output)
