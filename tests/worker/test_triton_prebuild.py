"""phloem's Triton kernels compiled before their first launch (issue 19): what decides the variants
(`TritonShapes` from an engine's settings), the prebuild process in the background (the caller
goes on; a failure is logged, never raised; a second run finds every variant cached), and, in
processes without the interpreter that compile for sm_90 on the CPU: the prebuild's variant
list is what the engine's code launches, and the cache key the prebuild writes for each variant
is the key a launch looks up (so the engine's first launch is a cache hit)."""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from phloem.config import CacheConfig, ModelConfig
from phloem.model_configs import model_config_dir
from phloem.models.loader import load_hf_config, resolve_model
from phloem.worker.triton_prebuild import (
    ENV_SWITCH,
    TritonPrebuild,
    TritonShapes,
    prebuild_for_engine,
    shapes_for_engine,
)

pytest.importorskip("triton")

LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128, hidden_size=4096,
                intermediate_size=14336)  # fmt: skip


def _shapes(name: str, tp: int = 1, **settings) -> TritonShapes:
    hf_config = load_hf_config(resolve_model(str(model_config_dir(name))))
    model = ModelConfig(**{k: v for k, v in settings.items() if k != "kv_cache_dtype"})
    cache = CacheConfig(kv_cache_dtype=settings.get("kv_cache_dtype", "auto"))
    return shapes_for_engine(model, cache, hf_config, "bfloat16", tp, flashinfer=True)


def test_shapes_of_an_engine():
    assert _shapes("llama-3.1-8b") == TritonShapes(
        **LLAMA_8B, skinny_gemm="auto", fused_qkv_rope=True
    )
    tp2 = _shapes("llama-3.1-8b", tp=2, kv_cache_dtype="fp8", quantization="fp8")
    assert (tp2.num_heads, tp2.num_kv_heads, tp2.intermediate_size) == (16, 4, 7168)
    assert (tp2.kv_dtype, tp2.fp8_quant, tp2.tp_size) == ("float8_e4m3fn", "fused", 2)
    assert (tp2.skinny_gemm, tp2.fused_qkv_rope) == ("0", False)  # FP8 layers: no dense one
    eager = _shapes("qwen3-8b", enforce_eager=True)
    assert (eager.head_dim, eager.num_heads, eager.cuda_graphs, eager.shared_prefix) == (
        128, 32, False, True
    )  # fmt: skip
    assert not _shapes("llama-3.1-8b", attention_backend="flashinfer").shared_prefix


def test_the_small_decode_kernel_is_prebuilt_where_it_runs(monkeypatch):
    """The small-decode kernel is on by default over FlashInfer (and listed among the hooks);
    not over the reference backend unless forced; never with the switch off."""
    from phloem.worker.triton_prebuild import _hooks

    assert _shapes("llama-3.1-8b").small_decode
    assert "small_decode" in [name for name, _ in _hooks(_shapes("llama-3.1-8b"))]
    assert not _shapes("llama-3.1-8b", attention_backend="reference").small_decode
    monkeypatch.setenv("PHLOEM_SMALL_DECODE_ATTENTION", "1")
    assert _shapes("llama-3.1-8b", attention_backend="reference").small_decode
    monkeypatch.setenv("PHLOEM_SMALL_DECODE_ATTENTION", "0")
    assert not _shapes("llama-3.1-8b").small_decode
    assert "small_decode" not in [name for name, _ in _hooks(_shapes("llama-3.1-8b"))]


def test_shapes_follow_the_fp8_switch(monkeypatch):
    monkeypatch.setenv("PHLOEM_FP8_FUSED_QUANT", "0")
    assert _shapes("llama-3.1-8b", quantization="fp8").fp8_quant == "per_token"
    with pytest.raises(ValueError, match="fp8_quant"):
        TritonShapes(**LLAMA_8B, fp8_quant="int4")


def test_wide_block_ms_are_every_block_m_the_planner_picks():
    from phloem.ops.attention.shared_prefix_variants import WIDE_BLOCK_MS
    from phloem.ops.attention.tile_plan import _auto_block_m

    picked = {_auto_block_m(SimpleNamespace(group_rows=np.array([rows])), np.array([rows]))
              for rows in range(0, 300)}  # fmt: skip
    assert picked == set(WIDE_BLOCK_MS)


def test_nothing_starts_off_cuda_or_when_switched_off(monkeypatch, tmp_path):
    import torch

    cpu = prebuild_for_engine(ModelConfig(), CacheConfig(), None, torch.device("cpu"), None)
    assert cpu.shapes is None and cpu.wait() == 0.0
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(ENV_SWITCH, "0")
    off = prebuild_for_engine(ModelConfig(), CacheConfig(), None, torch.device("cuda"), None)
    assert off.shapes is None and off.wait() == 0.0


def _command(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_failed_prebuild_is_logged_not_raised(caplog):
    with caplog.at_level(logging.WARNING, logger="phloem.worker.triton_prebuild"):
        failed = TritonPrebuild(TritonShapes(**LLAMA_8B), command=_command(
            "import sys; print('no compiler', file=sys.stderr); sys.exit(3)"))  # fmt: skip
        assert failed.wait() > 0.0  # logs, does not raise
        summary = {"variants": 1, "seconds": 1.0, "record_errors": ["rope_kv: ValueError: R"],
                   "kernels": [{"kernel": "k(B=1)", "error": "E"}]}  # fmt: skip
        one = TritonPrebuild(TritonShapes(**LLAMA_8B), command=_command(
            f"import sys; sys.stdin.read(); print({json.dumps(json.dumps(summary))})"))  # fmt: skip
        one.wait()
        garbled = TritonPrebuild(TritonShapes(**LLAMA_8B), command=_command("print('oops')"))
        garbled.wait()
        hung = TritonPrebuild(TritonShapes(**LLAMA_8B), timeout_s=0.5,
                              command=_command("import time; time.sleep(60)"))  # fmt: skip
        assert hung.wait() < 30  # stopped, not waited out
    assert "exit 3" in caplog.text and "no compiler" in caplog.text
    assert "Expecting value" in caplog.text  # no summary from a process that exited 0
    assert "exit -9" in caplog.text  # the hung one, killed
    assert "k(B=1) failed (it compiles at first use): E" in caplog.text
    assert "could not list the variants of rope_kv: ValueError: R" in caplog.text


def test_the_prebuild_does_not_hold_up_its_caller(tmp_path):
    """The child waits for a file the caller writes after starting it: a prebuild that ran in
    the caller's thread would never see it (and the child gives up after 30 s)."""
    flag = tmp_path / "weights-loaded"
    code = (f"import os, sys, time\nfor _ in range(600):\n    if os.path.exists({str(flag)!r}): "
            "break\n    time.sleep(0.05)\nelse:\n    sys.exit(5)\n"
            "print('{\"variants\": 0, \"seconds\": 0.0, \"kernels\": []}')")  # fmt: skip
    prebuild = TritonPrebuild(TritonShapes(**LLAMA_8B), command=_command(code))
    flag.write_text("")  # the caller's own work, meanwhile
    prebuild.wait()
    assert prebuild.summary == {"variants": 0, "seconds": 0.0, "kernels": []}


def test_the_prebuild_compiles_in_parallel_then_finds_its_cache(monkeypatch, tmp_path, caplog):
    """The real process: five variants (no shared-prefix kernels: the quick ones) compiled for
    sm_90 by two pool processes; a second prebuild finds them all cached."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    shapes = TritonShapes(**LLAMA_8B, shared_prefix=False, small_decode=False)
    first = TritonPrebuild(shapes, (9, 0), jobs=2)
    first.wait()
    kernels = first.summary["kernels"]
    assert [k["kernel"].split("(")[0] for k in kernels] == [
        "_rope_kv_kernel",
        "_silu_and_mul_kernel",
        "_token_bitmask_kernel",  # bf16 logits (a greedy step's copy)
        "_token_bitmask_kernel",  # float32 (the random path's copy)
        "_seeded_noise_kernel",  # the seeded rows' noise (float32, any row count)
    ]
    assert not any(k["cached"] for k in kernels), kernels
    with caplog.at_level(logging.INFO, logger="phloem.worker.triton_prebuild"):
        again = TritonPrebuild(shapes, (9, 0), jobs=2)
        again.wait()
    assert all(k["cached"] for k in again.summary["kernels"])
    assert "5 variants (0 compiled, 5 cached, 0 failed)" in caplog.text


VARIANTS_ARE_LAUNCHES = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("tv_cpu", "benchmarks/triton_variants_cpu.py")
bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)
from phloem.worker import triton_variants as tv
from phloem.worker.triton_prebuild import TritonShapes, launch_all
target = tv.cuda_target((9, 0))
for kv, fp8 in (("bfloat16", False), ("float8_e4m3fn", True)):
    shapes = dict(bench.LLAMA_8B, kv_dtype=kv, fp8_quant="fused" if fp8 else "")
    runtime = tv.record_variants(lambda: bench.runtime_launches(shapes, kv, fp8, 150, 0), target)
    prebuild = tv.record_variants(lambda: launch_all(TritonShapes(**shapes)), target)
    assert set(runtime) == set(prebuild), (kv, [v.describe() for v in set(runtime) ^ set(prebuild)])
    print(kv, len(prebuild))
"""


def test_the_variants_are_what_the_engine_launches(compile_for_hopper):
    """The engine's own code paths (the layers' fused kernels over several token counts, the
    attention warm-ups, the shared-prefix CUDA-graph captures at every batch size and the
    small-decode ones at batches 1-16, random eager
    serving steps, the sampler's grammar mask on bf16 and float32 logits and its seeded rows'
    noise at odd and even row counts) launch exactly the prebuild's variants, bf16 and FP8 (KV
    cache and W8A8)."""
    out = compile_for_hopper(VARIANTS_ARE_LAUNCHES)
    assert "bfloat16 11" in out and "float8_e4m3fn 14" in out


SAME_KEYS = r"""
from triton import knobs
from triton.runtime.cache import FileCacheManager
from phloem.worker import triton_variants as tv
from phloem.worker.triton_prebuild import TritonShapes, launch_all

class Stop(BaseException):  # not an Exception: launch_all passes those on as failures
    pass

keys = []

class KeyLog(FileCacheManager):  # the on-disk key of a compile, then stop it
    def __init__(self, key, override=False, dump=False):
        keys.append(key)
        raise Stop

llama = dict(num_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128, hidden_size=4096,
             intermediate_size=14336)
for extra in ({}, {"kv_dtype": "float8_e4m3fn", "fp8_quant": "fused"}):
    shapes = TritonShapes(**llama, **extra)
    variants = tv.record_variants(lambda: launch_all(shapes), tv.cuda_target((9, 0)))
    knobs.cache.manager_class = KeyLog
    prebuilt = {}
    for v in variants:  # the prebuild's compile: JITFunction.preload
        try:
            tv.compile_variant(v)
        except Stop:
            prebuilt[v.specialization] = keys[-1]
    launched, pending = {}, []

    def hook(*, compile, **_):  # a launch: JITFunction.run; skip the variants already keyed
        if compile["specialization_data"] in launched:
            return True
        pending.append(compile["specialization_data"])
        return None

    knobs.runtime.jit_cache_hook = hook
    for _ in range(40):
        try:
            launch_all(shapes)
            break
        except Stop:
            launched[pending[-1]] = keys[-1]
    knobs.runtime.jit_cache_hook = None
    knobs.cache.manager_class = None
    assert len(prebuilt) == len(variants) and prebuilt == launched, (prebuilt, launched)
    print("same keys", len(variants))
"""


def test_the_prebuild_writes_the_keys_launches_look_up(compile_for_hopper):
    """For every variant (bf16; FP8 KV cache and W8A8), the on-disk cache key that the
    prebuild's compile computes equals the one the engine's launch of it computes (neither
    compiles: a cache manager records the key and stops)."""
    out = compile_for_hopper(SAME_KEYS)
    assert out.count("same keys") == 2


PREBUILD_ONE = r"""
from phloem.worker import triton_variants as tv
from phloem.ops import activation
import torch
(v,) = tv.record_variants(lambda: activation.compile_variants(14336, torch.bfloat16),
                          tv.cuda_target((9, 0)))
print("cached" if tv.compile_variant(v)[1] else "compiled")
"""

LAUNCH_ONE = r"""
import torch
from triton import knobs
from phloem.ops import activation
from phloem.worker import triton_variants as tv
from triton.runtime.driver import driver
driver.set_active(tv.CompileOnlyDriver(tv.cuda_target((9, 0))))
hits = []
knobs.compilation.listener = lambda **event: hits.append(event["cache_hit"])
try:  # the engine's call: its launch finds the kernel, then fails to run it (no device here)
    activation.silu_and_mul(torch.zeros(3, 2 * 14336, dtype=torch.bfloat16))
except Exception:
    pass
print("hits", hits)
"""


def test_a_prebuilt_kernel_is_a_cache_hit_at_its_first_launch(compile_for_hopper):
    """End to end, one kernel: compiled by the prebuild's path into an empty cache, then
    launched by the engine's wrapper in a fresh process: Triton finds it."""
    assert compile_for_hopper(PREBUILD_ONE).strip() == "compiled"
    assert compile_for_hopper(LAUNCH_ONE).strip() == "hits [True]"
