"""Data parallelism with contiguous routing (vLLM's slicing, the baseline prefix routing is measured
against): each replica gets its slice packed without a plan and plans it itself; outputs equal one
engine's token for token, with their prompts put back; each replica's slice is in input order."""

from __future__ import annotations

import pytest

from phloem import LLM
from tests.engine.test_data_parallel import SETTINGS, _tokens, prefix_heavy_batch
from tests.engine.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_dpc", 5)


def test_contiguous_slices_plan_themselves_and_match_one_engine(tiny_llama):
    prompts, params = prefix_heavy_batch(seed=2)
    one = LLM(str(tiny_llama), **SETTINGS)
    expected = one.generate(prompts, params, use_tqdm=False)
    with LLM(str(tiny_llama), data_parallel_size=2, data_parallel_routing="contiguous",
             **SETTINGS) as two:  # fmt: skip
        got = two.generate(prompts, params, use_tqdm=False)
        report = two.last_replica_report
    assert _tokens(got) == _tokens(expected)
    assert [o.prompt_token_ids for o in got] == [p["prompt_token_ids"] for p in prompts]
    assert report.deal.share_groups is None  # no driver plan travels
    half = len(prompts) // 2
    assert report.deal.shares == [list(range(half)), list(range(half, len(prompts)))]
    assert all(0 < s.received_s <= s.queued_s for s in report.replicas)
