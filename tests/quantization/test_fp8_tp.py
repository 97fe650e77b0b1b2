"""FP8 under tensor parallelism (gloo, CPU): TP = 2 with `quantization="fp8"` holds exactly the
shards of TP = 1's FP8 weights and scales (column-parallel layers slice the per-channel scales,
row-parallel ones keep them whole: their row maxima are taken over both ranks' columns) and
generates TP = 1's greedy tokens (a row-parallel layer's per-token activation scales are taken
over both ranks' slices, so both runs round the same numbers; with each rank's own slice maxima,
as vLLM does, the first token of one prompt in eight already differed)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from phloem import LLM, SamplingParams
from tests.engine.tiny_models import VOCAB, write_tiny_model


def test_tp2_fp8_equals_tp1_fp8(tmp_path, embedded_tokenizer_dir):
    torch.set_num_threads(2)
    write_tiny_model("llama", tmp_path, embedded_tokenizer_dir, seed=11)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(4 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    runs, layers = {}, {}
    for size in (1, 2):
        llm = LLM(str(tmp_path), tensor_parallel_size=size, dtype="float32", block_size=4,
                  max_num_batched_tokens=32, quantization="fp8")  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[size] = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]
        block = llm.llm_engine.executor.worker.model.model.layers[1]
        layers[size] = {n: p.detach().clone() for n, p in block.named_parameters()}
        llm.close()  # leaves the process group (the next TP engine in this process starts one)
        del llm, block
        gc.collect()
    one, two = layers[1], layers[2]
    down_w, down_s = "mlp.down_proj.weight", "mlp.down_proj.weight_scale"
    assert two[down_w].dtype == torch.float8_e4m3fn
    assert torch.equal(two[down_s], one[down_s])  # row-parallel: whole rows' scales
    half = one[down_w].shape[1] // 2
    assert torch.equal(two[down_w].view(torch.uint8), one[down_w][:, :half].view(torch.uint8))
    up_s = "mlp.gate_up_proj.weight_scale"  # column-parallel: rank 0's rows of each part
    inter = one[up_s].shape[0] // 2
    assert torch.equal(two[up_s], torch.cat([one[up_s][: inter // 2],
                                             one[up_s][inter : inter + inter // 2]]))  # fmt: skip
    assert [t for t, _ in runs[2]] == [t for t, _ in runs[1]]
    for (_, lp1), (_, lp2) in zip(runs[1], runs[2]):
        assert lp2 == pytest.approx(lp1, abs=1e-4)
