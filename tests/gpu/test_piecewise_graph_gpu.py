"""Piecewise CUDA graphs on the GPU (phloem/worker/piecewise_graph.py): real graphs captured per
token bucket on a tiny model (compiled RMSNorms, the Triton RoPE + KV write inside the pieces,
the backend's attention eager between them) give the eager forward's hidden states and KV cache
for mixed prompt-chunk + one-token steps, padded or not."""

from __future__ import annotations

import pytest
import torch

from tests.worker.piecewise_harness import (
    NUM_BLOCKS,
    both_ways,
    make_runner,
    mixed_steps,
    step,
    tiny_phloem_model,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BUCKETS = [8, 16, 32, 48]
# head_dim 128: a size FlashInfer's kernels take
SHAPES = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, head_dim=128)


def _backend(name: str, model, dtype):
    from phloem.ops.attention import get_attention_backend

    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    return get_attention_backend(
        name, num_heads=model.model.attention(0).num_heads, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype=dtype, kv_dtype=dtype, device=torch.device("cuda"),
        max_num_blocks_per_seq=NUM_BLOCKS, max_num_seqs=8,
    )  # fmt: skip


@pytest.mark.parametrize(
    "arch, backend, dtype",
    [("llama", "reference", torch.float32), ("qwen3", "reference", torch.float32),
     ("llama", "flashinfer", torch.bfloat16), ("qwen3", "shared_prefix", torch.bfloat16)],
)  # fmt: skip
def test_piecewise_graphs_equal_eager(arch, backend, dtype):
    from phloem.worker.fusion import compile_elementwise_layers

    model = tiny_phloem_model(arch, "cuda", dtype, **SHAPES)
    compile_elementwise_layers(model)
    runner = make_runner(model, "cuda", _backend(backend, model, dtype))
    runner.capture_piecewise_graphs(BUCKETS)
    assert runner.piecewise_runner.num_graphs == len(BUCKETS) * (model.num_layers + 1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for seqs in mixed_steps(model.config.vocab_size):
        eager, piecewise, eager_caches, caches, _ = both_ways(runner, step(seqs))
        torch.testing.assert_close(piecewise.float(), eager.float(), rtol=tol, atol=tol)
        for got, want in zip(caches, eager_caches):
            torch.testing.assert_close(
                got[:NUM_BLOCKS].float(), want[:NUM_BLOCKS].float(), rtol=tol, atol=tol
            )
    runner.piecewise_runner.release()
