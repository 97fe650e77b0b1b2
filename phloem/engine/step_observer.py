"""What the engine tells a step observer: one record per model step, after its outputs are in.

`LLMEngine.add_step_observer(fn)` registers `fn(record)`; the engine calls it once per non-empty
step, right after that step's tokens were applied (`update_from_output`, text and stop strings).
Under async scheduling the record of step N is delivered when step N is collected, during the
`step()` call that launched step N+1. An observer must not mutate the scheduler output or the
runner output it is handed; an exception it raises propagates out of `step()`.

Timings are `time.perf_counter()` differences on the engine's thread [seconds]:

    schedule_s: Scheduler.schedule()
    launch_s:   Executor.launch() (host work to enqueue the step; on a GPU the device may lag)
    wait_s:     Executor.collect() (waiting for the device and copying tokens to the host)
    update_s:   update_from_output() + outputs (text, stop strings, metrics)

`launched_at` is `time.monotonic()` [s] when the step was handed to the executor (the clock of
every process on the host: a client's timestamps compare with it); the step's `step()` call
began at `started_at` = launched_at - launch_s - schedule_s. An observer stamps the step's end
itself (it is called right after the update).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from phloem.core.scheduler import SchedulerOutput
from phloem.worker.model_runner import ModelRunnerOutput


@dataclass(frozen=True)
class StepRecord:
    """One model step as the engine saw it (see the module docstring for the timings).

    Attributes:
        step_index: 0-based count of the engine's non-empty steps.
        scheduler_output: what the step computed.
        runner_output: what the worker returned (empty dicts for a step that sampled nothing;
            None is reserved for executors that return no output).
        schedule_s, launch_s, wait_s, update_s: [seconds].
        launched_at: `time.monotonic()` when the launch ended [s] (0.0: not stamped).
    """

    step_index: int
    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput | None
    schedule_s: float
    launch_s: float
    wait_s: float
    update_s: float
    launched_at: float = 0.0

    @property
    def started_at(self) -> float:
        """`time.monotonic()` when the step's `step()` call began (its scheduling) [s]."""
        return self.launched_at - self.launch_s - self.schedule_s


StepObserver = Callable[[StepRecord], None]


@dataclass
class LaunchedStep:
    """A step handed to the executor and not yet collected, with its host timings [s]; the
    engine makes it right after the launch, which stamps `launched_at` (monotonic [s])."""

    index: int
    scheduler_output: SchedulerOutput
    handle: object
    schedule_s: float
    launch_s: float
    launched_at: float = field(default_factory=time.monotonic)

    def record(
        self, runner_output: ModelRunnerOutput, wait_s: float, update_s: float
    ) -> StepRecord:
        """The step's record once it was collected (`wait_s`) and applied (`update_s`)."""
        return StepRecord(
            self.index, self.scheduler_output, runner_output, self.schedule_s, self.launch_s,
            wait_s, update_s, self.launched_at,
        )  # fmt: skip
