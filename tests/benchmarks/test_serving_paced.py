"""benchmarks/serving_paced.py: the paced executor stands in for the model under the real engine
(scheduler, online prefix groups, async scheduling): requests arriving together with a common
prefix compute it once and every request gets its tokens; a bad step model is refused."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from phloem import SamplingParams
from phloem.engine.llm_engine import LLMEngine, OutputMode
from phloem.engine_args import EngineArgs
from tests.engine.tiny_models import VOCAB, tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serving_paced  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_paced", 3)


def test_paced_engine_shares_the_prefix_and_finishes(model_path, monkeypatch) -> None:
    monkeypatch.setenv("PACED_STEP_MODEL", "0,1,1")
    args = EngineArgs(str(model_path), block_size=4, max_num_batched_tokens=64)
    engine = LLMEngine(
        args.create_engine_config(),
        executor_factory=serving_paced.PacedExecutor,
        output_mode=OutputMode.DELTA,
    )
    rng = random.Random(0)
    prefix = [rng.randrange(3, VOCAB) for _ in range(12)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(5)] for _ in range(6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"r{i}")
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for seq in delta.seqs:
                tokens[delta.request_id] += seq.token_ids
    assert all(len(t) == 4 and all(1000 <= x < 20000 for x in t) for t in tokens.values())
    assert engine.num_computed_prompt_tokens == 12 + 6 * 5  # the prefix once
    engine.scheduler.check_integrity()


def test_step_model_is_checked(monkeypatch) -> None:
    monkeypatch.setenv("PACED_STEP_MODEL", "2,24")
    with pytest.raises(ValueError, match="PACED_STEP_MODEL"):
        serving_paced.step_model()
    monkeypatch.setenv("PACED_STEP_MODEL", "2,-1,3")
    with pytest.raises(ValueError, match=">= 0"):
        serving_paced.step_model()
    monkeypatch.setenv("PACED_STEP_MODEL", "2,24,38")
    assert serving_paced.step_model() == pytest.approx((2e-3, 24e-6, 38e-6))
