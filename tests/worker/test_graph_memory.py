"""phloem/worker/graph_memory.py and `Worker._fit_graphs`: when the captured CUDA graphs leave
less memory than eager steps need, the KV pool gives back the difference and the graphs are
captured again (simulated on the CPU; tests/gpu/test_engine_gpu.py runs it on a GPU)."""

import pytest
import torch

from phloem.worker import worker as worker_module
from phloem.worker.graph_memory import kv_blocks_to_release, runtime_need
from phloem.worker.worker import kv_bytes_per_block

GiB = 2**30


def test_runtime_need_and_blocks_to_release():
    assert runtime_need(3 * GiB, 80 * GiB) == 3 * GiB + int(0.8 * GiB)
    assert runtime_need(0, 8 * GiB) == 512 * 2**20  # the margin's floor
    assert kv_blocks_to_release(available=5 * GiB, need=4 * GiB, bytes_per_block=100) == 0
    assert kv_blocks_to_release(available=4 * GiB, need=4 * GiB, bytes_per_block=100) == 0
    assert kv_blocks_to_release(available=1000, need=1250, bytes_per_block=100) == 3  # rounds up


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, embedded_tokenizer_dir):
    from tests.engine.tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_fit", 7)


def test_fit_graphs_gives_back_kv_blocks_and_captures_again(tiny_llama_dir, monkeypatch):
    from phloem import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_gpu_blocks=200)
    worker = llm.llm_engine.executor.worker
    per_block = kv_bytes_per_block(worker.model, worker.model_runner.block_size, worker.kv_dtype)
    worker.activation_peak = 40 * per_block
    total = 1000 * GiB  # margin: 10 GiB
    available = {"bytes": runtime_need(worker.activation_peak, total) + 5 * per_block}
    captures = []
    monkeypatch.setattr(
        worker_module, "available_bytes", lambda device: (available["bytes"], total)
    )
    monkeypatch.setattr(worker, "_capture_all", lambda *args: captures.append(args))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    worker._fit_graphs(None, None)  # enough left: nothing changes
    assert worker.num_blocks == 200 and captures == []

    available["bytes"] -= 12 * per_block + 1  # 7 blocks and a byte short
    worker._fit_graphs(None, None)
    assert worker.num_blocks == 192 and len(captures) == 1
    assert worker.model_runner.num_blocks == 192
    assert worker.model_runner.kv_caches[0].shape[0] == 193  # plus the scratch block

    available["bytes"] = 0
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        worker.activation_peak = 10**6 * per_block
        worker._fit_graphs(None, None)
