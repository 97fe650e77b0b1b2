"""The held constrained step sampled behind a wait for its bitmask's fill
(`engine/device_wait.py`, PHLOEM_CONSTRAINED_DEVICE_WAIT). On the CPU the wait is a host wait at
the same point of the deferred sampling (`=host`), so these runs walk the switch's order: the
sampling enqueued before the fill ends, the fill's host results applied at collection, and
every path that abandons a step releasing the flag (bounded: a lost flag times out and raises,
which the fault tests would see instead of their own error). The outputs with the switch on
equal those without: tests/engine/test_structured_outputs.py
`test_next_step_prepared_beside_the_fill_and_sampling_unchanged`."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from phloem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from phloem.engine import device_wait
from phloem.engine.llm_engine import LLMEngine
from phloem.structured_output.manager import GrammarBitmask
from tests.engine.test_structured_outputs import (  # noqa: F401 - tiny_llama: a fixture
    OrderExecutor,
    add,
    assert_consistent,
    assert_idle,
    finish,
    step_until_held,
    tiny_llama,
)


def engine_with(model_dir, mode: str, **cache) -> LLMEngine:
    """An async-scheduling engine on `model_dir` with PHLOEM_CONSTRAINED_DEVICE_WAIT=`mode`."""
    config = EngineConfig(
        model=ModelConfig(str(model_dir)),
        cache=CacheConfig(block_size=4, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, async_scheduling=True),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(device_wait.ENV, mode)
        engine = LLMEngine(config, executor_factory=OrderExecutor)
    engine.executor.structured = engine.structured
    return engine


@pytest.fixture(scope="module")
def wait_engine(tiny_llama):  # noqa: F811 - the imported fixture
    engine = engine_with(tiny_llama, "host", num_gpu_blocks=256)
    engine.structured.device_wait.timeout_s = 20.0  # a lost flag: RuntimeError, not a hang
    expected = finish(engine, add(engine))
    assert_idle(engine)
    yield engine, expected
    engine.close()


@pytest.mark.parametrize("where", ["launch", "fill"])
def test_abandoned_or_failed_step_releases_the_flag(wait_engine, where):
    """A fault of the launch after the held step's deferred sampling was enqueued (it is then
    dropped: `abort_all`), or an exception out of the fill (it sets the flag; the step raises
    the fill's error at collection): no wait is left behind, and a new batch's outputs equal a
    run without the fault."""
    engine, expected = wait_engine
    add(engine)
    step_until_held(engine)
    waits = engine.structured.device_wait
    if where == "launch":
        engine.executor.fail_next = "launch"
        match = "injected fault in launch"
    else:
        manager = engine.structured.manager

        def failing(seq_ids, out=None):
            del manager.bitmask  # once
            raise RuntimeError("injected fill fault")

        manager.bitmask = failing
        match = "injected fill fault"
    with pytest.raises(RuntimeError, match=match):
        for _ in range(3):  # the fault may surface one step() later (at collection)
            engine.step()
    assert waits.flag.words[0] == waits._seq and waits.flag.words[1] == 0
    engine.abort_all()
    assert waits.pending is None
    assert_consistent(engine)
    assert finish(engine, add(engine)) == expected
    assert_idle(engine)


def test_release_and_failed_fill_end_a_wait():
    """`DeviceWait` alone: a wait whose fill never ends returns on `release`; one whose fill
    raises returns (the callback), and `settle` raises the fill's error; one that times out
    writes the error word and `settle` raises."""
    waits = device_wait.DeviceWait(on_device=False, timeout_s=20.0)

    class Sampler:  # an executor whose "device" runs the wait in a thread
        def sample(self, handle, grammar, wait=None):
            self.grammar, self.thread = grammar, threading.Thread(target=wait)
            self.thread.start()

    class Launched:
        handle, scheduler_output = None, object()

    executor = Sampler()
    for end in ("release", "raise", "timeout"):
        launched, fill = Launched(), concurrent.futures.Future()
        waits.reserve(launched.scheduler_output, 2, 3)
        waits.timeout_s = 0.05 if end == "timeout" else 20.0
        waits.start(executor, launched, ["a", "b"], fill)
        assert executor.grammar.bitmask.shape == (2, 3)
        if end != "timeout":
            time.sleep(0.05)
            assert executor.thread.is_alive()  # waiting for the flag
        if end == "release":
            waits.release()
        elif end == "raise":
            fill.set_exception(ValueError("fill failed"))
        executor.thread.join(10.0)
        assert not executor.thread.is_alive()
        if end == "raise":
            with pytest.raises(ValueError, match="fill failed"):
                waits.settle(launched.scheduler_output)
        elif end == "timeout":
            fill.set_result((GrammarBitmask(["a", "b"], executor.grammar.bitmask), {}))
            assert waits.flag.words[1] == waits._seq
            with pytest.raises(RuntimeError, match="waited over"):
                waits.settle(launched.scheduler_output)
    assert waits.pending is None


def test_mode_from_env(monkeypatch):
    gpu = "device" if torch.cuda.is_available() else None  # "1" without a GPU: off
    for value, mode in (("0", None), ("host", "host"), ("1", gpu)):
        monkeypatch.setenv(device_wait.ENV, value)
        assert device_wait.device_wait_mode() == mode
    monkeypatch.setenv(device_wait.ENV, "yes")
    with pytest.raises(ValueError, match=device_wait.ENV):
        device_wait.device_wait_mode()
