"""`server._merged`, the outputs of a request's several prompts: a slow consumer gets each
prompt's newest output (at most one pending per prompt, nothing queued per step), every prompt's
last output, and a prompt's error."""

from __future__ import annotations

import asyncio

import pytest

from phloem.entrypoints.openai.responses import PreparedRequest
from phloem.entrypoints.openai.server import _merged
from phloem.sampling_params import SamplingParams


class _Engine:
    """`generate` yields `steps` cumulative outputs (ints 1..steps), one per loop turn."""

    def __init__(self, steps: int, fail: str | None = None) -> None:
        self.steps, self.fail = steps, fail

    async def generate(self, ids, params, request_id, prompt, arrival):
        for step in range(1, self.steps + 1):
            await asyncio.sleep(0)
            if request_id == self.fail and step == 3:
                raise RuntimeError("failed")
            yield step


def _prep(num: int) -> PreparedRequest:
    ids = [f"r-{i}" for i in range(num)]
    return PreparedRequest(ids, [(None, [1])] * num, [SamplingParams()] * num, None)


def test_slow_consumer_gets_the_newest_and_the_last() -> None:
    async def consume():
        seen = []
        async for index, output in _merged(_Engine(200), _prep(3), 0.0):
            seen.append((index, output))
            await asyncio.sleep(0.002)  # slower than the engine
        return seen

    seen = asyncio.run(consume())
    for index in range(3):
        mine = [output for i, output in seen if i == index]
        assert mine == sorted(mine) and mine[-1] == 200
    assert len(seen) < 3 * 50  # coalesced: nowhere near one item per step


def test_error_of_one_prompt_is_raised() -> None:
    async def consume():
        async for _ in _merged(_Engine(10, fail="r-1"), _prep(2), 0.0):
            pass

    with pytest.raises(RuntimeError, match="failed"):
        asyncio.run(consume())
