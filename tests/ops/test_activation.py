"""The Triton SiLU-and-mul kernel against the float64 torch math (interpreted on the CPU)."""

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def kernel(triton_kernels):
    """The kernel; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    return triton_kernels("phloem.ops.activation", "_silu_and_mul_kernel").silu_and_mul


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("shape,dtype,block", [
    ((5, 2 * 48), torch.float32, 16),  # d = 48: 3 column blocks, the last one full
    ((3, 2, 2 * 40), torch.float32, 32),  # leading dims, a partial last block
    ((7, 2 * 24), torch.float16, 16),
    ((0, 2 * 8), torch.float32, 16),  # an empty step
])  # fmt: skip
def test_silu_and_mul_matches_float64(kernel, shape, dtype, block):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = x.double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernel(x.to(device()), block=block)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)


def test_silu_and_mul_rejects_odd_width(kernel):
    with pytest.raises(ValueError, match="even"):
        kernel(torch.zeros(2, 7))
