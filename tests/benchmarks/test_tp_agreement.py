"""benchmarks/tp_agreement.py: the margin-filtered and top-5 ("close") agreement measures, and a
reference/check round trip of one engine against itself on a tiny model (agreement 1.0)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tp_agreement  # noqa: E402

from tests.engine.tiny_models import write_tiny_model  # noqa: E402


def test_compare_counts_margins_and_top5_closeness():
    want = [1, 2, 3, 4]
    ref_top = [  # margins 2.0, 0.005, 0.05, and a one-entry top
        [[1, -0.1], [9, -2.1]],
        [[2, -0.69], [7, -0.695]],
        [[3, -0.6], [8, -0.65]],
        [[4, -0.01]],
    ]
    got = [1, 7, 5, 4]  # position 1 flips to the reference's runner-up; 2 to a stranger
    got_top = [[[1, -0.1]], [[7, -0.69], [2, -0.70]], [[5, -0.5], [3, -0.7]], [[4, -0.02]]]
    r = tp_agreement.compare(want, ref_top, got, got_top)
    assert r["agreement_by_margin"]["0.0"] == {"positions": 4, "agreement": 0.5}
    assert r["agreement_by_margin"]["0.01"] == {"positions": 3, "agreement": 2 / 3}
    assert r["agreement_by_margin"]["0.1"] == {"positions": 2, "agreement": 1.0}
    assert r["close_agreement"] == 0.75  # 5 is not in the reference's top-5
    assert r["mean_abs_logprob_diff"] == pytest.approx((0 + 0.01 + 0.1 + 0.01) / 4)


def test_one_engine_agrees_with_its_own_reference(tmp_path, embedded_tokenizer_dir, monkeypatch):
    write_tiny_model("llama", tmp_path / "m", embedded_tokenizer_dir, seed=3)
    common = ["--model", str(tmp_path / "m"), "--num-prompts", "3", "--prompt-len", "8",
              "--max-tokens", "6", "--stride", "2", "--enforce-eager"]  # fmt: skip
    ref, out = tmp_path / "ref.json", tmp_path / "check.json"
    monkeypatch.setattr(sys, "argv", ["tp_agreement", "reference", *common, "--out", str(ref)])
    tp_agreement.main()
    monkeypatch.setattr(
        sys, "argv", ["tp_agreement", "check", *common, "--ref", str(ref), "--out", str(out)]
    )
    tp_agreement.main()
    reference, result = json.loads(ref.read_text()), json.loads(out.read_text())
    assert len(reference["top_logprobs"][0]) == 6 and len(reference["top_logprobs"][0][0]) == 5
    assert result["teacher_forced_positions"] == 9
    assert result["teacher_forced_agreement"] == 1.0 and result["close_agreement"] == 1.0
    assert result["free_running_exact"] == 1.0
    assert result["mean_abs_logprob_diff"] < 1e-3
