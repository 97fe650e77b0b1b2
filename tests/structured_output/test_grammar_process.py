"""The grammar process (`StructuredOutputsConfig.grammar_process`): the same greedy tokens as the
in-process manager for a mixed batch under async scheduling, a bad schema still refused at add
time, a killed grammar process failing only the constrained requests with a message naming it,
and no shared memory left after shutdown."""

from __future__ import annotations

import os
import signal
import time

import pytest

from phloem import LLM, SamplingParams
from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.grammar_process import grammar_process_from_env
from tests.engine.test_structured_outputs import CHOICE, LABELS, NESTED, REGEX, prompts
from tests.engine.tiny_models import tiny_model_dir

C = StructuredOutputsParams


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_gp", 5)


@pytest.fixture(scope="module")
def process_llm(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=32, async_scheduling=True,
              structured_outputs_grammar_process=True)  # fmt: skip
    yield llm
    llm.close()


def batch() -> tuple[list[dict], list[SamplingParams]]:
    """Two schemas, a regex, a choice (two requests each) and two unconstrained requests."""
    cons = [C(json=NESTED), C(json=LABELS), C(regex=REGEX), C(choice=CHOICE)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
              for c in cons for _ in range(2)]  # fmt: skip
    params += [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2
    return [{"prompt_token_ids": p} for p in prompts(len(params))], params


def test_same_tokens_as_in_process(tiny_llama, process_llm):
    inputs, params = batch()
    reference = LLM(str(tiny_llama), block_size=4, max_num_batched_tokens=32)
    expected = reference.generate(inputs, params, use_tqdm=False)
    reference.close()
    got = process_llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert all(o.error is None for o in got)
    structured = process_llm.llm_engine.structured
    assert structured.process is not None and structured.manager is structured.process
    assert structured.manager.num_live == 0 and structured.times.fill_s > 0
    assert structured.num_early_fills > 0  # the step message of `collected`
    assert structured.manager.stats.num_compiled == 4  # the child's counters


def test_bad_schema_refused_at_add_time(process_llm):
    bad = SamplingParams(max_tokens=4, structured_outputs=C(json={"type": "no-such-type"}))
    with pytest.raises(ValueError, match="structured_outputs.json"):
        process_llm.llm_engine.add_request([5, 6, 7], bad)


def test_env_switch(monkeypatch):
    monkeypatch.setenv("PHLOEM_GRAMMAR_PROCESS", "1")
    assert grammar_process_from_env(False)
    monkeypatch.setenv("PHLOEM_GRAMMAR_PROCESS", "0")
    assert not grammar_process_from_env(True)
    monkeypatch.setenv("PHLOEM_GRAMMAR_PROCESS", "yes")
    with pytest.raises(ValueError, match="PHLOEM_GRAMMAR_PROCESS"):
        grammar_process_from_env(False)


def test_killed_process_fails_constrained_requests_only(process_llm):
    """Runs last on the module's engine: the grammar process is killed while constrained
    requests run; they fail naming it, the unconstrained one finishes, and shutdown leaves no
    shared memory."""
    engine = process_llm.llm_engine
    long = C(regex=r"[a-z]{30,40}")
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
              for c in (long, long)]  # fmt: skip
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts(3, seed=9), params)]
    outs: dict = {}
    bitmasks = engine.structured.times.num_bitmasks
    while engine.structured.times.num_bitmasks < bitmasks + 2:  # constrained steps ran
        outs.update({o.request_id: o for o in engine.step()})
    client = engine.structured.process  # started by the first constrained request
    os.kill(client.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        outs.update({o.request_id: o for o in engine.step()})
    assert not engine.has_unfinished_requests()
    for request_id in ids[:2]:
        assert "grammar process" in (outs[request_id].error or ""), outs[request_id]
    free = outs[ids[2]]
    assert free.error is None and len(free.outputs[0].token_ids) == 30
    names = [segment.shm.name for segment in client._segments]
    assert names and all(os.path.exists(f"/dev/shm/{name}") for name in names)
    process_llm.close()
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in names)
    assert not client._process.is_alive()


def test_bitmask_segment_grows_and_the_old_one_goes(embedded_tokenizer_dir):
    """A step of more rows than the first segment moves the fills to a larger one; the old one
    is unlinked two fills later, the last one at shutdown; the masks are the in-process
    manager's."""
    from transformers import AutoTokenizer

    from phloem.structured_output import make_backend, tokenizer_data
    from phloem.structured_output.grammar_child import GrammarProcessSpec
    from phloem.structured_output.grammar_process import GrammarProcessClient
    from phloem.structured_output.manager import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir))
    data = tokenizer_data(tok, len(tok), tok.eos_token_id)
    spec = GrammarProcessSpec("llguidance", tok.backend_tokenizer.to_str(), data.vocab_size,
                              data.stop_token_ids, 1, max_rows=8)  # fmt: skip
    client = GrammarProcessClient(spec, first_rows=2)
    local = StructuredOutputManager(make_backend(data, 1), data.vocab_size)
    ids = [f"s{i}" for i in range(5)]
    for k, seq_id in enumerate(ids):
        for manager in (client, local):
            manager.register(seq_id, C(regex=r"[a-c]+x" if k % 2 else r"\d{2}"))
    assert client.wait_ready(ids, timeout=30)
    first = client._segment.shm.name
    masks = [client.bitmask(ids[:2])[0].bitmask.copy()]
    masks.append(client.bitmask(ids)[0].bitmask.copy())  # 5 rows: a segment of 5
    assert client._segment.rows == 5 and os.path.exists(f"/dev/shm/{first}")
    assert client.accept_rows(ids, [tok.convert_tokens_to_ids("a")] * 5) == {
        0: None,
        2: None,
        4: None,
    }
    masks.append(client.bitmask(ids[1::2])[0].bitmask.copy())  # the second fill after: released
    assert not os.path.exists(f"/dev/shm/{first}")
    expected = [local.bitmask(ids[:2])[0].bitmask.copy(), local.bitmask(ids)[0].bitmask.copy()]
    local.accept_rows(ids, [tok.convert_tokens_to_ids("a")] * 5)
    expected.append(local.bitmask(ids[1::2])[0].bitmask)
    assert all((a == b).all() for a, b in zip(masks, expected))
    last = client._segment.shm.name
    client.shutdown()
    local.shutdown()
    assert not os.path.exists(f"/dev/shm/{last}") and client.dead is not None
