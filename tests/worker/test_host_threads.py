"""The torch thread cap of GPU engine processes (`phloem.worker.host_threads`): the decision
(device, environment -> threads) and that the CPU device is never capped."""

import pytest
import torch

from phloem.worker.host_threads import (
    GPU_ENGINE_TORCH_THREADS,
    cap_torch_threads,
    engine_torch_threads,
)


@pytest.mark.parametrize(
    ("device", "env", "expected"),
    [
        ("cuda", {}, GPU_ENGINE_TORCH_THREADS),
        ("cuda", {"OMP_NUM_THREADS": ""}, GPU_ENGINE_TORCH_THREADS),  # set but empty: not a choice
        ("cuda", {"OMP_NUM_THREADS": "8"}, None),  # the user's choice stands
        ("cuda", {"MKL_NUM_THREADS": "8"}, GPU_ENGINE_TORCH_THREADS),
        ("cpu", {}, None),  # the CPU engine's model needs its threads
        ("cpu", {"OMP_NUM_THREADS": "2"}, None),
    ],
)
def test_engine_torch_threads(device, env, expected):
    assert engine_torch_threads(device, env) == expected
    assert GPU_ENGINE_TORCH_THREADS == 1


def test_cap_lowers_only_gpu_processes(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        cap_torch_threads("cpu")
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        cap_torch_threads("cuda")
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        cap_torch_threads("cuda")
        assert torch.get_num_threads() == GPU_ENGINE_TORCH_THREADS
    finally:
        torch.set_num_threads(before)
