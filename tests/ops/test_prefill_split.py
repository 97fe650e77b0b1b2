"""The prefill split of plain eager steps (`prefill_split.PrefillSplit.plan_plain`): long prefill
chunks on the prefill backend (fa3 on Hopper), the rest of the step on the plain backend, here
two recording reference backends on the CPU. The split step's output equals the unsplit step's;
decode rows and chunks under the threshold never reach the prefill backend, nothing does before
it is ready, and decode graph steps never split."""

import random

import numpy as np
import pytest
import torch

from phloem.ops.attention import AttentionMetadata
from phloem.ops.attention.prefill_split import (
    PLAIN_PREFILL_ENV,
    PrefillSplit,
    plain_prefill_split,
    sub_step,
)
from phloem.ops.attention.reference import ReferenceAttention
from phloem.ops.attention.shared_prefix import SharedPrefixAttention

torch.set_num_threads(1)

BLOCK_SIZE = 16
SCALE = 0.4


class Recording(ReferenceAttention):
    """The reference, recording the query lengths of each step it plans, and checking that each
    forward runs the planned step on exactly its query rows."""

    def __init__(self, graphs: bool = False) -> None:
        self.planned: list[list[int]] = []
        self.sub: AttentionMetadata | None = None
        self.supports_cuda_graphs = graphs
        self.replays = 0

    def begin_step(self, sub):
        self.sub = sub
        qsl = sub.query_start_loc_cpu
        self.planned.append([b - a for a, b in zip(qsl, qsl[1:])])

    def forward(self, query, kv_cache, sub, scale, out=None, k_scale=1.0, v_scale=1.0):
        assert sub is self.sub, "forward of a step this backend did not plan"
        assert query.shape[0] >= sub.query_start_loc_cpu[-1]
        return super().forward(query, kv_cache, sub, scale, out, k_scale, v_scale)

    def end_step(self):
        self.sub = None

    def prepare_replay(self, meta, variant="plain", groups=None):
        self.replays += 1


def plain_step(seqs: list[tuple[int, int]], seed: int, num_pad: int = 2, heads=(4, 2, 8)):
    """(query [T + num_pad, H, D], kv_cache, meta) of sequences (q_len, seq_len) in this order,
    `heads` (H, H_kv, D), random non-contiguous blocks, NaN in every slot no sequence owns."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK_SIZE) for _, n in seqs) + 2
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for _, n in seqs]
    kv = torch.full((num_blocks, 2, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"))
    for table, (_, n) in zip(tables, seqs):
        pos = torch.arange(n)
        blocks = torch.tensor(table)[pos // BLOCK_SIZE]
        kv[blocks, :, pos % BLOCK_SIZE] = torch.randn(n, 2, num_kv_heads, head_dim, generator=gen)
    meta = AttentionMetadata.from_host([q for q, _ in seqs], [n for _, n in seqs], tables,
                                       BLOCK_SIZE, "cpu", padded_tables=True)  # fmt: skip
    query = torch.randn(meta.query_start_loc_cpu[-1] + num_pad, num_heads, head_dim,
                        generator=gen)  # fmt: skip
    return query, kv, meta


def split_backend(**kwargs) -> tuple[SharedPrefixAttention, Recording, Recording]:
    fallback, prefill = Recording(kwargs.pop("graphs", False)), Recording()
    backend = SharedPrefixAttention(fallback, impl="reference", prefill_backend=prefill, **kwargs)
    return backend, fallback, prefill


DECODE, SHORT, LONG = (1, 40), (63, 90), (64, 64)  # (q_len, seq_len); 63 stays, 64 goes
LAYOUTS = {
    "long chunks last (slices)": [DECODE, DECODE, SHORT, LONG, (100, 150)],
    "interleaved (indices)": [(70, 70), DECODE, LONG, SHORT, DECODE, (65, 200), DECODE],
    "long chunks only (whole step)": [LONG, (80, 120)],
    "no long chunk (unsplit)": [DECODE, SHORT, (2, 30)],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_step_split_equals_the_unsplit_step_and_routes_rows(layout):
    seqs = LAYOUTS[layout]
    query, kv, meta = plain_step(seqs, seed=len(seqs))
    oracle = ReferenceAttention().forward(query, kv, meta, SCALE)
    backend, fallback, prefill = split_backend()
    backend.begin_step(meta)
    out = torch.full_like(query, float("nan"))  # padding rows must come back zero
    for _ in range(2):  # two layers of one step: planned once
        res = backend.forward(query, kv, meta, SCALE, out=out)
        assert res is out
        torch.testing.assert_close(out, oracle, rtol=0, atol=1e-6)
    q_lens = [q for q, _ in seqs]
    long = [q for q in q_lens if q >= 64]
    rest = [q for q in q_lens if q < 64]
    assert prefill.planned == ([long] if long else [])
    assert fallback.planned == ([rest] if rest else [])
    assert backend.stats()["plain_prefill_split_steps"] == int(bool(long))
    assert backend.stats()["plain_steps"] == 1 and backend.last_path == "reference"
    if long and not rest:
        assert prefill.sub is meta  # a step of long chunks only goes whole
    backend.end_step()
    assert prefill.sub is None and fallback.sub is None


def test_nothing_splits_before_ready_or_when_switched_off():
    query, kv, meta = plain_step(LAYOUTS["interleaved (indices)"], seed=1)
    backend, fallback, prefill = split_backend()
    ready = [False]
    backend.defer_prefill_backend(lambda: ready[0])
    backend.begin_step(meta)
    backend.forward(query, kv, meta, SCALE)
    assert prefill.planned == [] and fallback.sub is meta
    ready[0] = True
    backend.begin_step(meta)
    assert len(prefill.planned) == 1
    off, fallback, prefill = split_backend(prefill_plain_steps=False)
    off.begin_step(meta)
    assert prefill.planned == [] and fallback.sub is meta
    assert off.stats()["plain_prefill_split_steps"] == 0


def test_decode_graph_steps_never_split():
    """A decode graph replay plans the fallback's graph buffers only; an eager decode-only
    step stays whole on the fallback."""
    backend, fallback, prefill = split_backend(graphs=True)
    _, _, meta = plain_step([DECODE] * 3, seed=2, num_pad=0)
    backend.prepare_replay(meta)
    backend.begin_step(meta)
    assert fallback.replays == 1 and fallback.sub is meta and prefill.planned == []


def test_env_switch():
    assert plain_prefill_split({}) is True
    assert plain_prefill_split({PLAIN_PREFILL_ENV: "0"}) is False
    with pytest.raises(ValueError, match=PLAIN_PREFILL_ENV):
        plain_prefill_split({PLAIN_PREFILL_ENV: "no"})


def test_sub_step_token_index_and_the_chunk_cap():
    """Token indices of non-contiguous sequences, built without a Python loop over tokens; more
    chunks than the prefill backend's workspace holds: no split."""
    seqs = [(3, 3), (1, 5), (2, 9), (1, 1), (4, 4)]
    _, _, meta = plain_step(seqs, seed=3)
    qsl = np.asarray(meta.query_start_loc_cpu)
    step = sub_step(meta, qsl, np.array([0, 2, 4]), padded_tables=False)
    assert step.index.tolist() == [0, 1, 2, 4, 5, 7, 8, 9, 10]
    assert step.sub.seq_lens_cpu == [3, 9, 4] and step.sub.query_start_loc_cpu == [0, 3, 5, 9]
    assert sub_step(meta, qsl, np.array([1, 2]), False).index == slice(3, 6)
    split = PrefillSplit(Recording(), min_query_len=2, max_num_seqs=2)
    assert split.plan_plain(meta, Recording()) is None  # three chunks of >= 2 queries


# -- on a Hopper GPU: fa3 for the long chunks, fa2 for the rest -------------------------------

GPU_LAYOUTS = {**LAYOUTS, "prefill-heavy": [(1, 2100)] * 40 + [(2048, 2048)] * 3 + [(60, 1500)]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_gpu_fa3_plain_split(layout, monkeypatch):
    """Llama-8B heads, bf16: the "auto" backend's plain steps split to fa3 on Hopper, and match
    the float32 reference and the unsplit fa2 step (PHLOEM_FA3_PLAIN_PREFILL=0) within bf16
    rounding; an FP8 cache gets no prefill backend."""
    pytest.importorskip("flashinfer")
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 needs Hopper")
    from phloem.ops.attention import get_attention_backend

    scale = 128**-0.5
    geometry = dict(num_heads=32, num_kv_heads=8, head_dim=128, scale=scale,
                    dtype=torch.bfloat16, device=torch.device("cuda"))  # fmt: skip
    query, kv, meta = plain_step(GPU_LAYOUTS[layout], seed=4, heads=(32, 8, 128))
    q, kv16 = query.to("cuda", torch.bfloat16), kv.to("cuda", torch.bfloat16)
    want = ReferenceAttention().forward(q.float(), kv16.float(), meta, scale)
    outs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(PLAIN_PREFILL_ENV, switch)
        backend = get_attention_backend("auto", **geometry)
        assert isinstance(backend, SharedPrefixAttention) and backend.prefill is not None
        backend.begin_step(meta)
        outs.append(backend.forward(q, kv16, meta, scale))
        torch.testing.assert_close(outs[-1].float(), want, rtol=0, atol=2e-2)
        long = any(q_len >= 64 for q_len, _ in GPU_LAYOUTS[layout])
        assert backend.stats()["plain_prefill_split_steps"] == int(long and switch == "1")
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=0, atol=2e-2)
    fp8 = get_attention_backend("auto", **geometry, kv_dtype=torch.float8_e4m3fn)
    assert fp8.prefill is None
