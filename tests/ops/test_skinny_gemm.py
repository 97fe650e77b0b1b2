"""The skinny-GEMM Triton kernel (decode-sized linear layers) against float64 torch (interpreted on
the CPU), its launch checks, the PHLOEM_SKINNY_GEMM flag, and the flag's path through the linear
layers and the engine (the same greedy tokens as F.linear's)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from phloem.layers.quantization import base as quant_base


@pytest.fixture(scope="module")
def sk(triton_kernels):
    """The kernel module; on the CPU, interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    return triton_kernels("phloem.ops.skinny_gemm", "_skinny_dot_kernel")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(lead: tuple[int, ...], n: int, k: int, bias: bool, seed: int):
    """Fresh bf16 x [*lead, k], W [n, k], bias [n] or None on the test device."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return [t.to(device()) if t is not None else None for t in (x, w, b)]


def reference(x, w, b) -> torch.Tensor:
    """x W^T + b in float64 from the same bf16 values, on the CPU."""
    out = x.cpu().double() @ w.cpu().double().T
    return out if b is None else out + b.cpu().double()


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 step of the output (2^-7 relative: Triton's interpreter truncates float32
    to bf16 where the GPU rounds to nearest, 2^-8) plus fp32 accumulation error."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().double(), want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("n,k,config", [
    (64, 256, None),  # the default config
    (40, 200, dict(block_n=16, block_k=64)),  # K % block_k != 0 and N % block_n != 0
    (48, 200, dict(block_n=16, block_k=32, split_k=4)),  # split K, a ragged last split
    (32, 96, dict(block_n=16, block_k=64, split_k=2)),  # two splits, the second one partial
    (40, 80, dict(block_n=16, block_k=32, tensor_cores=True)),  # tl.dot at any rows count
])  # fmt: skip
def test_skinny_linear_matches_float64(sk, rows, n, k, config):
    x, w, b = inputs((rows,), n, k, bias=rows % 2 == 1, seed=rows * 1000 + k)
    cfg = sk.SkinnyConfig(**config) if config else None
    got = sk.skinny_linear(x, w, b, cfg)
    assert got.shape == (rows, n)
    assert_bf16_close(got, reference(x, w, b))


def test_skinny_linear_keeps_leading_dims_and_strided_rows(sk):
    x, w, b = inputs((2, 3), 24, 80, bias=True, seed=7)
    got = sk.skinny_linear(x, w, b, sk.SkinnyConfig(block_n=16, block_k=32))
    assert got.shape == (2, 3, 24)
    assert_bf16_close(got.reshape(6, 24), reference(x.reshape(6, 80), w, b))
    wide, _, _ = inputs((4,), 1, 2 * 80, bias=False, seed=8)  # rows with stride 160 > K
    view = wide.view(4, 2 * 80)[:, :80]
    assert_bf16_close(sk.skinny_linear(view, w), reference(view, w, None))


def test_skinny_linear_matches_f_linear_on_llama_like_rows(sk):
    """A TP=2 o_proj-like shape scaled down (K a multiple of the default block_k), 1 and 16 rows:
    within bf16 rounding of F.linear's result."""
    for rows in (1, 16):
        x, w, _ = inputs((rows,), 64, 1024, bias=False, seed=rows)
        got = sk.skinny_linear(x, w)
        want = F.linear(x.float(), w.float()).to(torch.bfloat16)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


def test_default_configs_fit_their_rows(sk):
    for rows in range(1, sk.MAX_ROWS + 1):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4096, 2048)):
            config = sk.config_for(rows, n, k)
            config.validate(rows)
            assert config.split_k == 1 or n // config.block_n < 512


def test_shapes_measured_slower_stay_with_cublas(sk, monkeypatch):
    x, w, _ = inputs((3,), 32, 64, bias=False, seed=0)
    assert sk.takes(x, w)
    monkeypatch.setitem(sk.CONFIGS, (4, 32, 64), None)  # 3 rows: the bucket of 4
    assert not sk.takes(x, w) and sk.takes(x[:2], w)
    config = sk.SkinnyConfig(block_n=16, block_k=32)
    monkeypatch.setitem(sk.CONFIGS, (2, 32, 64), config)
    assert sk.config_for(2, 32, 64) is config


def test_a_measured_table_loads_from_the_benchmarks_file(sk, skinny_flag, monkeypatch, tmp_path):
    import json

    monkeypatch.setattr(sk, "CONFIGS", {})
    path = tmp_path / "configs.json"
    best = dict(block_n=16, block_k=256, split_k=2, num_warps=8, num_stages=4, tensor_cores=True)
    path.write_text(json.dumps([{"rows": 1, "n": 32, "k": 64, "config": best},
                                {"rows": 4, "n": 32, "k": 64, "config": None}]))  # fmt: skip
    monkeypatch.setenv(quant_base.SKINNY_GEMM_CONFIGS_ENV, str(path))
    skinny_flag("1")
    assert quant_base.skinny_gemm_module() is sk
    assert sk.CONFIGS == {(1, 32, 64): sk.SkinnyConfig(**best), (4, 32, 64): None}
    path.write_text(json.dumps([{"rows": 1, "n": 32, "config": None}]))
    with pytest.raises(ValueError, match="bad skinny-GEMM config entry"):
        sk.load_configs(str(path))


def test_skinny_linear_rejects_what_it_cannot_take(sk):
    x, w, _ = inputs((17,), 16, 32, bias=False, seed=0)
    with pytest.raises(ValueError, match="at most 16 rows"):
        sk.skinny_linear(x, w)
    with pytest.raises(ValueError, match="input features"):
        sk.skinny_linear(x[:2, :16], w)
    with pytest.raises(ValueError, match="share a dtype"):
        sk.skinny_linear(x[:2].float(), w.float())
    with pytest.raises(ValueError, match="block_n must be >= 16"):
        sk.skinny_linear(x[:8], w, config=sk.SkinnyConfig(block_n=8))
    with pytest.raises(ValueError, match="tensor_cores=False takes at most 4 rows"):
        sk.skinny_linear(x[:5], w, config=sk.SkinnyConfig(block_n=16, tensor_cores=False))
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        sk.skinny_linear(x[:2], w, config=sk.SkinnyConfig(block_k=48))
    assert sk.takes(x[:16], w) and not sk.takes(x, w) and not sk.takes(x[:0], w)
    assert not sk.takes(x[:2].float(), w.float()) and not sk.takes(x[:2], w.T.contiguous().T)


@pytest.fixture
def skinny_flag(monkeypatch):
    """`set(value)`: PHLOEM_SKINNY_GEMM=value read afresh; the flag's cache is cleared after."""

    def set_flag(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(quant_base.SKINNY_GEMM_ENV, raising=False)
        else:
            monkeypatch.setenv(quant_base.SKINNY_GEMM_ENV, value)
        quant_base.skinny_gemm_mode.cache_clear()
        quant_base.skinny_gemm_module.cache_clear()
        quant_base.skinny_gated_module.cache_clear()
        quant_base.skinny_norm_module.cache_clear()
        quant_base.skinny_rope_module.cache_clear()

    yield set_flag
    quant_base.skinny_gemm_mode.cache_clear()
    quant_base.skinny_gemm_module.cache_clear()
    quant_base.skinny_gated_module.cache_clear()
    quant_base.skinny_norm_module.cache_clear()
    quant_base.skinny_rope_module.cache_clear()


def test_flag_defaults_to_the_measured_shapes_and_is_validated(sk, skinny_flag):
    skinny_flag(None)
    assert quant_base.skinny_gemm_mode() == "auto" and quant_base.skinny_gemm_module() is sk
    skinny_flag("0")
    assert quant_base.skinny_gemm_module() is None
    skinny_flag("yes")
    with pytest.raises(ValueError, match="PHLOEM_SKINNY_GEMM must be 0, 1 or auto"):
        quant_base.skinny_gemm_module()


def test_by_default_only_measured_shapes_take_the_kernel(sk, monkeypatch):
    x, w, _ = inputs((3,), 32, 64, bias=False, seed=5)
    assert sk.takes(x, w) and not sk.takes(x, w, measured_only=True)  # no entry: rule of thumb
    monkeypatch.setitem(sk.CONFIGS, (4, 32, 64), sk.SkinnyConfig(block_n=16, block_k=32))
    assert sk.takes(x, w, measured_only=True) and not sk.takes(x[:1], w, measured_only=True)
    monkeypatch.setitem(sk.CONFIGS, (4, 32, 64), None)  # measured slower: cuBLAS either way
    assert not sk.takes(x, w, measured_only=True) and not sk.takes(x, w)
    # the table's own entries are well-formed for the rows they serve
    for (rows, n, k), config in sk.CONFIGS.items():
        assert rows in (1, 2, 4, 8, 16) and n % 16 == 0 and k % 16 == 0
        if config is not None:
            config.validate(rows)


@pytest.fixture
def counted(sk, monkeypatch):
    """How many times the layers called `skinny_linear` (a counting wrapper, test-only)."""
    calls = []
    real = sk.skinny_linear

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(sk, "skinny_linear", counting)
    return calls


def test_flag_routes_decode_sized_dense_calls(sk, skinny_flag, counted, monkeypatch):
    from phloem.layers.linear import MergedColumnLinear, RowParallelLinear

    skinny_flag("1")
    up = MergedColumnLinear(48, [40, 40], dtype=torch.bfloat16).to(device())
    down = RowParallelLinear(40, 48, bias=True, dtype=torch.bfloat16).to(device())
    for layer in (up, down):
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) / 8)
    for rows in (1, 6, 16):
        x, _, _ = inputs((rows,), 1, 48, bias=False, seed=rows)
        h = up(x)
        assert_bf16_close(h, reference(x, up.weight, None))
        assert_bf16_close(down(h[:, :40]), reference(h[:, :40], down.weight, down.bias))
    assert len(counted) == 6
    x, _, _ = inputs((17,), 1, 48, bias=False, seed=17)  # a prefill-sized call: F.linear
    up(x)
    assert len(counted) == 6
    skinny_flag(None)  # the default: only shapes the table measured faster (up's, at 1 row)
    monkeypatch.setitem(sk.CONFIGS, (1, 80, 48), sk.SkinnyConfig(block_n=16, block_k=16))
    for rows in (1, 2):
        up(inputs((rows,), 1, 48, bias=False, seed=rows)[0])
        down(inputs((rows,), 1, 40, bias=False, seed=rows)[0])
    assert [shape[0] for shape in counted[6:]] == [1]


def test_flag_gives_the_same_greedy_tokens(sk, skinny_flag, counted, tmp_path_factory,
                                           embedded_tokenizer_dir, monkeypatch):  # fmt: skip
    """A tiny fp16 Llama, decode batches of 6 down to 1 rows (both tile products): the flag's
    greedy tokens are F.linear's, and its decode steps went through the kernel (the MLPs' down
    projections with SiLU-and-mul fused, `ops.skinny_gated`; gate_up with the norm before it,
    `ops.skinny_norm`; with PHLOEM_FUSED_QKV_ROPE=1, qkv with its norm, RoPE and the KV write,
    `ops.skinny_rope`, the first layer's norm without a residual too). fp16, not bf16:
    Triton's interpreter truncates float32 to bf16 (the GPU rounds to nearest), enough to flip
    one of this model's 27 greedy tokens; it rounds fp16 as the GPU does."""
    from phloem import LLM, SamplingParams
    from tests.engine.tiny_models import VOCAB, tiny_model_dir

    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_skinny", 11)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(5 + i)]}
               for i in range(6)]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(6)]

    def run() -> list[list[int]]:
        llm = LLM(str(path), block_size=4, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=1 << 20, dtype="float16")  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    from phloem.ops import skinny_gated, skinny_norm, skinny_rope

    monkeypatch.setattr(skinny_gated, "MAX_SILU_PER_WEIGHT", 16.0)  # every decode row fuses
    fused, normed, roped = [], [], []
    real, real_norm = skinny_gated.silu_and_mul_linear, skinny_norm.rms_norm_linear
    real_rope = skinny_rope.qkv_rope_kv
    monkeypatch.setattr(skinny_gated, "silu_and_mul_linear",
                        lambda *a: fused.append(a[0].shape[0]) or real(*a))  # fmt: skip
    monkeypatch.setattr(skinny_norm, "rms_norm_linear",
                        lambda *a: normed.append(a[1] is None) or real_norm(*a))  # fmt: skip
    monkeypatch.setattr(skinny_rope, "qkv_rope_kv", lambda *a: roped.append(
        None if len(a) < 5 or a[4] is None else a[4].residual is None) or real_rope(*a))  # fmt: skip
    skinny_flag("0")
    plain = run()
    assert not counted and not fused and not normed and not roped
    monkeypatch.setenv(quant_base.FUSED_QKV_ROPE_ENV, "1")
    skinny_flag("1")
    assert run() == plain
    rows = {shape[0] for shape in counted}  # CPU: 6..1; CUDA: the graphs' batch sizes
    assert 1 in rows and max(rows) >= sk.DOT_MIN_ROWS, rows  # both tile products
    assert 1 in fused and max(fused) >= sk.DOT_MIN_ROWS, fused
    assert normed and not any(normed)  # gate_up's norms (qkv's: in skinny_rope)
    assert True in roped and False in roped  # the first layer's norm (no residual) too


COMPILE_FOR_HOPPER = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from phloem.ops import skinny_gemm as sk

types = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", r_ptr="*bf16", nw_ptr="*bf16",
             ro_ptr="*bf16", M="i32", N="i32", K="i32", K_PER_SPLIT="i32", s_xm="i32",
             s_wn="i32", s_om="i32", eps="fp32")
built = []
fma, dot = sk._skinny_fma_kernel, sk._skinny_dot_kernel
for fn, rows, split, block_n, fused in ((fma, 1, False, 8, ""), (fma, 4, True, 8, ""),
                                        (dot, 16, False, 16, ""), (dot, 16, True, 64, ""),
                                        (fma, 2, False, 4, "gated"), (dot, 16, True, 16, "gated"),
                                        (fma, 4, False, 8, "norm"), (dot, 8, False, 16, "norm")):
    gated = fused == "gated"
    const = dict(HAS_BIAS=not split, BLOCK_N=block_n, BLOCK_K=256, EVEN_K=True, SPLIT=split,
                 GATED=gated, NORM=fused == "norm", HAS_RES=fused == "norm",
                 **(dict(INTERPRET=False) if fn is dot else dict(ROWS=rows)))
    sig = {n: "constexpr" if n in const else types.get(n, "*fp32" if split else "*bf16")
           for n in fn.arg_names}
    # what a launch specializes on: 16-byte aligned pointers, ints divisible by 16 (not M)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in const and n != "M"}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=3)).asm["ptx"]
    assert ("mma" in ptx) == (fn is dot), "only the tl.dot product runs on the tensor cores"
    assert (".gpu.relaxed.add." in ptx) == split, "split K adds its partial sums atomically"
    assert ("cp.async" if fn is dot else "ld.global.v4") in ptx, "W in 16-byte vectors"
    assert ("ex2.approx" in ptx) == gated, "gated: silu(gate) * up computed in the kernel"
    assert ("rsqrt.approx" in ptx) == (fused == "norm"), "norm: each row's 1 / rms"
    built.append(f"{fn.fn.__name__} rows={rows} split={split} fused={fused}")
print("compiled:", "; ".join(built))
"""


def test_kernel_compiles_for_hopper(compile_for_hopper):
    """The GPU compiler (which rejects what the interpreter accepts) takes every variant:
    CUDA-core and tensor-core products, with and without split-K atomics, W read in 16-byte
    vectors (or staged by cp.async), and both products with SiLU-and-mul fused (GATED) and with
    the residual add + RMSNorm fused (NORM)."""
    out = compile_for_hopper(COMPILE_FOR_HOPPER)
    assert out.count("rows=") == 8


RECORD_VARIANTS = r"""
import torch
from phloem.ops import skinny_gemm as sk
from phloem.worker.triton_prebuild import TritonShapes, launch_all
from phloem.worker.triton_variants import cuda_target, record_variants

llama = dict(num_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128, hidden_size=4096,
             intermediate_size=14336, shared_prefix=False)
for mode in ("0", "auto", "1"):  # the engine's prebuild hooks, the measured table in place
    variants = record_variants(lambda: launch_all(TritonShapes(**llama, skinny_gemm=mode)),
                               cuda_target((9, 0)))
    print(mode, "", *sorted(v.describe() for v in variants if "_skinny_" in v.describe()), sep="|")
from phloem.ops import skinny_gated, skinny_norm

for table in (sk.CONFIGS, skinny_gated.CONFIGS, skinny_norm.CONFIGS):
    table.clear()  # the rules of thumb alone
shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
variants = record_variants(lambda: sk.compile_variants(shapes, torch.bfloat16),
                           cuda_target((9, 0)))
print("rule", "", *sorted(v.describe() for v in variants), sep="|")
"""


def test_compile_variants_records_each_rows_bucket(compile_for_hopper):
    """The prebuild hook records, per Llama-3.1-8B shape, the variants of 1, 2, 4, 8 and 16
    rows and compiles none: by the rule of thumb the CUDA-core kernel at 1/2/4 rows and tl.dot
    at 8 and 16; through the engine's hooks none with PHLOEM_SKINNY_GEMM=0, and by default
    (auto) those of the measured shapes (all of these: their table is complete); the down
    projection's SiLU-and-mul-fused variants (`ops.skinny_gated`) beside its own, and qkv's and
    gate_up's norm-fused ones (`ops.skinny_norm`)."""
    lines = dict(line.split("|", 1) for line in compile_for_hopper(RECORD_VARIANTS).splitlines()
                 if "|" in line)  # fmt: skip
    names = {mode: set(text.split("|")) - {""} for mode, text in lines.items()}
    rule = names["rule"]
    assert any(n.startswith("_skinny_fma_kernel(M=1, ") for n in rule), rule  # 1 row
    for rows in (1, 2, 4):
        assert any(f"ROWS={rows}," in n for n in rule), (rows, rule)
    assert sum("_skinny_dot_kernel" in n for n in rule) >= 2, rule  # 8 and 16 rows
    assert not names["0"] and names["auto"] and names["auto"] <= names["1"], names
    # down (4096, 14336) after gate_up (28672, 4096): its SiLU-and-mul-fused launches too. By
    # the rule at the rows `skinny_gated.fuses` (1, 2 and 4: their configs recompute <= 1/2
    # activation a weight element; 8 and 16 rows' tensor-core block_n 16 would recompute 1); by
    # default the measured table's (1 row on the CUDA cores, 4-16 rows on one tensor-core
    # config)
    # qkv's and gate_up's add + RMSNorm-fused launches (`ops.skinny_norm`): with a residual,
    # and qkv's without one too (the first layer); by default only the measured table's 1 row
    for mode, num_gated, min_normed in (("auto", 2, 3), ("rule", 3, 6)):
        gated = [n for n in names[mode] if "GATED=True" in n]
        assert len(gated) == num_gated and len(names[mode]) > 6, names[mode]
        normed = [n for n in names[mode] if "NORM=True" in n]
        first_layer = [n for n in normed if "HAS_RES=False" in n]
        assert len(normed) >= min_normed and 1 <= len(first_layer) < len(normed), normed


def test_benchmark_grid_is_valid(sk):
    """Every config benchmarks/skinny_gemm.py times validates for its rows (a bad one would fail
    the GPU run), the engine's default comes first, and none is timed twice."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "skinny_gemm.py"
    spec = importlib.util.spec_from_file_location("skinny_gemm_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for rows in (1, 2, 4, 8, 16):
        for _, n, k in bench.SHAPES:
            configs = bench.candidate_configs(rows, n, k)
            assert configs[0] == sk.config_for(rows, n, k)
            assert len(set(configs)) == len(configs) > 20
            for config in configs:
                config.validate(rows)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="TP = 2 on CUDA needs two GPUs")  # fmt: skip
def test_flag_under_tensor_parallelism(sk, skinny_flag, counted, tmp_path_factory,
                                       embedded_tokenizer_dir, monkeypatch):  # fmt: skip
    """TP = 2 on the CPU (gloo, a spawned rank that inherits the flags): column- and row-parallel
    shards through the kernel give F.linear's greedy tokens (fp16, as above), qkv's shard with
    RoPE and the KV write fused (PHLOEM_FUSED_QKV_ROPE=1: its heads are local)."""
    import gc

    from phloem import LLM, SamplingParams
    from tests.engine.tiny_models import VOCAB, tiny_model_dir

    path = tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_skinny_tp", 3)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(4 + i)]}
               for i in range(3)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(str(path), tensor_parallel_size=2, block_size=4, max_num_batched_tokens=32,
                  kv_cache_memory_bytes=1 << 20, dtype="float16")  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.close()
        gc.collect()
        return [list(o.outputs[0].token_ids) for o in outs]

    from phloem.ops import skinny_rope

    roped, real_rope = [], skinny_rope.qkv_rope_kv
    monkeypatch.setattr(skinny_rope, "qkv_rope_kv", lambda *a: roped.append(1) or real_rope(*a))
    skinny_flag("0")
    plain = run()
    monkeypatch.setenv(quant_base.FUSED_QKV_ROPE_ENV, "1")
    skinny_flag("1")
    assert run() == plain
    assert roped  # rank 0's qkv shard, decode steps
    rows = {shape[0] for shape in counted}  # rank 0's: CPU: the prefill (15 tokens), decodes
    assert rows and (3 in rows or torch.cuda.is_available()), rows
