"""`phloem bench throughput --speculative-config JSON` reports speculative decoding's counters in
its JSON (`spec_decode`: verify rows, drafted and accepted tokens, acceptance rate, the drafter's
host costs); a run without it reports null."""

from __future__ import annotations

import json

from phloem.entrypoints.bench import main
from phloem.model_configs import materialize


def test_bench_json_has_spec_decode_counters(tmp_path):
    model = materialize(
        "llama-3.1-8b", tmp_path / "m", num_hidden_layers=1, hidden_size=64,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=1024,
    )  # fmt: skip
    args = ["throughput", "--model", str(model), "--load-format", "dummy", "--device", "cpu"]
    args += ["--workload", "decode-heavy", "--num-requests", "3", "--input-len", "20"]
    args += ["--output-len", "20", "--num-gpu-blocks", "64"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "use_cost_rule": False}
    out = tmp_path / "spec.json"
    assert main([*args, "--speculative-config", json.dumps(spec), "--json", str(out)]) == 0
    counts = json.loads(out.read_text())["spec_decode"]
    assert counts["num_draft_tokens"] > 0  # random weights soon repeat a token
    assert 0 <= counts["num_accepted_tokens"] <= counts["num_draft_tokens"]
    assert set(counts) >= {"acceptance_rate", "mean_accepted_length", "num_spec_steps"}
    assert counts["num_verify_graph_replays"] == 0  # the CPU captures no verify graphs
    # the drafter's host costs, the run's own share
    assert 0 < counts["num_proposals"] <= 3 * 20  # at most one a step, 60 tokens in all
    assert counts["propose_s"] > 0 and counts["may_draft_s"] >= 0 and counts["num_syncs"] >= 0
    out = tmp_path / "plain.json"
    assert main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["spec_decode"] is None
