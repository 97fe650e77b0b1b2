"""The draft-model proposer in the engine: greedy outputs token-identical with speculation off
(a different tiny random draft, and the target's own weights, which must accept every draft),
under preemption and async scheduling; its KV blocks are all free once requests finish, are
aborted or preempted; its cache rolls back rejected drafts (`DraftKV`); bad settings are refused
naming `speculative_config.model`."""

from __future__ import annotations

import pytest

from phloem import LLM, SamplingParams
from phloem.config import SpeculativeConfig
from phloem.model_configs import materialize
from phloem.spec_decode.cost_rule import StepTimeModel
from phloem.spec_decode.draft_kv import DraftKV
from phloem.spec_decode.drafter import Drafter
from phloem.spec_decode.proposer import Proposer
from tests.engine.tiny_models import VOCAB, tiny_model_dir
from tests.spec_decode.test_spec_engine import GREEDY, prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "dm_target", 5)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "dm_draft", 6)


def spec(model, **extra) -> dict:
    return {"model": str(model), "num_speculative_tokens": 4, "use_cost_rule": False, **extra}


def run(path, speculative, params=GREEDY, batch=None, **engine_args):
    """Outputs and drafter stats of one engine; checks the target's and the draft's caches on
    every step and that both are empty at the end."""
    # 2,048 blocks hold every batch here; the CPU default (~2M blocks) made the per-step
    # integrity check, O(blocks), the bulk of the run
    engine_args = {"block_size": 4, "max_num_batched_tokens": 32, "dtype": "float32",
                   "num_gpu_blocks": 2048, **engine_args}  # fmt: skip
    llm = LLM(str(path), speculative_config=speculative, **engine_args)
    engine = llm.llm_engine
    preempted = []

    def observe(record) -> None:
        engine.scheduler.check_integrity()
        preempted.extend(record.scheduler_output.preempted_seq_ids)
        if engine.drafter is not None:
            engine.drafter.proposer.kv.check_integrity()

    engine.add_step_observer(observe)
    batch = batch or prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert engine.kv_manager.num_reclaimable_blocks == engine.kv_manager.num_blocks
    stats = None
    if engine.drafter is not None:
        kv = engine.drafter.proposer.kv
        kv.check_integrity()
        assert kv.allocator.num_used_blocks == 0 and not kv.sequences
        stats = engine.drafter.stats
    llm.close()
    return [o.outputs[0].token_ids for o in outs], stats, preempted


@pytest.fixture(scope="module")
def baseline(target):
    """Greedy outputs without speculation (in float32 the same under every engine setting
    used here: tests/spec_decode/test_spec_engine.py checks that)."""
    return run(target, None)[0]


def test_other_draft_keeps_greedy_outputs(target, other_draft, baseline):
    got, stats, _ = run(target, spec(other_draft), async_scheduling=True)
    assert got == baseline
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # another model: some rejected


def test_target_as_its_own_draft_accepts_every_draft(target, baseline):
    got, stats, _ = run(target, spec(target), async_scheduling=False)
    assert got == baseline
    assert stats.num_draft_tokens > 50
    assert stats.acceptance_rate == 1.0


def test_preemption_frees_draft_blocks_and_keeps_outputs(target, other_draft, baseline):
    common = dict(num_gpu_blocks=30, memory_centric_admission=False)
    want = baseline
    got, stats, preempted = run(target, spec(target), **common)
    assert preempted, "the small pool must preempt"
    assert got == want and stats.acceptance_rate == 1.0
    # a draft pool too small for every request at once: eviction, some requests undrafted
    got, stats, _ = run(target, spec(other_draft, draft_num_blocks=24), **common)
    assert got == want and stats.num_draft_tokens > 0


def test_abort_frees_draft_blocks(target):
    llm = LLM(str(target), block_size=4, dtype="float32", speculative_config=spec(target))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(3, 4)]
    for _ in range(6):
        engine.step()
    kv = engine.drafter.proposer.kv
    assert kv.allocator.num_used_blocks > 0
    engine.abort_request(ids[:2])
    assert set(kv.sequences) <= set(ids[2:])
    engine.abort_request(ids[2:])
    kv.check_integrity()
    assert kv.allocator.num_used_blocks == 0
    llm.close()


def test_sampled_requests_with_greedy_drafts_are_seeded_and_repeat(target):
    """Temperature-1 rows verify one-hot (greedy) drafts (accepted with the target's
    probability of the draft, top-k 2 here; the one-hot rule's distribution is checked in
    test_rejection_sampler.py); a seeded run repeats itself."""
    params = SamplingParams(temperature=1.0, top_k=2, seed=7, max_tokens=20, ignore_eos=True)
    first, stats, _ = run(target, spec(target), params, prompts(4, 4))
    again, _, _ = run(target, spec(target), params, prompts(4, 4))
    assert first == again
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_draft_kv_rolls_back_rejected_drafts():
    kv = DraftKV(num_blocks=6, block_size=4)
    assert kv.sync("a", [1, 2, 3]) == 0
    assert kv.reserve("a", 3 + 3)  # 3 history tokens + 3 drafts: 2 blocks
    kv.append("a", [1, 2, 3], verified=True)
    kv.append("a", [7, 8, 9], verified=False)
    assert kv.allocator.num_used_blocks == 2
    assert kv.sync("a", [1, 2, 3, 7, 5]) == 4  # d_1 accepted, d_2 rejected
    assert kv.sequences["a"].token_ids == [1, 2, 3, 7]
    assert kv.allocator.num_used_blocks == 1
    assert kv.sync("a", [1, 2, 3, 7, 5]) == 4  # the last token is always fed again
    assert kv.sync("b", [4] * 9) == 0 and kv.reserve("b", 12)  # 3 blocks
    assert kv.sync("c", [1] * 16) == 0
    assert not kv.reserve("c", 16)  # 4 blocks, 2 free
    assert kv.evict_one(keep={"b", "c"}) and "a" not in kv.sequences
    assert kv.reserve("c", 12) and not kv.evict_one(keep={"b", "c"})
    kv.release("b")
    kv.release("c")
    kv.check_integrity()
    assert kv.allocator.num_used_blocks == 0


def _materialized(tmp_path, name, **shape):
    base = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    base.update(num_key_value_heads=2, vocab_size=VOCAB)
    return str(materialize("llama-3.1-8b", tmp_path / name, **{**base, **shape}))


def test_bad_draft_models_name_the_field(target, tmp_path):
    small_vocab = _materialized(tmp_path, "v", vocab_size=1024)
    with pytest.raises(ValueError, match=r"speculative_config.model .*1024.*49152"):
        LLM(str(target), speculative_config=spec(small_vocab), load_format="dummy")
    larger = _materialized(tmp_path, "l", hidden_size=256, num_hidden_layers=4)
    with pytest.raises(ValueError, match="speculative_config.model is larger"):
        LLM(str(target), speculative_config=spec(larger), load_format="dummy")
    with pytest.raises(ValueError, match="speculative_config.model .* cannot be loaded"):
        LLM(str(target), speculative_config=spec(tmp_path / "missing"), load_format="dummy")
    with pytest.raises(ValueError, match="'draft_model' needs tensor_parallel_size 1"):
        LLM(str(target), speculative_config=spec(target), tensor_parallel_size=2)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "draft_model"}, "speculative_config.model must name"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model applies"),
        ({"model": "x", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
        ({"model": "x", "draft_num_blocks": 0}, "draft_num_blocks"),
    ],
)
def test_bad_draft_settings_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        LLM(speculative_config=config, load_format="dummy")


def test_generate_cli_takes_a_draft_model(target, tmp_path):
    """`phloem generate --speculative-config '{"model": ...}'` (the method inferred): the same
    outputs as without it."""
    import json

    from phloem.entrypoints.cli import main

    texts = ["one two three one two three one", "red blue red blue red", "a b c d a b c d a"]
    lines = [json.dumps({"id": str(i), "prompt": t}) for i, t in enumerate(texts)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    args = ["generate", "--model", str(target), "--input", str(src), "--max-tokens", "12"]
    args += ["--temperature", "0", "--dtype", "float32", "--no-progress"]
    outputs = []
    for extra in ([], ["--speculative-config", json.dumps(spec(target))]):
        out = tmp_path / f"out{len(outputs)}.jsonl"
        assert main([*args, "--output", str(out), *extra]) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert all("error" not in r for r in records), records
        outputs.append({r["id"]: (r["text"], r["num_output_tokens"]) for r in records})
    assert outputs[0] == outputs[1]


def test_bench_json_reports_draft_model_counters(target, tmp_path):
    """`phloem bench throughput --speculative-config` with the target as its own draft model:
    drafts verified, every one accepted."""
    import json

    from phloem.entrypoints.bench import main

    args = ["throughput", "--model", str(target), "--device", "cpu", "--dtype", "float32"]
    args += ["--workload", "decode-heavy", "--num-requests", "3", "--input-len", "20"]
    args += ["--output-len", "20", "--num-gpu-blocks", "64"]
    out = tmp_path / "spec.json"
    assert main([*args, "--speculative-config", json.dumps(spec(target)), "--json", str(out)]) == 0
    counts = json.loads(out.read_text())["spec_decode"]
    assert counts["num_draft_tokens"] > 0 and counts["acceptance_rate"] == 1.0


class _Recording(Proposer):
    """A costly proposer that drafts token 5 as often as asked and records the budgets."""

    costly = True

    def __init__(self) -> None:
        self.asked: list[dict[str, int]] = []

    def propose(self, requests):
        self.asked.append({r.request_id: r.max_draft_tokens for r in requests})
        return [[5] * r.max_draft_tokens for r in requests]

    def finish(self, request_id: str) -> None:
        pass


def test_a_costly_proposer_is_asked_only_for_the_drafts_the_rule_chooses():
    from tests.spec_decode.test_spec_drafter import decoding

    model = StepTimeModel(t_host_s=1e-3, t_weights_s=0.0, c_token_s=1e-3, c_kv_s=0.0)
    proposer = _Recording()  # every draft costs a token's compute: a bad one does not pay
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3), model, 64, proposer)
    greedy = SamplingParams(temperature=0)
    rows = [decoding("good", greedy), decoding("bad", greedy)]
    for _ in range(20):
        drafter.tracker.observe("good", 3, 3)
        drafter.tracker.observe("bad", 3, 0)
    assert drafter.propose(rows) == 3
    assert proposer.asked == [{"good": 3, "bad": 0}]
    assert rows[0].draft_token_ids == [5, 5, 5] and rows[1].draft_token_ids == []
    plain = Drafter(SpeculativeConfig(num_speculative_tokens=3, use_cost_rule=False), model, 64,
                    proposer)  # fmt: skip
    plain.propose(rows)
    assert proposer.asked[-1] == {"good": 3, "bad": 3}
