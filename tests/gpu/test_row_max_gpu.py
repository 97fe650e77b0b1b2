"""`ops.row_max` on CUDA, where it takes the two-stage path by itself: the same ids and values as
`max(dim=-1)` on a 128K-vocabulary bf16 step of 1-16 rows."""

import pytest
import torch

from phloem.ops.row_max import row_max

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("rows", [1, 16, 65])
def test_two_stage_max_matches_max_on_cuda(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, 128_256, device="cuda", generator=gen).to(torch.bfloat16)
    logits[0, [7, 90_001]] = 30.0  # a tie across chunks: the first index wins
    values, ids = row_max(logits)
    want_values, want_ids = logits.max(dim=-1)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
    assert int(ids[0]) == 7
