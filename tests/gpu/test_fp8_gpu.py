"""FP8 W8A8 on the GPU (issue 18): the CUDA GEMM path (`torch._scaled_mm`, row-wise scales)
against the CPU-exact reference of the same quantized operands, block-scaled checkpoints
requantized per channel on CUDA, and an FP8 engine on Llama-3.1-8B shapes (2 layers, random
weights, bf16): CUDA graphs give the eager run's tokens, and its greedy tokens mostly agree with
the bf16 engine's (printed; the bar is loose because random weights have near-tied logits).

Tolerances: the GPU accumulates in fp32 in another order and rounds its output to bfloat16, so
each output may differ from the reference by 2^-7 of itself plus 1e-3 of its row's largest
output; nothing else may differ (same fp8 operands, same scales)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.engine_runs import first_token_agreement, greedy, llama8b_two_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_gpu(), reason="needs FP8 tensor cores (sm >= 8.9)")


@needs_fp8
@pytest.mark.parametrize("m", [1, 7, 256])
@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (14336, 4096), (512, 1024)])
def test_scaled_mm_matches_cpu_reference(m, k, n):
    from phloem.layers.quantization import fp8_math

    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w_q, w_s = fp8_math.quantize_per_channel(w)
    x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
    assert fp8_math.scaled_mm_supported(w_q)
    got = fp8_math.fp8_linear_scaled_mm(x, w_q, w_s).float().cpu()
    ref = fp8_math.fp8_linear_reference(x.cpu(), w_q.cpu(), w_s.cpu()).float()
    exact = fp8_math.fp8_linear_reference(x.cpu().float(), w_q.cpu(), w_s.cpu())
    row_max = exact.abs().amax(dim=1, keepdim=True)
    assert ((got - exact).abs() <= 2**-7 * exact.abs() + 1e-3 * row_max).all()
    assert ((ref - exact).abs() <= 2**-8 * exact.abs() + 1e-6).all()  # bf16 output rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "k"), [(1, 4096), (37, 14336), (300, 5000)])
def test_triton_per_token_quant_is_bit_exact(dtype, rows, k):
    """The CUDA quantizer (phloem/ops/fp8_quant.py) gives the CPU's bytes and scales."""
    from phloem.layers.quantization import fp8_math
    from phloem.ops.fp8_quant import per_token_quant

    g = torch.Generator(device="cuda").manual_seed(rows + k)
    x = torch.randn(rows, k, device="cuda", generator=g) * 10 ** torch.empty(
        rows, 1, device="cuda").uniform_(-4, 4, generator=g)  # fmt: skip
    x = x.to(dtype)
    x[0] = 0.0
    q, scale = per_token_quant(x, fp8_math.MIN_SCALE)
    ref_q, ref_scale = fp8_math.quantize_per_token(x.cpu())
    assert torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))


@needs_fp8
def test_fp8_layer_runs_scaled_mm_and_block_weights_are_requantized():
    from phloem.layers.linear import MergedColumnLinear
    from phloem.layers.quantization import fp8_math
    from phloem.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme

    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = MergedColumnLinear(512, [768, 768], dtype=torch.bfloat16)
    method = Fp8LinearMethod(Fp8Scheme(serialized=True, weight_strategy="block",
                                       block_size=(128, 128), weight_scale_name="weight_scale_inv"))  # fmt: skip
    layer.set_quant_method(method)
    dense = []
    for i in range(2):
        w = torch.randn(768, 512, device="cuda") * torch.rand(768, 1, device="cuda")
        scale = torch.rand(6, 4, device="cuda") / 448 + 1e-4
        q = fp8_math.quantize(w, fp8_math.expand_block_scales(scale, (128, 128), w.shape))
        dense.append(q.float() * fp8_math.expand_block_scales(scale, (128, 128), w.shape))
        layer.weight.weight_loader(layer.weight, q, i)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, i)
    method.process_weights_after_loading(layer)
    assert method.block_k is None and layer.weight_scale.shape == (1536,)
    back = fp8_math.dequantize_weight(layer.weight, layer.weight_scale, None)
    want = torch.cat(dense)
    assert ((back - want).abs() <= 2**-4 * want.abs() + 2**-10 * layer.weight_scale[:, None]).all()
    x = torch.randn(9, 512, device="cuda", dtype=torch.bfloat16)
    ref = fp8_math.fp8_linear_reference(x, layer.weight, layer.weight_scale).float()
    got = layer(x).float()
    assert ((got - ref).abs() <= 2**-7 * ref.abs() + 1e-3 * ref.abs().amax(1, keepdim=True)).all()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return llama8b_two_layers(tmp_path_factory.mktemp("llama8b"))


@needs_fp8
def test_fp8_engine_graphs_and_agreement(setup):
    path, prompts = setup
    eager, _ = greedy(path, prompts, quantization="fp8", enforce_eager=True)
    graphed, graphs = greedy(path, prompts, quantization="fp8")
    assert graphs, "CUDA graphs were not captured"
    assert graphed == eager
    dense, _ = greedy(path, prompts)
    first, prefix = first_token_agreement(graphed, dense)
    print(f"fp8 vs bf16: first-token agreement {first:.2f}, tokens before divergence {prefix}")
    assert first >= 0.5, (first, prefix)
