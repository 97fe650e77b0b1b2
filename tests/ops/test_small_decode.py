"""Small-batch decode attention (split-KV merged in the launch) against float64 paged attention,
on fresh random steps: non-contiguous block ids, lengths of 1 and off the block size, batch 1
and several, GQA 1/4/8, more splits than tiles, NaN in every cache slot no sequence owns and in
the whole workspace before the first launch (a split that skips its partial, or a merge that
reads an empty split's O, fails), and launches in a row on one workspace (the counters' reset).
The Triton kernel runs under TRITON_INTERPRET=1 on the CPU at tiny shapes; the backend, the
switch and the engine run the torch path there."""

from __future__ import annotations

import random

import pytest
import torch

from phloem.ops.attention import AttentionMetadata, get_attention_backend
from phloem.ops.attention import small_decode as sd
from phloem.ops.attention import small_decode_rule as rule
from phloem.ops.attention.reference import ReferenceAttention, paged_attention_reference
from phloem.ops.kv_store import allocate_kv_cache

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def kernel(triton_kernels):
    """The Triton module; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    return triton_kernels("phloem.ops.attention.small_decode_triton", "small_decode_kernel")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_step(lens, num_kv_heads, gqa, head_dim, block_size, seed, layout="NHD"):
    """(query float32 [B + 1 padding row, H, D], cache float32 with NaN in unowned slots, meta
    with host and padded device tables); block ids shuffled, so no table is contiguous."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    pages = [-(-n // block_size) for n in lens]
    free = list(range(sum(pages) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages]
    num_blocks = sum(pages) + 3
    kv = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32,
                           "cpu", layout)  # fmt: skip
    kv.fill_(float("nan"))
    for table, n in zip(tables, lens):
        pos = torch.arange(n)
        ids, off = torch.tensor(table)[pos // block_size], pos % block_size
        kv[ids, :, off] = torch.randn(n, 2, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(len(lens) + 1, gqa * num_kv_heads, head_dim, generator=gen)
    meta = AttentionMetadata.from_host([1] * len(lens), list(lens), tables, block_size,
                                       device="cpu", padded_tables=True)  # fmt: skip
    return query, kv, meta


def launch(kernel, plan: sd.SmallDecodePlan, query, kv, meta, scale, **options):
    """Upload the step and run the kernel on `device()`; the output of its B rows."""
    dev = device()
    plan.upload(meta)
    q, out = query[: meta.num_seqs].to(dev), torch.empty_like(query[: meta.num_seqs]).to(dev)
    plan.run(q, kv.to(dev), out, scale, **options)
    return out.cpu()


CASES = [  # (lens, H_kv, GQA, D, block size, S_max, split tokens, block_n, layout)
    ([1], 2, 1, 16, 4, 4, 4, 16, "NHD"),  # one token: 1 split of 4 (no merge)
    ([5, 1, 37, 16], 2, 4, 16, 4, 3, 16, 16, "NHD"),  # off the block size; 1, 1, 3, 1 splits
    ([40, 9], 1, 8, 32, 16, 8, 8, 16, "HND"),  # GQA 8, head-major cache; 3 (one a tile), 1
    ([70], 2, 4, 64, 16, 2, 32, 32, "NHD"),  # head_dim 64, S_max 2 of 3 tiles: a ragged split
    ([3, 61], 2, 1, 16, 8, 1, 4, 16, "NHD"),  # S_max 1: no merge; 4 tiles in a row
    ([1, 20, 45, 200], 1, 4, 16, 8, 4, 16, 16, "NHD"),  # 1, 2, 3, S_max = 4 splits (3-4 tiles)
]


@pytest.mark.parametrize("lens,kv_heads,gqa,head_dim,bs,splits,tokens,block_n,layout", CASES)
def test_kernel_and_torch_path_match_float64(kernel, lens, kv_heads, gqa, head_dim, bs, splits,
                                             tokens, block_n, layout):  # fmt: skip
    query, kv, meta = make_step(lens, kv_heads, gqa, head_dim, bs, seed=len(lens) * 7 + gqa,
                                layout=layout)  # fmt: skip
    scale = head_dim**-0.5
    want = paged_attention_reference(query.double(), kv.double(), meta, scale)[: len(lens)]
    plan = sd.SmallDecodePlan(4, gqa * kv_heads, kv_heads, head_dim, 16, device(), splits,
                              split_tokens=tokens)  # fmt: skip
    plan.opart.fill_(float("nan"))
    plan.lpart.fill_(float("nan"))
    for prefetch in (False, True):  # the plain and the register-pipelined inner loop
        got = launch(kernel, plan, query, kv, meta, scale, block_n=block_n, prefetch=prefetch)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert not plan.counters.any()  # every merging program set its counter back to 0
    torch_path = sd.small_decode_torch(query[: len(lens)], kv, lens, meta.block_tables_cpu,
                                       splits, scale, block_n, split_tokens=tokens)  # fmt: skip
    torch.testing.assert_close(torch_path.double(), want, rtol=1e-5, atol=1e-5)


def test_launches_in_a_row_reuse_the_workspace(kernel):
    """Three steps of different batches, lengths and dtypes on one plan (the counters reset
    by each launch's merging programs): each matches float64 within its dtype's rounding.
    (Under the interpreter the kernel computes bf16 in fp32: Triton 3.9's interpreted bf16
    `tl.dot` returns garbage; the GPU benchmark's checks cover bf16 compiled.)"""
    plan = sd.SmallDecodePlan(3, 8, 2, 16, 8, device(), splits=4, split_tokens=8)
    plan.opart.fill_(float("nan"))
    plan.lpart.fill_(float("nan"))
    # splits used: 2, 1, 2 / 1 / 1, 2
    steps = (([17, 2, 30], torch.float16, 2e-3), ([1], torch.bfloat16, 2e-2),
             ([9, 31], torch.bfloat16, 2e-2))  # fmt: skip
    for seed, (lens, dtype, atol) in enumerate(steps):
        query, kv, meta = make_step(lens, 2, 4, 16, 4, seed=100 + seed)
        query, kv = query.to(dtype), kv.to(dtype)
        want = paged_attention_reference(query.double(), kv.double(), meta, 0.3)[: len(lens)]
        got = launch(kernel, plan, query, kv, meta, 0.3, block_n=16)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)
        assert not plan.counters.any()


def test_kernel_reads_an_fp8_cache_with_scales(kernel):
    """float8_e4m3fn K/V (read as stored * k_scale / v_scale) with float16 queries, the
    kernel and the torch path."""
    query, kv, meta = make_step([13, 26], 2, 4, 16, 4, seed=5)
    kv8, q16 = kv.clamp(-448, 448).to(torch.float8_e4m3fn), (query * 2).half()
    plan = sd.SmallDecodePlan(2, 8, 2, 16, 8, device(), splits=3, split_tokens=8)
    want = paged_attention_reference(q16.double(), kv8.double(), meta, 0.4, k_scale=0.5,
                                     v_scale=2.0)[:2]  # fmt: skip
    for prefetch in (False, True):
        got = launch(kernel, plan, q16, kv8, meta, 0.4, k_scale=0.5, v_scale=2.0, block_n=16,
                     prefetch=prefetch)  # fmt: skip
        torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-3)
    torch_path = sd.small_decode_torch(q16[:2], kv8, [13, 26], meta.block_tables_cpu, 3, 0.4,
                                       16, k_scale=0.5, v_scale=2.0, split_tokens=8)  # fmt: skip
    torch.testing.assert_close(torch_path.double(), want, rtol=0, atol=5e-3)


def test_split_rule_and_ranges():
    """S_max (the grid) is about WAVES waves of SMs (132 on an H200) over B x H_kv programs:
    Llama-3.1-8B's 8 KV heads 32 / 16 / 4 at batch 1 / 4 / 16, its TP = 2 shard (4 KV heads)
    32 / 32 / 8; capped by what the longest sequence can use. A sequence uses one split per
    `split_tokens` tokens, at most S_max and its tile count; its ranges are balanced whole
    tiles, none empty."""
    assert [sd.max_splits(b, 8, 132) for b in (1, 4, 16, 32, 128)] == [32, 16, 4, 2, 1]
    assert [sd.max_splits(b, 4, 132) for b in (1, 4, 16)] == [32, 32, 8]
    assert sd.max_splits(1, 8, 132, max_seq_len=300, split_tokens=64) == 5
    assert [sd.splits_used(n, 4, 64, 32) for n in (1, 64, 65, 200, 4096)] == [1, 1, 2, 4, 4]
    assert sd.splits_used(70, 8, 4, 32) == 3  # never more splits than tiles
    assert sd.split_ranges(70, 3, 16) == [(0, 16), (16, 48), (48, 70)]
    assert sd.split_ranges(100, 4, 16) == [(0, 16), (16, 48), (48, 80), (80, 100)]
    assert sd.split_ranges(1, 1, 32) == [(0, 1)]
    with pytest.raises(ValueError, match="split_tokens"):
        sd.SmallDecodePlan(1, 2, 1, 16, 4, "cpu", split_tokens=-1)


def test_switch_parsing():
    """PHLOEM_SMALL_DECODE_*: auto by default, 0 / 1, the batch cap and the length override;
    anything else raises naming the variable."""
    assert rule.SmallDecodeSettings.from_env({}) == rule.SmallDecodeSettings("auto", 16, None)
    assert rule.SmallDecodeSettings.from_env({rule.ENV_SWITCH: "auto"}).mode == "auto"
    on = rule.SmallDecodeSettings.from_env({rule.ENV_SWITCH: "1", rule.ENV_MAX_BATCH: "32"})
    assert (on.mode, on.max_batch, on.length_rule()) == ("1", 32, None)  # every length
    capped = rule.SmallDecodeSettings.from_env({rule.ENV_MAX_KV: "300"})
    assert capped.length_rule() == rule.LengthRule(300, 300)
    assert rule.SmallDecodeSettings.from_env({rule.ENV_SWITCH: "1", rule.ENV_MAX_KV: "300"}
                                             ).length_rule() == rule.LengthRule(300, 300)  # fmt: skip
    for env in ({rule.ENV_SWITCH: "yes"}, {rule.ENV_SWITCH: "1", rule.ENV_MAX_BATCH: "0"},
                {rule.ENV_MAX_KV: "-5"}, {rule.ENV_MAX_KV: "1k"}):  # fmt: skip
        with pytest.raises(ValueError, match=list(env)[-1]):
            rule.SmallDecodeSettings.from_env(env)


def test_the_default_is_the_length_rule_on_cuda_over_flashinfer():
    """auto: wrapped on CUDA over FlashInfer only (the CPU's reference stays plain); 1: any
    plain backend anywhere; 0: none. The rule: <= 1,024 KV tokens at batch 1, <= 512 above."""
    auto, on, off = (rule.SmallDecodeSettings(m) for m in ("auto", "1", "0"))
    assert auto.enabled("cuda:0", "flashinfer") and not auto.enabled("cuda", "reference")
    assert not auto.enabled("cpu", "reference") and not auto.enabled(None, "flashinfer")
    assert on.enabled("cpu", "reference") and not off.enabled("cuda", "flashinfer")
    length = auto.length_rule()
    assert length == rule.LengthRule(1024, 512)
    assert length.allows(1, 1024) and not length.allows(1, 1025)
    assert length.allows(2, 512) and not length.allows(2, 513) and not length.allows(16, 600)


class GraphPlain(ReferenceAttention):
    """The reference declared able to plan "plain" graph steps (a test double: records the
    variants it was asked to plan)."""

    supports_cuda_graphs = True

    def __init__(self) -> None:
        super().__init__()
        self.replays: list[str] = []

    def prepare_replay(self, meta, variant="plain", groups=None):
        if variant != "plain":
            raise ValueError(f"unknown variant {variant!r}")
        self.replays.append(variant)


def test_the_rule_picks_each_step_path_and_graph_variant():
    """Eager steps and `plan_decode` follow the batch cap and the length rule; the
    "small_decode" variant (up to max_batch) is planned into our buffers, "plain" on the
    fallback, also under the shared-prefix backend, whose own paths stay as they were."""
    from phloem.ops.attention.interface import DecodePath, DecodePlan
    from phloem.ops.attention.shared_prefix import SharedPrefixAttention
    from phloem.ops.attention.sharing_rule import SharingRule

    fallback = GraphPlain()
    backend = sd.SmallDecodeAttention(fallback, 4, 2, 16, "cpu", max_batch=4,
                                      max_num_blocks_per_seq=8, length_rule=rule.LengthRule(20, 10))  # fmt: skip
    assert backend.graph_variants() == {"plain": 1, "small_decode": 1}
    assert backend.graph_variant_max_batch() == {"small_decode": 4}
    small, graph = DecodePlan(DecodePath.SMALL_GRAPH), DecodePlan(DecodePath.GRAPH)
    cases = [([20], small), ([21], graph), ([10, 3], small), ([11, 3], graph),
             ([1, 2, 3, 4], small), ([1, 2, 3, 4, 5], graph)]  # fmt: skip
    shared = SharedPrefixAttention(backend)
    assert shared.graph_variants() == backend.graph_variants()
    assert shared.graph_variant_max_batch() == {"small_decode": 4}
    for lens, want in cases:
        tables = [[i] for i in range(len(lens))]
        assert backend.plan_decode(lens, tables, [0] * len(lens), 32) == want, lens
        assert shared.plan_decode(lens, tables, [0] * len(lens), 32) == want, lens
        meta = AttentionMetadata.from_host([1] * len(lens), lens, tables, 32)
        backend.begin_step(meta)
        assert backend._small == (want == small), lens
        backend.end_step()
    assert backend.stats() == {"small_decode_steps": 3}
    _, _, meta = make_step([7, 19], 2, 2, 16, 4, seed=5)
    shared.prepare_replay(meta, "small_decode")
    shared.prepare_replay(meta, "plain")
    assert fallback.replays == ["plain"] and backend.stats()["small_decode_steps"] == 4
    assert shared.stats()["cuda_graph_steps"] == 2
    with pytest.raises(ValueError, match="unknown"):
        shared.prepare_replay(meta, "other")
    big = AttentionMetadata.from_host([1] * 5, [3] * 5, [[0]] * 5, 4)
    with pytest.raises(ValueError, match="small_decode"):
        backend.prepare_replay(big, "small_decode")
    # a fallback without graphs offers no graph variant
    assert "small_decode" not in sd.SmallDecodeAttention(ReferenceAttention(), 4, 2, 16,
                                                         "cpu").graph_variants()  # fmt: skip
    # where sharing pays, the shared backend's own path; where not, the small-decode graph
    shared.rule = SharingRule(
        min_saved_kv_tokens=16, partial_cost_tokens=1, graph_min_saved_kv_tokens=16
    )
    lens, tables = [9, 10, 10, 3], [[7, 8, 1], [7, 8, 2], [7, 8, 3], [9]]
    assert shared.plan_decode(lens, tables, [8, 8, 8, 0], 4).path is DecodePath.EAGER
    assert shared.plan_decode(lens, tables, [8, 8, 0, 0], 4) == small  # 8 saved < 16


def test_backend_takes_small_decode_steps_only(monkeypatch):
    """The factory wraps the plain backend when the switch is on (auto: not on the CPU);
    decode steps of <= max_batch sequences (eager, or planned for a "small_decode" graph) run
    the split path (padding rows zeroed), larger or mixed steps the fallback; counters reset
    with the fallback's."""
    geometry = dict(num_heads=4, num_kv_heads=2, head_dim=16, device="cpu",
                    max_num_blocks_per_seq=8)  # fmt: skip
    assert isinstance(get_attention_backend("reference", **geometry), ReferenceAttention)
    assert isinstance(get_attention_backend("auto", **geometry), ReferenceAttention)
    monkeypatch.setenv(rule.ENV_SWITCH, "1")
    monkeypatch.setenv(rule.ENV_MAX_BATCH, "2")
    backend = get_attention_backend("reference", **geometry)
    assert isinstance(backend, sd.SmallDecodeAttention) and backend.max_batch == 2
    assert backend.name == "reference+small_decode"
    query, kv, meta = make_step([7, 19], 2, 2, 16, 4, seed=11)
    want = paged_attention_reference(query.double(), kv.double(), meta, 0.25)
    for plan in (backend.begin_step, lambda m: backend.prepare_replay(m, "small_decode")):
        plan(meta)
        got = backend.forward(query, kv, meta, 0.25)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        backend.end_step()
    assert backend.stats() == {"small_decode_steps": 2}
    big_q, big_kv, big = make_step([7, 19, 3], 2, 2, 16, 4, seed=12)
    mixed = AttentionMetadata.from_host([1, 3], [7, 19], meta.block_tables_cpu, 4,
                                        device="cpu", padded_tables=True)  # fmt: skip
    mixed_q = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(3))
    for q, cache, step in ((big_q, big_kv, big), (mixed_q, kv, mixed)):
        got = backend.forward(q, cache, step, 0.25)
        ref = paged_attention_reference(q.double(), cache.double(), step, 0.25)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert backend.stats() == {"small_decode_steps": 2}
    backend.reset_stats()
    assert backend.stats() == {"small_decode_steps": 0}


def test_switch_gives_the_same_greedy_tokens(tmp_path_factory, embedded_tokenizer_dir,
                                             monkeypatch):  # fmt: skip
    """A tiny float32 Llama (GQA 2), decode batches of 4 down to 1: with the switch on (a
    length limit of 20 KV tokens) its short decode steps take the split path (torch on the CPU: CPU_TARGET_PROGRAMS and
    CPU_SPLIT_TOKENS give up to 16 splits of 4 tokens at batch 1; the kernel on a GPU, eagerly: FlashInfer has no head_dim 16) and the greedy tokens
    are the plain backend's."""
    from phloem import LLM, SamplingParams
    from tests.engine.tiny_models import VOCAB, tiny_model_dir

    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_small_dec", 3)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(6 + 3 * i)]}
               for i in range(4)]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(4)]  # fmt: skip

    def run() -> tuple[list[list[int]], dict]:
        llm = LLM(str(path), block_size=4, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=1 << 20, dtype="float32")  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.executor.worker.model_runner.backend.stats()
        return [list(o.outputs[0].token_ids) for o in outs], stats

    monkeypatch.delenv(rule.ENV_SWITCH, raising=False)  # auto: off on the CPU
    plain, _ = run()
    monkeypatch.setenv(rule.ENV_SWITCH, "1")
    monkeypatch.setenv(rule.ENV_MAX_KV, "20")  # the last steps (21-24 KV tokens) run plain
    tokens, stats = run()
    assert tokens == plain
    # the longest request's decode steps read 16..23 KV tokens: those up to 20 ran here
    assert stats["small_decode_steps"] == 5, stats


COMPILE_FOR_HOPPER = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from phloem.ops.attention import small_decode_triton as sdt

fn = sdt.small_decode_kernel
types = dict(opart_ptr="*fp32", lpart_ptr="*fp32", count_ptr="*i32", seq_lens_ptr="*i32",
             indptr_ptr="*i32", pages_ptr="*i32", scale_log2="fp32", k_scale="fp32",
             v_scale="fp32")
for gqa, dim, kv, prefetch in ((4, 128, "bf16", False), (8, 64, "fp8e4nv", False),
                               (4, 128, "bf16", True)):
    const = dict(GQA=gqa, HEAD_DIM=dim, BLOCK_D=dim, BLOCK_M=16, BLOCK_N=32, PAGE=16,
                 PRECISION="tf32", INTERPRET=False, G=gqa, SPLIT_CHUNK=4096 // (gqa * dim),
                 PREFETCH=prefetch, F16_MATH=kv == "fp8e4nv", FP8_MMA=False)
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    sig.update(q_ptr="*bf16", out_ptr="*bf16", kv_ptr="*" + kv)
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs={})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=2)).asm["ptx"]
    assert "mma" in ptx, "QK^T and PV on the tensor cores"
    atomics = re.findall(r"atom\.global\.gpu\.[\w.]+", ptx)
    # stores, a CTA barrier, then one thread's release (the merge's handshake)
    assert atomics == ["atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.relaxed.exch.b32"]
    head = ptx[: ptx.index("atom.global.gpu.acq_rel")]
    assert head.rfind("bar.sync") > head.rfind("st.global"), "barrier after the partials"
    assert "ld.global.cg" in ptx, "the merge reads the partials past L1"
    print("compiled", gqa, dim, kv, prefetch)
"""


def test_kernel_compiles_for_hopper(compile_for_hopper):
    """The GPU compiler (which rejects what the interpreter accepts) takes the kernel for
    Llama-3.1-8B (bf16, GQA 4, head_dim 128; plain and prefetching inner loops) and for an FP8
    cache (GQA 8, head_dim 64):
    tensor-core products; the partial stores, a CTA barrier, then the counter's acq_rel atomic
    (CUTLASS's semaphore order), and L1-bypassing loads in the merge."""
    assert compile_for_hopper(COMPILE_FOR_HOPPER).count("compiled") == 3
