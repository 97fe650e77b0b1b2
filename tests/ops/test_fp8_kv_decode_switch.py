"""The FP8 cache's decode-kernel switch of the FlashInfer backend (issue 18), on the CPU:
PHLOEM_FP8_DECODE_KERNEL's parsing, "auto" (the default) resolved per device
(`resolve_fp8_decode`: XQA on sm_90/100/120), the per-geometry choice (`fp8_decode_path`), the
backend and the kernel prebuild choosing alike, and the dense page table XQA reads
(`dense_page_table`). GPUs are stood in for by a patched capability query and a fake
`flashinfer`; the kernels themselves run on a GPU (benchmarks/fp8_kv_decode.py,
tests/gpu/test_fp8_kv_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phloem.ops.attention.flashinfer_backend import (
    FP8_DECODE_CHOICES,
    FP8_DECODE_KERNELS,
    fp8_decode_kernel,
    fp8_decode_path,
)
from phloem.ops.attention.flashinfer_xqa import cuda_capability, resolve_fp8_decode
from phloem.ops.attention.metadata import AttentionMetadata
from phloem.ops.attention.page_tables import dense_page_table

HOPPER, BLACKWELL, ADA, AMPERE = (9, 0), (10, 0), (8, 9), (8, 0)


def test_switch_parses_every_kernel_and_defaults_to_auto():
    assert fp8_decode_kernel({}) == "auto"
    assert FP8_DECODE_CHOICES == ("auto", *FP8_DECODE_KERNELS)
    for name in FP8_DECODE_CHOICES:
        assert fp8_decode_kernel({"PHLOEM_FP8_DECODE_KERNEL": name}) == name
    for bad in ("fa3", ""):
        with pytest.raises(ValueError, match="PHLOEM_FP8_DECODE_KERNEL must be one of"):
            fp8_decode_kernel({"PHLOEM_FP8_DECODE_KERNEL": bad})


def test_auto_is_xqa_exactly_where_xqa_runs(monkeypatch):
    """Unset or "auto" is XQA on compute capability 9.x, 10.x and 12.x and the prefill kernel on older
    GPUs and off CUDA (None); an explicit name is kept on every device (an explicit "xqa" on
    an unsupported GPU is the backend's ValueError). The capability comes from torch's query
    for a CUDA device, None for the CPU."""
    for capability in (HOPPER, (9, 0), BLACKWELL, (12, 0), (12, 1)):
        assert resolve_fp8_decode("auto", capability) == "xqa", capability
    for capability in (ADA, AMPERE, (7, 5), (11, 0), None):
        assert resolve_fp8_decode("auto", capability) == "prefill", capability
    for name in FP8_DECODE_KERNELS:
        assert {resolve_fp8_decode(name, c) for c in (HOPPER, ADA, None)} == {name}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: HOPPER)
    assert cuda_capability(torch.device("cuda:0")) == HOPPER
    assert cuda_capability(torch.device("cpu")) is None


def test_path_falls_back_to_prefill_where_a_kernel_is_not_compiled():
    """Llama-3.1-8B (group 4, head dim 128, page 16) runs what is asked; XQA needs a page size
    it compiles (16-128) and head_dim <= 256; the CUDA-core kernel groups 1-4."""
    assert [fp8_decode_path(k, 4, 128, 16) for k in FP8_DECODE_KERNELS] == list(FP8_DECODE_KERNELS)
    assert fp8_decode_path("xqa", 4, 128, 8) == "prefill"
    assert fp8_decode_path("xqa", 4, 512, 16) == "prefill"
    assert fp8_decode_path("xqa", 8, 64, 128) == "xqa"
    assert fp8_decode_path("cuda_core", 8, 128, 16) == "prefill"
    for name in ("trtllm-gen", "auto"):  # "auto" is resolved per device before
        with pytest.raises(ValueError, match="must be one of"):
            fp8_decode_path(name, 4, 128, 16)


def test_dense_page_table_rows_are_each_sequences_pages():
    """Rows hold the first ceil(L / 16) ids of each (longer, unpadded) host table, then zeros."""
    tables = [[7, 3, 9], [4], [1, 2, 5, 6, 8]]
    meta = AttentionMetadata.from_host([1, 1, 1], [20, 16, 65], tables, 16)
    table, lens = dense_page_table(meta)
    assert table.dtype == np.int32 and lens.dtype == np.int32
    np.testing.assert_array_equal(table, [[7, 3, 0, 0, 0], [4, 0, 0, 0, 0], [1, 2, 5, 6, 8]])
    np.testing.assert_array_equal(lens, [20, 16, 65])
    with pytest.raises(ValueError, match="block table has 1 blocks, needs 2"):
        dense_page_table(AttentionMetadata.from_host([1], [17], [[4]], 16))


def _fake_xqa(query, kv_cache, workspace, block_tables, seq_lens, max_seq_len, bmm1_scale=1.0,
              bmm2_scale=1.0, out=None, kv_layout="NHD"):  # fmt: skip
    """XQA's contract in plain torch (FlashInfer's `xqa_batch_decode_with_kv_cache`): a 5-D
    cache unbound into K / V, HND pages transposed back, rows of `block_tables` read up to each
    length, scores * bmm1_scale, output * bmm2_scale."""
    assert query.is_contiguous() and out.is_contiguous() and workspace.dtype == torch.uint8
    assert seq_lens.dtype == torch.uint32 and max_seq_len == block_tables.shape[1] * 16
    k_cache, v_cache = kv_cache.unbind(1)
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(-3, -2), v_cache.transpose(-3, -2)
    group = query.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.to(torch.int64).tolist()):
        pages = block_tables[b, : -(-n // 16)].long()
        k, v = (c[pages].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
                for c in (k_cache, v_cache))  # fmt: skip
        p = torch.softmax(torch.einsum("hd,nhd->hn", query[b].float(), k) * bmm1_scale, -1)
        out[b] = (torch.einsum("hn,nhd->hd", p, v) * bmm2_scale).to(out.dtype)
    return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A `flashinfer` package whose XQA entry point is `_fake_xqa` (the backend's other
    wrappers are constructed and planned, never run)."""
    import sys
    import types

    class Wrapper:
        def __init__(self, *args, **kwargs):
            pass

        def plan(self, *args, **kwargs):
            pass

    root, prefill, decode = (types.ModuleType(n) for n in
                             ("flashinfer", "flashinfer.prefill", "flashinfer.decode"))  # fmt: skip
    root.BatchPrefillWithPagedKVCacheWrapper = root.BatchDecodeWithPagedKVCacheWrapper = Wrapper
    root.prefill, root.decode = prefill, decode
    decode.xqa_batch_decode_with_kv_cache = _fake_xqa
    for name, module in (("flashinfer", root), ("flashinfer.prefill", prefill),
                         ("flashinfer.decode", decode)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_xqa_steps_get_their_tables_lengths_and_scales(fake_flashinfer, layout):
    """Decode-only steps with PHLOEM_FP8_DECODE_KERNEL's "xqa" reach XQA with the step's page
    table, lengths and scales (eager, and planned twice into a graph's fixed buffers with
    other tables), padding rows zeroed: the float64 reference's output."""
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention
    from phloem.ops.attention.reference import paged_attention_reference

    gen = torch.Generator().manual_seed(0)
    kv = (torch.randn(12, 2, 16, 2, 32, generator=gen) * 4).to(torch.float8_e4m3fn)
    if layout == "HND":  # the contiguous [blocks, 2, H_kv, bs, D] seen as NHD (kv_store's view)
        kv = kv.transpose(2, 3).contiguous().transpose(2, 3)
    backend = FlashInferAttention(8, 2, 32, torch.bfloat16, "cpu", kv_dtype=torch.float8_e4m3fn,
                                  scale=0.2, max_num_blocks_per_seq=6, kv_layout=layout,
                                  fp8_decode="xqa")  # fmt: skip
    steps = [([20, 33, 1], [[5, 2], [0, 11, 7], [3]]), ([70, 16, 2], [[1, 4, 6, 8, 9], [10], [2]])]
    for graph, (lens, tables) in [(False, steps[0]), (True, steps[0]), (True, steps[1])]:
        meta = AttentionMetadata.from_host([1] * 3, lens, tables, 16, "cpu", padded_tables=True)
        query = torch.randn(4, 8, 32, generator=gen).to(torch.bfloat16)  # one padding row
        want = paged_attention_reference(query.double(), kv.double(), meta, 0.2, k_scale=0.5,
                                         v_scale=3.0)  # fmt: skip
        backend.prepare_replay(meta) if graph else backend.begin_step(meta)
        got = backend.forward(query, kv, meta, 0.2, torch.full_like(query, float("nan")), 0.5, 3.0)
        backend.end_step()
        torch.testing.assert_close(got[:3].double(), want[:3], rtol=1e-2, atol=1e-2)  # bf16 out
        assert got[3].eq(0).all()


def test_xqa_refused_on_a_gpu_it_does_not_run_on(fake_flashinfer, monkeypatch):
    """XQA asked for on an sm_89 GPU (FP8 tensor cores, no XQA FP8 kernel) fails at construction,
    before any allocation, naming the variable; sm_90 passes; other kernels are not checked."""
    from phloem.ops.attention.flashinfer_backend import FlashInferAttention
    from phloem.ops.attention.flashinfer_xqa import check_xqa_device

    capability = {"value": (8, 9)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["value"])
    with pytest.raises(ValueError, match=r"PHLOEM_FP8_DECODE_KERNEL=xqa .* this one is 8\.9"):
        FlashInferAttention(8, 2, 32, torch.bfloat16, "cuda:0", kv_dtype=torch.float8_e4m3fn,
                            fp8_decode="xqa")  # fmt: skip
    check_xqa_device("prefill", torch.device("cuda:0"))
    check_xqa_device("xqa", torch.device("cpu"))
    capability["value"] = (9, 0)
    check_xqa_device("xqa", torch.device("cuda:0"))


def _backend(capability, monkeypatch, heads=8, kv_heads=2, head_dim=32, **kwargs):
    """An FP8-cache FlashInfer backend on the CPU (fake `flashinfer`, a 1 KiB workspace) whose
    device reports `capability` (the backend's capability query patched; None: the query's
    own answer for the CPU)."""
    from phloem.ops.attention import flashinfer_backend

    query = cuda_capability if capability is None else (lambda device: capability)
    monkeypatch.setattr(flashinfer_backend, "cuda_capability", query)
    monkeypatch.setattr(flashinfer_backend, "_WORKSPACE_BYTES", 1024)
    kwargs = {"kv_dtype": torch.float8_e4m3fn, "max_num_blocks_per_seq": 6, **kwargs}
    return flashinfer_backend.FlashInferAttention(heads, kv_heads, head_dim, torch.bfloat16, "cpu",
                                                  **kwargs)  # fmt: skip


def test_default_decodes_on_xqa_on_a_capability_9_device(fake_flashinfer, monkeypatch):
    """PHLOEM_FP8_DECODE_KERNEL unset on an sm_90 device: decode-only steps plan XQA, eager and
    into a graph's buffers (the same path for a capture and its replays); mixed steps and a
    block size XQA does not compile keep the prefill kernel. "prefill" turns XQA off; on the
    CPU and on sm_89 "auto" stays on the prefill kernel; a 16-bit cache never reads the
    variable."""
    from phloem.ops.attention.flashinfer_xqa import XqaStep

    monkeypatch.delenv("PHLOEM_FP8_DECODE_KERNEL", raising=False)
    decode = AttentionMetadata.from_host([1, 1], [20, 33], [[5, 2], [0, 11, 7]], 16, "cpu",
                                         padded_tables=True)  # fmt: skip
    mixed = AttentionMetadata.from_host([4, 1], [20, 33], [[5, 2], [0, 11, 7]], 16, "cpu",
                                        padded_tables=True)  # fmt: skip
    backend = _backend(HOPPER, monkeypatch)
    assert backend.fp8_decode_kernel == "xqa"
    assert backend.decode_path(16) == "xqa" and backend.decode_path(8) == "prefill"
    for plan in (backend.begin_step, backend.prepare_replay, backend.prepare_replay):
        plan(decode)
        assert isinstance(backend._active, XqaStep), plan
        backend.end_step()
    backend.begin_step(mixed)
    assert not isinstance(backend._active, XqaStep)
    assert _backend(HOPPER, monkeypatch, fp8_decode="prefill").decode_path(16) == "prefill"
    assert _backend(ADA, monkeypatch).decode_path(16) == "prefill"
    assert _backend(None, monkeypatch).decode_path(16) == "prefill"  # the CPU
    monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", "nonsense")
    bf16 = _backend(None, monkeypatch, kv_dtype=None)
    assert bf16.kv_dtype == torch.bfloat16 and bf16.decode_path(16) == "prefill"


@pytest.mark.parametrize("env", [None, "prefill", "cuda_core", "xqa"])
def test_prebuild_builds_xqa_exactly_where_the_backend_decodes_on_it(fake_flashinfer, monkeypatch,
                                                                     env):  # fmt: skip
    """The XQA module is in the start-up prebuild (`required_modules`) exactly when the backend
    of the same settings sends decode steps to XQA, for every GPU generation, geometry (GQA
    group, head dim, block size) and PHLOEM_FP8_DECODE_KERNEL, so the default path never
    builds XQA at its first step (an explicit "xqa" on a GPU without it raises instead)."""
    from phloem.worker.kernel_prebuild import required_modules

    if env is None:
        monkeypatch.delenv("PHLOEM_FP8_DECODE_KERNEL", raising=False)
    else:
        monkeypatch.setenv("PHLOEM_FP8_DECODE_KERNEL", env)
    geometries = [(8, 2, 32, 16), (9, 3, 64, 16), (16, 2, 128, 64), (8, 2, 128, 8), (8, 1, 512, 16)]
    for capability in (HOPPER, BLACKWELL, ADA, AMPERE):
        if env == "xqa" and capability[0] < 9:
            continue
        for heads, kv_heads, head_dim, block_size in geometries:
            backend = _backend(capability, monkeypatch, heads, kv_heads, head_dim)
            modules = required_modules("flashinfer", head_dim, "bfloat16", "float8_e4m3fn",
                                       capability, True, heads // kv_heads, block_size)  # fmt: skip
            prebuilt = [m for m in modules if m.kind == "xqa"]
            runs = backend.decode_path(block_size) == "xqa"
            assert bool(prebuilt) == runs, (env, capability, heads, kv_heads, head_dim, block_size)
            if runs:
                module = prebuilt[0]
                assert (module.page_size, module.gqa_group) == (block_size, heads // kv_heads)
