"""The seam of compiled elementwise layers: `Compilable.use_compiled` (worker/fusion.py)."""

from __future__ import annotations

import torch

from phloem.layers.activation import SiluAndMul
from phloem.layers.norm import RMSNorm


def test_forward_runs_the_handed_function_with_the_instance():
    norm = RMSNorm(8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    want = norm(x, residual)
    calls = []

    def compiled(module, *args):
        calls.append(module)
        return RMSNorm.compute(module, *args)

    assert not norm.is_compiled
    norm.use_compiled(compiled)
    got = norm(x, residual)
    assert norm.is_compiled and calls == [norm]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "forward" not in vars(norm)  # the class's forward, not an instance attribute


def test_silu_and_mul_computes_without_a_compiled_function():
    x = torch.randn(2, 6)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(gate) * up)
