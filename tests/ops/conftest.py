"""Fixtures shared by the kernel tests of tests/ops."""

from __future__ import annotations

import pytest

from phloem.layers.quantization import base as quant_base


@pytest.fixture
def fusion_flags(monkeypatch):
    """`fusion_flags(fused_env, module_cache)` -> `set(skinny, fused)`: sets PHLOEM_SKINNY_GEMM
    and the fusion's flag `fused_env` (None: unset), read afresh (the flag caches, the fusion's
    `module_cache` among them, are cleared after each set and at the end)."""
    caches = [quant_base.skinny_gemm_mode, quant_base.skinny_gemm_module]

    def for_fusion(fused_env: str, module_cache):
        caches.append(module_cache)

        def set_flags(skinny: str | None, fused: str | None) -> None:
            for env, value in ((quant_base.SKINNY_GEMM_ENV, skinny), (fused_env, fused)):
                if value is None:
                    monkeypatch.delenv(env, raising=False)
                else:
                    monkeypatch.setenv(env, value)
            for cache in caches:
                cache.cache_clear()

        return set_flags

    yield for_fusion
    for cache in caches:
        cache.cache_clear()
