"""The "auto" dtype rule: bfloat16 on GPU and on CPUs with native bfloat16 dot products, float32
on other CPUs; explicit dtypes are kept."""

from __future__ import annotations

import pytest
import torch

from phloem.worker import worker


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, native) -> None:
    monkeypatch.setattr(worker, "cpu_has_native_bf16", lambda: native)
    expected = torch.bfloat16 if native else torch.float32
    assert worker.resolve_dtype("auto", torch.device("cpu")) == expected
    assert worker.resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert worker.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_auto_dtype_on_cuda_is_bf16(monkeypatch) -> None:
    monkeypatch.setattr(worker, "cpu_has_native_bf16", lambda: False)
    assert worker.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_native_bf16_reads_the_cpu_flags(monkeypatch, tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    real_open = open

    def fake_open(path, *args, **kwargs):
        return real_open(cpuinfo if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n")
    assert worker.cpu_has_native_bf16()
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 amx_tile amx_bf16\n")
    assert worker.cpu_has_native_bf16()
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert not worker.cpu_has_native_bf16()
    cpuinfo.unlink()
    assert not worker.cpu_has_native_bf16()
