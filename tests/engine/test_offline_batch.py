"""The offline batch path's setup (`LLM.generate`: encode, validate, plan, queue) and its
garbage-collection handling: bad prompts get the same ValueErrors naming their index, the
engine keeps its own copy of every queued prompt, collection is paused while a batch is built
and the batch frozen out of collection while it runs, and the process's gc state comes back
as it was (also after errors)."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest

from phloem import LLM, SamplingParams
from phloem.engine.gc_control import YOUNG_GC_THRESHOLD
from tests.engine.tiny_models import VOCAB, tiny_model_dir

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, embedded_tokenizer_dir):
    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_batch", 4)
    return LLM(str(path), block_size=4, max_num_batched_tokens=32)


def prompts(num: int = 4) -> list[dict]:
    return [{"prompt_token_ids": [3 + i, 40, 41, 42, 43, 44, 45, 7 * i + 5]} for i in range(num)]


def abort_all(llm: LLM) -> None:
    llm.llm_engine.abort_request(list(llm.llm_engine._prompts))
    assert not llm.llm_engine.has_unfinished_requests()


def run_like_a_job(llm: LLM) -> list:
    """The JSONL jobs' path: `add_requests`, then `iter_outputs`."""
    batch = [llm.encode_prompt(p) for p in prompts()]
    return list(llm.iter_outputs(llm.add_requests(batch, [PARAMS] * len(batch)), use_tqdm=False))


@pytest.fixture
def gc_state():
    """Restore the gc state a test changes; fail if a test left objects frozen."""
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()
    assert gc.get_freeze_count() == 0, "objects left frozen"


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"prompt_token_ids": [5, True]},
            "prompts[2]: prompt_token_ids must be a list of integers",
        ),
        ({"prompt_token_ids": [5, 6.0]}, "prompts[2]: prompt_token_ids must be a list of integers"),
        ({"prompt_token_ids": [False]}, "prompts[2]: prompt_token_ids must be a list of integers"),
        (
            {"prompt_token_ids": [5, np.int64(6)]},
            "prompts[2]: prompt_token_ids must be a list of integers",
        ),
        (
            {"prompt_token_ids": [5, 2**32, 7]},
            f"prompts[2]: prompt_token_ids holds ids outside the vocabulary [0, {VOCAB}): "
            f"[{2**32}]",
        ),
        (
            {"prompt_token_ids": [5, -1]},
            f"prompts[2]: prompt_token_ids holds ids outside the vocabulary [0, {VOCAB}): [-1]",
        ),
        ({"prompt_token_ids": (5, 6)}, "prompts[2]: prompt_token_ids must be a list of integers"),
        ({"prompt_token_ids": []}, "prompts[2]: prompt must contain at least one token"),
        (
            {"prompt_token_ids": [5, VOCAB, -1, 7]},
            f"prompts[2]: prompt_token_ids holds ids outside the vocabulary [0, {VOCAB}): "
            f"[{VOCAB}, -1]",
        ),
        ({"prompt_token_ids": [5] * 512}, "prompts[2]: prompt has 512 tokens but max_model_len"),
        ({"prompt": 5}, "prompts[2]: each prompt must be a string"),
    ],
)
def test_bad_prompt_named_by_index_and_nothing_queued(llm, gc_state, bad, message):
    batch = prompts(2) + [bad] + prompts(1)
    with pytest.raises(ValueError) as info:
        llm.generate(batch, PARAMS, use_tqdm=False)
    assert str(info.value).startswith(message)
    assert not llm.llm_engine.has_unfinished_requests()
    assert gc.isenabled()


def test_first_bad_prompt_is_reported(llm, gc_state):
    """Encoding and validation errors are raised in input order (validation of prompt 1 before
    the malformed prompt 2)."""
    batch = [prompts(1)[0], {"prompt_token_ids": [VOCAB + 1]}, {"prompt_token_ids": "x"}]
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt_token_ids holds ids outside"):
        llm.generate(batch, PARAMS, use_tqdm=False)


def test_sampling_params_count_checked_after_prompts(llm, gc_state):
    with pytest.raises(ValueError, match="^sampling_params has 1 entries for 3 prompts$"):
        llm.generate(prompts(3), [PARAMS], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts\[0\]"):
        llm.generate([{"prompt_token_ids": []}] + prompts(2), [PARAMS], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_errors_name_the_conversation(llm, gc_state):
    with pytest.raises(
        ValueError, match=r"^conversations\[1\]: messages\[0\]\.content is required"
    ):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user"}]], PARAMS)


def test_add_requests_still_validates_by_default(llm, gc_state):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_requests([(None, [5, 6]), (None, [VOCAB + 3, 9])], [PARAMS, PARAMS])
    abort_all(llm)  # the first one was queued


def test_engine_keeps_its_own_copy_of_each_prompt(llm, gc_state):
    """`encode_prompt` hands back the caller's list (no copy); the engine copies what it
    queues, so changing the list after `add_requests` changes no request."""
    batch = prompts(3)
    ids = batch[1]["prompt_token_ids"]
    assert llm.encode_prompt(batch[1])[1] is ids
    expected = llm.generate(batch, PARAMS, use_tqdm=False)
    original = list(ids)
    request_ids = llm.add_requests(
        [llm.encode_prompt(p) for p in batch], [PARAMS] * 3, validated=True
    )
    ids[:] = [VOCAB - 1] * len(ids)
    ids.append(9)
    outputs = llm.run_engine(request_ids, use_tqdm=False)
    assert outputs[1].prompt_token_ids == original
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]


def test_gc_paused_while_building_and_frozen_while_running(llm, gc_state, monkeypatch):
    seen = {"encode": [], "step": []}
    encode, step = llm.encode_prompt, llm.llm_engine.step

    def encode_spy(prompt):
        seen["encode"].append(gc.isenabled())
        return encode(prompt)

    def step_spy():
        seen["step"].append((gc.isenabled(), gc.get_freeze_count() > 0))
        seen.setdefault("threshold", []).append(gc.get_threshold()[0])
        return step()

    monkeypatch.setattr(llm, "encode_prompt", encode_spy)
    monkeypatch.setattr(llm.llm_engine, "step", step_spy)
    before = gc.get_threshold()
    outputs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert len(outputs) == 4 and all(o.finished for o in outputs)
    assert seen["encode"] == [False] * 4
    assert seen["step"] and all(s == (True, True) for s in seen["step"])
    assert set(seen["threshold"]) == {max(before[0], YOUNG_GC_THRESHOLD)}
    assert gc.isenabled() and gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_gc_left_off_when_it_was_off(llm, gc_state, monkeypatch):
    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    gc.disable()
    llm.generate(prompts(), PARAMS, use_tqdm=False)
    run_like_a_job(llm)
    assert not gc.isenabled() and not freezes


def test_gc_restored_after_an_error_in_a_step(llm, gc_state, monkeypatch):
    def broken_step():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.llm_engine, "step", broken_step)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    monkeypatch.undo()
    abort_all(llm)


def test_objects_frozen_by_the_process_stay_frozen(llm, gc_state, monkeypatch):
    """A process that froze its own objects (an import, or start-up as vLLM does) keeps them
    frozen: the batch is frozen too (or full collections would walk it: 0.5 s pauses on a GPU
    machine, where a library freezes objects at import) but never unfrozen with them."""
    from phloem.engine import gc_control

    monkeypatch.setattr(gc_control, "_foreign_frozen", False)  # undone below: later tests own
    gc.freeze()
    try:
        calls = []
        real_freeze = gc.freeze
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze") or real_freeze())
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        llm.generate(prompts(), PARAMS, use_tqdm=False)
        run_like_a_job(llm)
        assert calls and set(calls) == {"freeze"} and gc.get_freeze_count() > 0
    finally:
        monkeypatch.undo()
        gc.unfreeze()


def test_iter_outputs_freezes_until_the_iteration_ends(llm, gc_state):
    """`add_requests` + `iter_outputs` (the JSONL jobs' path): frozen while iterating, unfrozen
    when the iteration ends, also when the consumer stops early."""
    for stop_early in (False, True):
        batch = [llm.encode_prompt(p) for p in prompts()]
        request_ids = llm.add_requests(batch, [PARAMS] * 4, validated=True)
        assert gc.isenabled() and gc.get_freeze_count() == 0
        outputs = llm.iter_outputs(request_ids, use_tqdm=False)
        next(outputs)
        assert gc.get_freeze_count() > 0
        if stop_early:
            outputs.close()
            llm.llm_engine.abort_request(request_ids)
        else:
            assert len(list(outputs)) == 3
        assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("job", ["generate", "run-batch"])
def test_jsonl_jobs_pause_gc_while_building_and_freeze_while_running(
    llm, gc_state, monkeypatch, tmp_path, job
):
    """`phloem generate` and `phloem run-batch` build their batch (parsing, tokenizing,
    planning) with collection paused and run it frozen, as `LLM.generate` does."""
    import phloem.entrypoints.generate as generate_job
    import phloem.entrypoints.run_batch as batch_job

    seen = {"parse": [], "step": []}
    module, name = (generate_job, "parse_line") if job == "generate" else (
        batch_job, "parse_batch_line")  # fmt: skip
    parse, step = getattr(module, name), llm.llm_engine.step

    def parse_spy(*args, **kwargs):
        seen["parse"].append(gc.isenabled())
        return parse(*args, **kwargs)

    def step_spy():
        seen["step"].append((gc.isenabled(), gc.get_freeze_count() > 0))
        return step()

    monkeypatch.setattr(module, name, parse_spy)
    monkeypatch.setattr(llm.llm_engine, "step", step_spy)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    if job == "generate":
        src.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"count {i}"})
                                 for i in range(3)))  # fmt: skip
        generate_job.run_generate(llm, str(src), str(out), {"max_tokens": 2}, use_tqdm=False)
    else:
        body = {"model": "m", "prompt": "count", "max_tokens": 2}
        src.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                             "url": "/v1/completions", "body": body})
                                 for i in range(3)))  # fmt: skip
        batch_job.run_batch(llm, str(src), str(out), "m", use_tqdm=False)
    assert len(out.read_text().splitlines()) == 3
    assert seen["parse"] == [False] * 3
    assert seen["step"] and all(s == (True, True) for s in seen["step"])
    assert gc.isenabled() and gc.get_freeze_count() == 0
