"""The drafter's host cost where drafts do not pay (issue 20, results/2026-11-26f-cpu-spec-overhead):
the n-gram index's bulk extend (a prompt at once) answers as the per-token one does, and the
engine's counters of syncs for drafting and proposals stay consistent."""

from __future__ import annotations

import random

from phloem import SamplingParams
from phloem.spec_decode.ngram_proposer import NgramIndex, brute_force_lookup
from tests.spec_decode.test_spec_engine import prompts, run, tiny_llama  # noqa: F401


def test_bulk_and_per_token_extends_agree_with_the_oracle():
    rng = random.Random(3)
    for _ in range(200):
        history = [rng.randrange(4) for _ in range(rng.randrange(1, 120))]
        index, i = NgramIndex(2, 5), 0
        while i < len(history):
            j = i + rng.choice((1, 2, 15, 16, 17, 40))  # both sides of the bulk threshold
            index.extend(history[i:j])
            i = min(j, len(history))
            seen = history[:i]
            assert index.token_ids == seen
            for k in (1, 4):
                assert index.lookup(k) == brute_force_lookup(seen, 2, 5, k)


def test_no_sync_for_drafting_without_a_proposal(tiny_llama):  # noqa: F811
    """A large batch whose drafts cannot pay: no drafts verified, and every step the engine
    collected early for drafting was followed by a proposal (no sync without one)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = prompts(2, 48)
    want, _ = run(tiny_llama, None, params, batch)
    got, stats, counters = _run_with_counters(tiny_llama, spec, params, batch)
    assert got == want
    assert stats.num_draft_tokens == 0
    assert counters["num_syncs"] <= counters["num_proposals"]
    assert counters["may_draft_s"] >= 0 and counters["propose_s"] >= 0


def _run_with_counters(path, spec, params, batch):
    from phloem import LLM

    llm = LLM(str(path), speculative_config=spec, block_size=4, max_num_batched_tokens=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    drafter = llm.llm_engine.drafter
    result = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    llm.close()
    return result, drafter.stats, drafter.counters()
