"""CUDA-graph bucket choice and the sync-free KV write of the runners' steps (both testable on the
CPU)."""

import numpy as np
import pytest
import torch

import phloem.layers.attention as attention_layer
from phloem.forward_context import ForwardContext, forward_context
from phloem.layers.attention import Attention
from phloem.ops.attention import AttentionMetadata
from phloem.ops.attention.reference import ReferenceAttention
from phloem.worker.cuda_graph import (
    CUDAGraphRunner,
    decode_graph_max_batch,
    graph_batch_sizes,
    graph_logits_max_batch,
)
from phloem.worker.input_batch import HostStep


def test_buckets_cover_every_batch():
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]
    for n in range(1, 257):
        assert any(s >= n for s in sizes)


def test_graph_logits_switch_is_read_and_checked():
    assert graph_logits_max_batch({}) == 0  # off by default
    assert graph_logits_max_batch({"PHLOEM_GRAPH_LOGITS_MAX_BATCH": "16"}) == 16
    with pytest.raises(ValueError, match="PHLOEM_GRAPH_LOGITS_MAX_BATCH must be an integer"):
        graph_logits_max_batch({"PHLOEM_GRAPH_LOGITS_MAX_BATCH": "-1"})


def test_decode_graph_cap_is_read_and_checked():
    assert decode_graph_max_batch(2048, {}) == 512  # vLLM's default capture size
    assert decode_graph_max_batch(256, {}) == 256
    assert decode_graph_max_batch(2048, {"PHLOEM_DECODE_GRAPH_MAX_BATCH": "0"}) == 2048  # no cap
    assert decode_graph_max_batch(2048, {"PHLOEM_DECODE_GRAPH_MAX_BATCH": "512"}) == 512
    assert decode_graph_max_batch(256, {"PHLOEM_DECODE_GRAPH_MAX_BATCH": "512"}) == 256
    with pytest.raises(ValueError, match="PHLOEM_DECODE_GRAPH_MAX_BATCH must be an integer"):
        decode_graph_max_batch(256, {"PHLOEM_DECODE_GRAPH_MAX_BATCH": "all"})


def _layer_write(slots: list[int], valid_slots: bool) -> torch.Tensor:
    """The cache after one attention layer call on a 5-token step with these slots."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(6, 2, 4, 2, 8, generator=gen)
    n = len(slots)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.int32),
        block_size=4, max_query_len=n, max_seq_len=n,
        query_start_loc_cpu=[0, n], seq_lens_cpu=[n],
    )  # fmt: skip
    q = torch.randn(n, 4 * 8, generator=gen)
    k, v = torch.randn(n, 2 * 8, generator=gen), torch.randn(n, 2 * 8, generator=gen)
    ctx = ForwardContext(meta, [cache], ReferenceAttention(), valid_slots=valid_slots)
    with forward_context(ctx):
        Attention(4, 2, 8, 0.3, layer_idx=0)(q, k, v)
    return cache


def test_valid_slots_write_without_the_filter(monkeypatch):
    """A step whose slots are all valid (the runners' steps) writes K/V exactly as the filtering
    `write_kv` does, without calling it (its -1 filter syncs with the host: not capturable)."""
    slots = [0, 1, 2, 3, 4]
    want = _layer_write(slots, valid_slots=False)

    def no_filtering_write(*args):
        raise AssertionError("a step with valid slots must not take the filtering write")

    monkeypatch.setattr(attention_layer, "write_kv", no_filtering_write)
    got = _layer_write(slots, valid_slots=True)
    assert torch.equal(got, want)
    with pytest.raises(AssertionError, match="filtering"):
        _layer_write(slots, valid_slots=False)


def test_unchecked_slots_skip_padding():
    """Without the runners' promise, -1 slots (padding) are skipped, as `write_kv` does: slot 2
    keeps its old K/V while the tokens around it are written."""
    before = _layer_write([], valid_slots=False)  # the initial cache: nothing written
    got = _layer_write([0, 1, -1, 3, 4], valid_slots=False)
    assert torch.equal(got[0, :, 2], before[0, :, 2])
    for slot in (0, 1, 3, 4):
        block, offset = divmod(slot, 4)
        assert not torch.equal(got[block, :, offset], before[block, :, offset])


class _GraphPlain(ReferenceAttention):
    """The reference declared able to plan "plain" graph steps (a test double)."""

    supports_cuda_graphs = True

    def prepare_replay(self, meta, variant="plain", groups=None):
        assert variant == "plain"


class _Replay:
    """A captured graph's stand-in: logs its (variant, bucket) at each replay."""

    def __init__(self, log: list, key: tuple[str, int]) -> None:
        self.log, self.key = log, key

    def replay(self) -> None:
        self.log.append(self.key)


def _decode(lens: list[int], prefix_lens: list[int] | None = None) -> HostStep:
    n, bs = len(lens), 16
    zeros = np.zeros(n, dtype=np.int64)
    return HostStep(zeros, zeros, zeros, [1] * n, lens, [[1] * -(-n_kv // bs) for n_kv in lens],
                    list(range(n)), list(range(n)), prefix_lens or [0] * n, [])  # fmt: skip


def test_small_decode_graphs_are_captured_small_and_replayed_by_the_rule():
    """With the small-decode backend (under the shared-prefix one, as the factory builds it),
    the runner captures "small_decode" graphs for the buckets <= 16 only, and a decode step
    replays one when its batch and longest sequence are within the rule (<= 1,024 KV tokens
    at batch 1, <= 512 above), else the plain graph of its bucket."""
    from phloem.ops.attention.shared_prefix import SharedPrefixAttention
    from phloem.ops.attention.small_decode import SmallDecodeAttention
    from phloem.ops.attention.small_decode_rule import LengthRule

    small = SmallDecodeAttention(_GraphPlain(), 4, 2, 16, "cpu", max_num_blocks_per_seq=128,
                                 length_rule=LengthRule())  # fmt: skip
    backend = SharedPrefixAttention(small)
    runner = CUDAGraphRunner(torch.nn.Identity(), [], backend, 16, 0, 32, torch.device("cpu"))
    assert runner.captured() == [("plain", b) for b in (32, 16, 8, 4, 2, 1)] + [
        ("small_decode", b) for b in (16, 8, 4, 2, 1)
    ]
    log: list[tuple[str, int]] = []
    for key in runner.captured():  # what `capture` would record, without a GPU
        runner._graphs[key] = _Replay(log, key)
        runner._outputs[key] = torch.zeros(key[1], 8)
    steps = [([100], "small_decode", 1), ([1024], "small_decode", 1), ([1025], "plain", 1),
             ([500, 512, 3], "small_decode", 4), ([513, 3], "plain", 2),
             ([10] * 16, "small_decode", 16), ([10] * 17, "plain", 32)]  # fmt: skip
    for lens, variant, bucket in steps:
        assert runner.run_decode(_decode(lens)).shape == (len(lens), 8)
        assert log[-1] == (variant, bucket), lens
    # prefix groups that do not pay for sharing: the small-decode graph still
    assert runner.run_decode(_decode([40, 40, 9], [32, 32, 0])) is not None
    assert log[-1] == ("small_decode", 4)
    assert small.stats()["small_decode_steps"] == 5
