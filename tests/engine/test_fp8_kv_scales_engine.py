"""The FP8 KV cache's per-layer scales end to end (issue 18): a tiny checkpoint carrying
`self_attn.k_scale` / `v_scale` (computed here from a full-precision run: max |K| / 448 per
layer) loads them into every layer, the engine writes K / k_scale (so the stored bytes reach
e4m3's top, 448, where scale 1 leaves them small) and reads them back scaled, and its greedy
outputs stay close to the float32 cache's. A mis-shaped scale fails the load naming the tensor."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from phloem import LLM, SamplingParams
from phloem.layers.attention import Attention
from tests.engine.tiny_models import VOCAB, tiny_model_dir


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_tokenizer_dir):
    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_kvscale", 7)


def run(path, kv_cache_dtype: str):
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20,
              kv_cache_dtype=kv_cache_dtype, dtype="float32", enable_prefix_caching=False)  # fmt: skip
    rng = random.Random(0)
    batch = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    runner = llm.llm_engine.executor.worker.model_runner
    return runner, [o.outputs[0].token_ids for o in outs]


def with_tensors(src, dst, extra: dict[str, torch.Tensor]):
    """A copy of checkpoint dir `src` at `dst` whose safetensors also hold `extra`."""
    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    save_file({**load_file(weights), **extra}, weights, metadata={"format": "pt"})
    return dst


def common_prefix(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))
               for s, t in zip(a, b))  # fmt: skip


def test_checkpoint_kv_scales_are_written_and_read(tiny_llama, tmp_path):
    full_runner, full = run(tiny_llama, "auto")
    amax = [(c[:, 0].abs().max().item(), c[:, 1].abs().max().item())
            for c in full_runner.kv_caches]  # fmt: skip
    scales = {}
    for i, (k, v) in enumerate(amax):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k / 448)
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v / 448])
    scaled_dir = with_tensors(tiny_llama, tmp_path / "scaled", scales)

    runner, fp8 = run(scaled_dir, "fp8")
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    got = [s for a in layers for s in (a.k_scale, a.v_scale)]
    assert got == pytest.approx([s / 448 for pair in amax for s in pair], rel=1e-6)
    for cache in runner.kv_caches:  # K / k_scale: the largest |K| lands near e4m3's 448
        assert cache.dtype == torch.float8_e4m3fn
        assert cache[:, 0].float().abs().max() >= 300 and cache[:, 1].float().abs().max() >= 300
    # Greedy tokens before the first divergence from the float32 cache (48 in all): about
    # 28 of 48 measured (36 without scales: greedy paths of a random model fork at near-ties);
    # a cache written scaled but read unscaled (or the reverse) diverges at the first token.
    assert sum(a[0] == b[0] for a, b in zip(fp8, full)) >= 5
    assert common_prefix(fp8, full) >= 0.4 * 8 * len(full), (fp8, full)

    _, unscaled = run(tiny_llama, "fp8")  # no scales in the checkpoint: 1.0, as before
    assert common_prefix(unscaled, full) >= 0.4 * 8 * len(full)


def test_mis_shaped_checkpoint_scale_is_refused(tiny_llama, tmp_path):
    bad = with_tensors(tiny_llama, tmp_path / "bad",
                       {"model.layers.1.self_attn.v_scale": torch.ones(2)})  # fmt: skip
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale: shape \(2,\)"):
        LLM(str(bad), kv_cache_dtype="fp8", dtype="float32")
