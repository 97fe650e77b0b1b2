"""Quality of `quantization="fp8"` and of `kv_cache_dtype="fp8"` on the embedded SmolLM2-135M
(float32, CPU), teacher-forced over the first 256 tokens of held-out English text
(`benchmarks/fp8_quality.py`; that script measures 2,000 tokens and writes the result to
benchmarks/results/).

Thresholds are set from measurement, not from issue 18's bar (top-1 agreement >= 0.97,
perplexity within 2%), which this model does not meet under FP8 W8A8: measured 0.875 / +5.6% on
these 256 tokens and 0.920 / +2.4% on 2,000, where the same model run in bfloat16 scores 0.973 /
+0.3% (its logits have many near-ties: quantizing the last layer alone moves top-1 agreement
to 0.95; where the dense model's top two logits are at least 1 apart, W8A8 agrees on 99.9% of
2,000 tokens: benchmarks/results/2026-11-26-cpu-fp8-quality). A wrong scale, a transposed
weight or unquantized activations where quantized ones are expected score far below these
bounds or, for the last, exactly 1.0 (hence the upper one).
"""

from __future__ import annotations

import pytest

from benchmarks.fp8_quality import measure


@pytest.mark.slow
def test_fp8_quality_on_the_embedded_model(embedded_tokenizer_dir):  # skips without the model
    result = measure(256, fp8_kv=True, xqa=True)
    assert result["num_tokens"] == 256
    assert 0.80 <= result["top1_agreement"] < 1.0, result
    assert 1.0 < result["perplexity_ratio"] <= 1.10, result
    # The FP8 KV cache (scale 1: the embedded checkpoint has no KV scales), alone and on top of
    # W8A8: measured 0.945 / +2.0% and 0.890 / +6.4% on these 256 tokens (0.938 / +1.4% and
    # 0.893 / +3.9% on 2,000). A cache read as the wrong type scores near 0; one left unquantized
    # scores exactly 1.0.
    kv, both = result["fp8_kv"], result["w8a8_fp8_kv"]
    assert 0.85 <= kv["top1_agreement"] < 1.0 and 1.0 < kv["perplexity_ratio"] <= 1.06, kv
    assert 0.80 <= both["top1_agreement"] < 1.0 and 1.0 < both["perplexity_ratio"] <= 1.12, both
    # The FP8 cache read with XQA's rounding of the query and P (`XqaEmulatedAttention`):
    # measured 0.929 / +1.5%, KL 0.011 against the FP8 cache's 0.008 (2,000 tokens: 0.922 /
    # +1.4%: benchmarks/results/2026-11-27f-cpu-xqa-quality). An emulation that rounds
    # nothing more than the cache scores the FP8 run's KL exactly.
    xqa = result["fp8_kv_xqa"]
    assert 0.85 <= xqa["top1_agreement"] < 1.0 and 1.0 < xqa["perplexity_ratio"] <= 1.06, xqa
    assert xqa["kl_divergence"] > kv["kl_divergence"], (xqa, kv)
