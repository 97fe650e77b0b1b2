"""Where a worker's start-up goes: wall time per phase, marked as each ends and logged as one line
(issue 19: the weights' load reported apart from compiling kernels and capturing graphs).

    phases = StartupPhases()
    load_model(...);        phases.mark("weights")
    prebuild.wait();        phases.mark("setup_and_flashinfer_wait")
    triton_prebuild.wait(); phases.mark("triton_wait")
    ...
    capture(...);           phases.finish("cuda_graphs")
    # INFO phloem.worker.startup_phases: start-up phases [s]: {"weights": 12.1, ..., "total": ..}

The line is JSON after the colon, so a benchmark can read it from the log
(`benchmarks/startup_gpu.py`).
"""

from __future__ import annotations

import json
import logging
import time

logger = logging.getLogger(__name__)

LOG_PREFIX = "start-up phases [s]: "


class StartupPhases:
    """Seconds per named phase, in the order marked (a name marked again adds to its total)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """End the phase `name` now: it took the time since the previous mark (or the start)."""
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def finish(self, name: str, **extra: float) -> None:
        """End the last phase `name` (`mark`) and log every phase and the total at INFO, one
        line (`LOG_PREFIX` then JSON); `extra`: other figures to report beside them [s] (e.g.
        the background prebuild's own time)."""
        self.mark(name)
        record = {name: round(s, 3) for name, s in self.seconds.items()}
        record["total"] = round(sum(self.seconds.values()), 3)
        record.update({name: round(v, 3) for name, v in extra.items()})
        logger.info("%s%s", LOG_PREFIX, json.dumps(record))


def parse_phases(log_text: str) -> list[dict[str, float]]:
    """Every start-up phase record in a log's text (one per worker that started), in order."""
    return [
        json.loads(line.split(LOG_PREFIX, 1)[1])
        for line in log_text.splitlines()
        if LOG_PREFIX in line
    ]
