"""GPU power draw and SM clock sampled through a benchmark run, beside the roofline's ceilings.

The ceilings (shared/docs/ROOFLINE.md) are measured in a ~15 ms burst, at the clock an idle GPU
boosts to; a long run of large batches may instead sit at the board's power limit, with the SM
clock well below that (an H200 at 700 W: ~1.5 GHz against 1.98, benchmarks/results/2026-11-25-h200).
There, a kernel that only hides latency better bought nothing end to end (a same-run A/B in that
results folder), while less work or traffic would: every GPU result should say which regime it
ran in. `PowerSampler` polls in a daemon thread (NVML through torch.cuda.power_draw / clock_rate,
which need nvidia-ml-py) and summarizes.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from typing import Any

Reading = tuple[float, float]  # (power [W], SM clock [MHz])

CAPPED_FRACTION_OF_LIMIT = 0.95  # a sample this close to the power limit counts as capped


def nvml_reader(device: Any = None) -> tuple[Callable[[], Reading], float | None]:
    """(read, power limit [W] or None) for a CUDA device through NVML.

    Raises:
        RuntimeError / ModuleNotFoundError: no CUDA device, or nvidia-ml-py is not installed
            (torch.cuda.power_draw imports it).
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0

    def read() -> Reading:
        return torch.cuda.power_draw(index) / 1000.0, float(torch.cuda.clock_rate(index))

    read()  # fails here, not in the thread, when NVML is missing
    limit = None
    try:  # torch's own NVML handle: the same device numbering as power_draw
        import pynvml

        handle = torch.cuda._get_pynvml_handler(index)
        limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    except Exception:  # the limit is context; the samples stand without it
        pass
    return read, limit


class PowerSampler:
    """Calls `read()` every `interval_s` seconds in a daemon thread while the context is open.

    Args:
        read: returns (power [W], SM clock [MHz]).
        power_limit_w: the board's enforced limit, for the capped fraction (None: unknown).
        interval_s: sampling period [s] (NVML itself refreshes power about every 100 ms).
    """

    def __init__(
        self,
        read: Callable[[], Reading],
        power_limit_w: float | None = None,
        interval_s: float = 0.1,
    ) -> None:
        self.read = read
        self.power_limit_w = power_limit_w
        self.interval_s = interval_s
        self.samples: list[Reading] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception as e:  # keep what was sampled; say why it stopped
                self.error = f"{type(e).__name__}: {e}"
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PowerSampler:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="phloem-power", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        """JSON-ready: sample count, power [W] p50/max, SM clock [MHz] p50/min/max, the limit and
        the fraction of samples within `CAPPED_FRACTION_OF_LIMIT` of it (None without a limit)."""
        out: dict = {"interval_s": self.interval_s, "samples": len(self.samples)}
        if self.error:
            out["error"] = self.error
        if not self.samples:
            return out
        power = [p for p, _ in self.samples]
        clock = [c for _, c in self.samples]
        out["power_w"] = {"p50": statistics.median(power), "max": max(power)}
        out["sm_clock_mhz"] = {
            "p50": statistics.median(clock),
            "min": min(clock),
            "max": max(clock),
        }
        out["power_limit_w"] = self.power_limit_w
        out["capped_fraction"] = None
        if self.power_limit_w:
            near = CAPPED_FRACTION_OF_LIMIT * self.power_limit_w
            out["capped_fraction"] = sum(p >= near for p in power) / len(power)
        return out


def sample_power(device: Any = None, interval_s: float = 0.1) -> PowerSampler | None:
    """A `PowerSampler` over NVML for `device`, or None where NVML cannot be read (no GPU, no
    nvidia-ml-py): power is context for a result, never a reason to fail it."""
    try:
        read, limit = nvml_reader(device)
    except Exception:
        return None
    return PowerSampler(read, limit, interval_s)
