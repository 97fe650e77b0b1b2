"""Calibrated FP8 KV scales (`kv_cache_scales="calibrate"`, issue 18): at load, each layer
without checkpoint scales gets margin * amax / 448 of its K and V over one pass on the built-in
paragraph (`phloem.worker.kv_calibration`); checkpoint scales are kept; the option is refused
without an FP8 cache; greedy tokens repeat across engine starts."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from phloem import LLM, SamplingParams
from phloem.config import CacheConfig
from phloem.engine_args import EngineArgs
from phloem.layers.attention import Attention
from phloem.models.loader import load_tokenizer, resolve_model
from phloem.worker import kv_calibration as cal
from tests.engine.tiny_models import VOCAB, tiny_model_dir

PROMPTS = [[5, 17, 300, 42, 9], [7, 1000, 23, 4, 4, 81, 12], [3, 3, 3]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_kvcal", 11)


def start(path, **kwargs):
    """An engine on `path` with an FP8 cache and calibrated scales; (model, its attention
    layers, greedy tokens of `PROMPTS`)."""
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20,
              kv_cache_dtype="fp8", kv_cache_scales="calibrate", **kwargs)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    model = llm.llm_engine.executor.worker.model_runner.model
    layers = sorted((m for m in model.modules() if isinstance(m, Attention)),
                    key=lambda m: m.layer_idx)  # fmt: skip
    return model, layers, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def calibrated(tiny_llama):
    return start(tiny_llama)


def test_scales_follow_the_calibration_pass_amax(calibrated, tiny_llama):
    model, layers, _ = calibrated
    ids = cal.calibration_token_ids(load_tokenizer(resolve_model(str(tiny_llama))), VOCAB)
    assert len(ids) > 100  # the built-in paragraph, not random ids
    observed = cal.observe_kv(model, ids)
    for attn, kv in zip(layers, observed, strict=True):
        assert attn.kv_scale_source == "calibrated"
        want = [cal.DEFAULT_MARGIN * float(x.abs().amax()) / 448 for x in kv]
        assert [attn.k_scale, attn.v_scale] == pytest.approx(want, rel=1e-6)
        for s in (attn.k_scale, attn.v_scale):
            assert math.isfinite(s) and 0 < s < 0.1, s  # not 1.0: amax here is far below 448


def test_greedy_tokens_repeat_across_starts(calibrated, tiny_llama):
    _, layers, tokens = calibrated
    _, again_layers, again = start(tiny_llama)
    assert again == tokens
    assert [(a.k_scale, a.v_scale) for a in again_layers] == [
        (a.k_scale, a.v_scale) for a in layers
    ]


def test_checkpoint_scales_win(calibrated, tiny_llama, tmp_path):
    dst = tmp_path / "scaled"
    shutil.copytree(tiny_llama, dst)
    (weights,) = dst.glob("*.safetensors")
    extra = {"model.layers.0.self_attn.k_scale": torch.tensor(0.03),
             "model.layers.0.self_attn.v_scale": torch.tensor(0.02)}  # fmt: skip
    save_file({**load_file(weights), **extra}, weights, metadata={"format": "pt"})
    _, layers, _ = start(dst)
    assert (layers[0].k_scale, layers[0].v_scale) == pytest.approx((0.03, 0.02))
    assert layers[0].kv_scale_source == "checkpoint"
    assert layers[1].kv_scale_source == "calibrated"
    other = calibrated[1][1]
    assert (layers[1].k_scale, layers[1].v_scale) == (other.k_scale, other.v_scale)


def test_calibrate_needs_an_fp8_cache_and_a_known_value():
    with pytest.raises(ValueError, match="kv_cache_scales='calibrate' needs kv_cache_dtype"):
        EngineArgs(kv_cache_scales="calibrate").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_scales must be one of"):
        CacheConfig(kv_cache_dtype="fp8", kv_cache_scales="amax").validate()


def test_without_a_tokenizer_random_ids_are_fixed():
    a = cal.calibration_token_ids(None, 1000)
    assert a == cal.calibration_token_ids(None, 1000)
    assert len(a) == cal.NUM_CALIBRATION_TOKENS and max(a) < 1000
