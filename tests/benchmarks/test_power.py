"""The power sampler of `phloem bench`: its thread, its summary and its failure modes."""

import itertools
import time

import pytest

from phloem.bench.power import PowerSampler, sample_power


def _wait(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the sampler thread did not get there"
        time.sleep(0.001)


def _reader(readings):
    cycle = itertools.cycle(readings)
    return lambda: next(cycle)


def test_sampler_summarizes_power_and_clock():
    readings = [(690.0, 1500.0), (700.0, 1320.0), (400.0, 1980.0)]
    sampler = PowerSampler(_reader(readings), power_limit_w=700.0, interval_s=0.001)
    with sampler:
        _wait(lambda: len(sampler.samples) >= 3)
    n = len(sampler.samples)
    assert n >= 3 and sampler.samples[:3] == readings
    s = sampler.summary()
    assert s["samples"] == n and s["power_limit_w"] == 700.0
    assert s["power_w"]["max"] == 700.0
    assert s["sm_clock_mhz"]["min"] == 1320.0 and s["sm_clock_mhz"]["max"] == 1980.0
    power = [p for p, _ in sampler.samples]
    assert s["capped_fraction"] == pytest.approx(sum(p >= 665.0 for p in power) / n)
    time.sleep(0.02)  # the thread has stopped: no samples after the context
    assert len(sampler.samples) == n


def test_sampler_without_limit_or_samples():
    s = PowerSampler(lambda: (1.0, 2.0), power_limit_w=None).summary()
    assert s == {"interval_s": 0.1, "samples": 0}
    sampler = PowerSampler(lambda: (100.0, 1000.0), power_limit_w=None, interval_s=0.001)
    with sampler:
        _wait(lambda: bool(sampler.samples))
    assert sampler.summary()["capped_fraction"] is None


def test_sampler_keeps_samples_when_the_reader_fails():
    calls = iter([(300.0, 1800.0)])

    def read():
        return next(calls)  # StopIteration on the second call

    sampler = PowerSampler(read, 700.0, interval_s=0.001)
    with sampler:
        _wait(lambda: sampler.error is not None)
    s = sampler.summary()
    assert s["samples"] == 1 and "StopIteration" in s["error"]
    assert s["capped_fraction"] == 0.0


def test_no_sampler_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert sample_power() is None
