"""Speculative decoding in the engine changes no greedy output: token for token equal with it
off, for the n-gram and the suffix proposer, with prefix sharing, chunked prefill, preemption,
async scheduling, stop strings and mixed sampling settings (tiny random model, and the embedded
SmolLM2 on a copy prompt); seeded sampling with drafts is reproducible; bad settings are
refused naming the field."""

from __future__ import annotations

import random

import pytest

from phloem import LLM, SamplingParams
from tests.engine.tiny_models import VOCAB, tiny_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "use_cost_rule": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "use_cost_rule": False}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_spec", 5)


def prompts(seed: int = 0, num: int = 8) -> list[list[int]]:
    """Repetitive prompts (so prompt lookup finds matches), half behind a shared system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(20)]
    out = []
    for i in range(num):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
        out.append((system if i % 2 else []) + motif * rng.randint(2, 4))
    return out


def run(path, spec, params, batch=None, **engine_args):
    # 2,048 blocks hold every batch here without preemption; the CPU default (~2M blocks of the
    # tiny model) made the per-step integrity check, O(blocks), ~0.5 s a step
    engine_args = {"block_size": 4, "max_num_batched_tokens": 32, "num_gpu_blocks": 2048,
                   **engine_args}  # fmt: skip
    llm = LLM(str(path), speculative_config=spec, **engine_args)
    engine = llm.llm_engine
    engine.add_step_observer(lambda record: engine.scheduler.check_integrity())  # every step
    batch = batch or prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    engine.scheduler.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_reclaimable_blocks == engine.kv_manager.num_blocks
    stats = engine.drafter.stats if engine.drafter is not None else None
    llm.close()  # TP ranks stop now (the integrity observer's closure keeps the engine alive)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], stats


GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_outputs_equal_with_speculation_off(tiny_llama, spec, async_scheduling):
    want, _ = run(tiny_llama, None, GREEDY, async_scheduling=async_scheduling)
    got, stats = run(tiny_llama, spec, GREEDY, async_scheduling=async_scheduling)
    assert got == want
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens > 5


def test_greedy_equal_under_preemption_and_without_prefix_caching(tiny_llama):
    common = dict(num_gpu_blocks=30, memory_centric_admission=False)
    want, _ = run(tiny_llama, None, GREEDY, **common)
    got, stats = run(tiny_llama, NGRAM, GREEDY, **common)
    assert got == want and stats.num_accepted_tokens > 0
    got, _ = run(tiny_llama, SUFFIX, GREEDY, enable_prefix_caching=False)
    assert got == want


def test_stop_strings_and_tokens_inside_accepted_drafts(tiny_llama):
    base, _ = run(tiny_llama, None, GREEDY)
    text = next(o[0][1] for o in base if len(o[0][1]) > 30)
    stop_token = base[0][0][0][12]  # a token the first output emits mid-way
    params = SamplingParams(
        temperature=0, max_tokens=30, stop=[text[10:14]], stop_token_ids=[stop_token]
    )
    want, _ = run(tiny_llama, None, params)
    got, _ = run(tiny_llama, NGRAM, params)
    assert got == want
    assert {o[0][2] for o in want} >= {"stop"}


def test_mixed_settings_keep_the_greedy_rows_and_seeded_runs_repeat(tiny_llama):
    """Greedy rows beside seeded, logprobs, penalty and n = 2 rows (which draft or not by the
    drafter's rule) are unchanged; seeded sampling with drafts repeats itself."""
    batch = prompts(1, 4)
    mixed = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, n=2, top_k=20),
        SamplingParams(temperature=0, max_tokens=20, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=20, repetition_penalty=1.2),
    ]
    llm = LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=32, speculative_config=NGRAM)
    ask = [{"prompt_token_ids": p} for p in batch]
    first = llm.generate(ask, mixed, use_tqdm=False)
    again = llm.generate(ask, mixed, use_tqdm=False)
    plain = LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=32)
    base = plain.generate(ask, mixed, use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in (first, again, base)[0]]
    assert tokens == [[c.token_ids for c in o.outputs] for o in again]
    for i in (0, 2, 3):  # greedy, logprobs (not drafted), penalties (not drafted)
        assert first[i].outputs[0].token_ids == base[i].outputs[0].token_ids
    assert first[2].outputs[0].logprobs == base[2].outputs[0].logprobs
    assert llm.llm_engine.drafter.stats.num_draft_tokens > 0


def test_the_cost_rule_turns_drafts_off_when_they_cannot_pay(tiny_llama):
    """With the cost rule on, a large batch on a model past its knee verifies no drafts."""
    batch = prompts(2, 48)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want, _ = run(tiny_llama, None, params, batch)
    got, stats = run(tiny_llama, spec, params, batch, max_num_batched_tokens=512)
    assert got == want
    assert stats.num_draft_tokens == 0


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"k": 3}, "unknown key"),
    ],
)
def test_bad_settings_name_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        LLM(speculative_config=spec, load_format="dummy")


def test_embedded_model_copy_prompt_greedy_equal(embedded_llm):
    """The embedded SmolLM2-135M rewriting a given text: n-gram and suffix drafts are accepted
    and the outputs are the plain engine's, token for token."""
    text = (
        "The committee met on Tuesday to review the budget. It approved the new library, "
        "postponed the road repairs, and asked the treasurer for a report on the pension fund."
    )
    prompt = f"Copy this text exactly.\n\nText: {text}\n\nCopy: "
    params = SamplingParams(temperature=0, max_tokens=40)
    want = embedded_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    for spec in (NGRAM, SUFFIX):
        llm = LLM(max_num_batched_tokens=64, dtype="float32", speculative_config=spec)
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want, spec["method"]
        assert llm.llm_engine.drafter.stats.num_accepted_tokens > 10


def test_tensor_parallel_ranks_verify_alike(tiny_llama):
    """TP = 2 on gloo: the drafts travel in the step's data and every rank verifies them the
    same way (a rank that accepted differently would desynchronize the group's sequence
    state): greedy equals TP = 2 without drafts, for sequences that draft and accept."""
    batch = prompts(3, 4)
    tp = dict(tensor_parallel_size=2, dtype="float32")
    want, _ = run(tiny_llama, None, GREEDY, batch, **tp)
    got, stats = run(tiny_llama, NGRAM, GREEDY, batch, **tp)
    assert got == want and stats.num_accepted_tokens > 0
