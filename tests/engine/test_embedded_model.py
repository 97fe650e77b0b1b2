"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end: chat template, stop
strings and n, prefix sharing on and off (greedy vs transformers: tests/models/test_gguf.py)."""

from __future__ import annotations

import pytest

from phloem import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why do cats purr?"},
    ],
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(embedded_llm):
    return embedded_llm  # the session's engine: max_num_batched_tokens=64 (see conftest)


def test_chat_template_not_double_bos(llm):
    text, ids = llm.encode_chat(PROMPTS[0])
    tokenizer = llm.get_tokenizer()
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]


def test_stop_strings_and_n(llm):
    prompt = "List the numbers from one to ten, separated by commas: one, two,"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert "five" in text
    stopped = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, stop=["five"]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "five"
    assert "five" not in stopped.text and text.startswith(stopped.text)

    long_prompt = "Here is a short story about a lighthouse keeper and a storm. " * 4
    many = llm.generate(
        long_prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False
    )[0]
    assert [o.index for o in many.outputs] == [0, 1, 2]
    again = llm.generate(
        long_prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False
    )[0]
    assert [o.token_ids for o in many.outputs] == [o.token_ids for o in again.outputs]
    assert many.num_cached_tokens > 0, "children should share the prompt's full blocks"


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=123, max_tokens=12)
    alone = llm.generate("Tell me a fact about owls.", params, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batch = llm.generate(
        ["Hello there.", "Tell me a fact about owls.", "Count to five."],
        [others, params, others],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    # behind another seeded request (their seed streams are drawn together, in one kernel)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12)
    out = llm.generate(["Count to five.", "Tell me a fact about owls."], [seeded, params],
                       use_tqdm=False)  # fmt: skip
    assert out[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_max_tokens_min_tokens_and_logprobs(llm):
    out = llm.generate(
        "Say hi.",
        SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logprobs=2),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert len(out.logprobs) == 5
    for token, top in zip(out.token_ids, out.logprobs):
        assert token in top and len(top) in (2, 3)
    assert out.cumulative_logprob == pytest.approx(
        sum(t[tok] for tok, t in zip(out.token_ids, out.logprobs))
    )
    assert out.cumulative_logprob < 0


def test_prompt_too_long_raises(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * (llm.llm_engine.max_model_len + 1)}, use_tqdm=False)


def test_prefix_sharing_on_off_identical(llm):
    system = {
        "role": "system",
        "content": "You are a museum guide. Answer visitors' questions about the paintings in "
        "the east wing in one or two sentences, politely, and mention the room number.",
    }
    questions = ["Where is the Monet?", "Is photography allowed?", "Who painted the sunflowers?"]
    chats = [[system, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=12)
    shared = llm.chat(chats, params, use_tqdm=False)
    assert llm.last_plan is not None and llm.last_plan.shared_groups
    assert all(o.num_cached_tokens > 0 for o in shared[1:]) or shared[0].num_cached_tokens > 0
    plain = LLM(enable_prefix_caching=False, dtype="float32").chat(chats, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in shared] == [o.outputs[0].token_ids for o in plain]
