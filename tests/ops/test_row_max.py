"""`ops.row_max`: the two-stage row maximum equals `max(dim=-1)` (values, first index among ties,
NaN) on fresh random inputs, forced on the CPU."""

import pytest
import torch

from phloem.ops.row_max import CHUNKS, row_max


def _check(logits: torch.Tensor) -> None:
    want_values, want_ids = logits.max(dim=-1)
    values, ids = row_max(logits, split=True)
    assert ids.dtype == torch.int64 and values.dtype == logits.dtype
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [CHUNKS * 501, CHUNKS * 500 + 37, 49_152, CHUNKS - 1])
def test_random_rows_match_one_stage_max(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    _check(logits)


def test_first_index_among_ties_across_chunks_and_tail():
    vocab = CHUNKS * 100 + 13
    width = vocab // CHUNKS
    logits = torch.zeros(4, vocab)
    logits[0, [3 * width + 7, 9 * width, vocab - 1]] = 5.0  # ties in two chunks and the tail
    logits[1, [vocab - 13, vocab - 1]] = 2.0  # only in the tail
    logits[2, [width - 1, width]] = 1.0  # the last of one chunk, the first of the next
    logits[3] = -1.0  # a whole row of equal values: id 0
    _check(logits)
    assert row_max(logits, split=True)[1].tolist() == [3 * width + 7, vocab - 13, width - 1, 0]


def test_non_finite_rows_are_flagged_as_by_max():
    logits = torch.randn(4, CHUNKS * 64 + 5)
    logits[0, 1000] = float("nan")
    logits[1, -2] = float("inf")  # in the tail
    logits[2] = float("-inf")
    _check(logits)
    values = row_max(logits, split=True)[0]
    assert torch.isnan(values[0]) and values[1] == float("inf") and values[2] == float("-inf")
    assert torch.isfinite(values[3])


def test_auto_keeps_one_stage_off_cuda_and_rejects_bad_shapes():
    logits = torch.randn(2, CHUNKS * 1000)
    assert torch.equal(row_max(logits)[1], logits.argmax(dim=-1))
    with pytest.raises(ValueError, match=r"logits must be \[B, V\]"):
        row_max(torch.randn(3))
