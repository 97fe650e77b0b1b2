"""Which Triton kernel variants phloem compiles on a Hopper GPU, and how long each takes to compile
for sm_90, measured on the CPU (no GPU: Triton's frontend, PTX and ptxas run here).

Two lists, both recorded under `phloem.worker.triton_variants.CompileOnlyDriver` (every launch
goes through `JITFunction.run`, is recorded and launches nothing):

    prebuild  what the engine's Triton prebuild compiles for the settings (`launch_all`);
    runtime   what the engine's own code launches: the fused RoPE + KV write and SiLU-and-mul
              (and FP8 quantizers) over steps of several token counts, the shared-prefix
              attention warm-up (`SharedPrefixAttention.warmup`), the CUDA-graph captures of the
              shared-prefix variant (`DecodeGraphPlan` at every captured batch size), the
              small-decode kernel's warm-up, "small_decode" graph captures and eager steps,
              `--steps` random eager serving steps (groups, decodes, prefill chunks) through the
              backend's own path (`begin_step` / `forward`), and the sampler's kernels (the
              grammar mask, the seeded rows' noise) over several row counts and vocabularies.

It prints both, the runtime variants the prebuild misses (should be none), and with `--compile`
each variant's compile time for sm_90 (one process, one at a time, into an empty cache). With
`--tree DIR` the runtime list is recorded with the phloem package of DIR (e.g. an export of an
older commit, `git archive C | tar -x -C DIR`), the recorder still from this tree: that is how
the variant counts before this change were measured.

    python benchmarks/triton_variants_cpu.py [--kv fp8] [--fp8] [--compile] [--tree DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128, hidden_size=4096,
                intermediate_size=14336)  # fmt: skip


def _recorder():
    """`phloem.worker.triton_variants` of this tree, loaded by path (works under --tree)."""
    path = os.path.join(HERE, "phloem", "worker", "triton_variants.py")
    spec = importlib.util.spec_from_file_location("triton_variants_here", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _random_step(rng: random.Random, block_size: int):
    """A random eager step: groups of decode members over shared prefixes, lone decodes and
    prefill chunks (host lists for `AttentionMetadata.from_host`)."""
    query_lens, seq_lens, tables, prefix_lens, next_block = [], [], [], [], 0
    for _ in range(rng.randint(1, 6)):
        members, prefix_blocks = rng.choice([1, 2, 3, 5, 8, 16, 40]), rng.randint(1, 80)
        prefix = list(range(next_block, next_block + prefix_blocks))
        next_block += prefix_blocks
        for _ in range(members):
            own = rng.randint(1, 40)
            q = 1 if rng.random() < 0.8 else rng.randint(2, 300)
            query_lens.append(q)
            seq_lens.append((prefix_blocks + own - 1) * block_size + rng.randint(1, block_size))
            tables.append(prefix + list(range(next_block, next_block + own)))
            prefix_lens.append(prefix_blocks * block_size if members > 1 else 0)
            next_block += own
    return query_lens, seq_lens, tables, prefix_lens, next_block


def runtime_launches(shapes: dict, kv: str, fp8: bool, steps: int, seed: int) -> None:
    """Run the engine's code paths that launch phloem's Triton kernels, on CPU tensors."""
    import torch

    from phloem.ops import activation, rope_kv, seeded_noise_triton, token_bitmask_triton
    from phloem.ops.attention.metadata import AttentionMetadata
    from phloem.ops.attention.reference import ReferenceAttention
    from phloem.ops.attention.shared_prefix import SharedPrefixAttention
    from phloem.ops.attention.small_decode import SmallDecodeAttention
    from phloem.ops.kv_store import allocate_kv_cache
    from phloem.worker.cuda_graph import graph_batch_sizes

    h, hkv, d = shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"]
    bf16, kv_dtype, bs = torch.bfloat16, getattr(torch, kv), 16
    for t in (1, 7, 64, 4096):  # the model's layers: q, k, v views of the fused QKV output
        qkv = torch.zeros(t, (h + 2 * hkv) * d, dtype=bf16)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        cos = torch.zeros(8, shapes["rotary_dim"] // 2)
        cache = allocate_kv_cache(2, bs, hkv, d, kv_dtype, "cpu")
        rope_kv.rope_and_write_kv(torch.zeros(t, dtype=torch.int64), q.view(t, h, d),
                                  k.view(t, hkv, d), v.view(t, hkv, d), cos, cos, cache,
                                  torch.zeros(t, dtype=torch.int64))  # fmt: skip
        if not fp8:  # FP8 W8A8 (one rank): the activation quantizes its own output instead
            activation.silu_and_mul(torch.zeros(t, 2 * shapes["intermediate_size"], dtype=bf16))
        else:
            from phloem.ops import fp8_fused_quant, fp8_quant

            x = torch.zeros(t, shapes["hidden_size"], dtype=bf16)
            w = torch.ones(shapes["hidden_size"], dtype=bf16)
            fp8_fused_quant.rms_norm_quant(x, w, 1e-5, 1e-12)
            fp8_fused_quant.rms_norm_quant(x, w, 1e-5, 1e-12, torch.zeros_like(x))
            gate_up = torch.zeros(t, 2 * shapes["intermediate_size"], dtype=bf16)
            fp8_fused_quant.silu_and_mul_quant(gate_up, 1e-12)
            fp8_quant.per_token_quant(torch.zeros(t, h * d, dtype=bf16), 1e-12)
    for dtype in (bf16, torch.float32):  # the sampler's grammar mask: greedy copy, float32 copy
        for rows, vocab in ((1, 128_256), (3, 49_152)):
            bitmask = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)
            token_bitmask_triton.launch(torch.zeros(rows, vocab, dtype=dtype), bitmask,
                                        torch.arange(rows))  # fmt: skip
    for seeded, rows, vocab in ((1, 1, 128_256), (2, 3, 49_152), (5, 8, 151_936)):
        # the sampler's seeded rows (`seeded_exponentials_`): keys and row indices staged as
        # one [2, S] copy (the indices' view is 16-byte aligned only for an even S)
        staged = torch.stack((torch.zeros(seeded, dtype=torch.int64), torch.arange(seeded)))
        seeded_noise_triton.launch(torch.empty(rows, vocab), staged[0], staged[1])
    backend = SharedPrefixAttention(ReferenceAttention(), impl="triton", num_heads=h,
                                    num_kv_heads=hkv, head_dim=d, device="cpu")  # fmt: skip
    pool = allocate_kv_cache(4096, bs, hkv, d, kv_dtype, "cpu")
    backend.warmup(pool, h, 0, d**-0.5, bf16)
    for batch in reversed(graph_batch_sizes(256)):  # captured (variant min 16), largest first
        if batch < 16:
            break
        meta = AttentionMetadata.from_host([1] * batch, [bs + 1] * batch, [[0, 1]] * batch, bs,
                                           "cpu", prefix_lens=[bs] * batch)  # fmt: skip
        backend.prepare_replay(meta, "shared_prefix")
        backend.forward(torch.zeros(batch, h, d, dtype=bf16), pool, meta, d**-0.5)
    small = SmallDecodeAttention(ReferenceAttention(), h, hkv, d, "cpu", impl="triton",
                                 max_num_blocks_per_seq=64)  # fmt: skip
    small.warmup(pool, h, 0, d**-0.5, bf16)
    for batch in (16, 8, 4, 2, 1):  # the "small_decode" graphs' captures, then eager steps
        meta = AttentionMetadata.from_host([1] * batch, [1] * batch, [[0]] * batch, bs, "cpu")
        small.prepare_replay(meta, "small_decode")
        small.forward(torch.zeros(batch, h, d, dtype=bf16), pool, meta, d**-0.5)
    for lens in ([300], [5, 700, 64]):
        tables = [list(range(-(-n // bs))) for n in lens]
        meta = AttentionMetadata.from_host([1] * len(lens), lens, tables, bs, "cpu")
        out = torch.empty(len(lens) + 1, h, d, dtype=bf16)  # the layer's output, padded
        small.forward(torch.zeros(len(lens) + 1, h, d, dtype=bf16), pool, meta, d**-0.5, out)
    rng = random.Random(seed)
    for _ in range(steps):
        q_lens, seq_lens, tables, prefix_lens, used = _random_step(rng, bs)
        if used > pool.shape[0]:
            continue
        meta = AttentionMetadata.from_host(q_lens, seq_lens, tables, bs, "cpu",
                                           prefix_lens=prefix_lens)  # fmt: skip
        if backend.plan(meta) is None:  # a plain step: the fallback's (FlashInfer's) kernels
            continue
        backend.begin_step(meta)
        backend.forward(torch.zeros(sum(q_lens), h, d, dtype=bf16), pool, meta, d**-0.5)
        backend.end_step()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", default="bfloat16", help="KV cache dtype (float8_e4m3fn: FP8)")
    parser.add_argument("--fp8", action="store_true", help="FP8 W8A8 linear layers (fused)")
    parser.add_argument("--steps", type=int, default=300, help="random eager steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="time each variant's compile")
    parser.add_argument("--tree", default=None, help="record the runtime list with DIR/phloem")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else HERE)
    tv = _recorder()
    target = tv.cuda_target((9, 0))
    shapes = dict(LLAMA_8B, kv_dtype=args.kv, fp8_quant="fused" if args.fp8 else "")
    runtime = tv.record_variants(
        lambda: runtime_launches(shapes, args.kv, args.fp8, args.steps, args.seed), target
    )
    import triton

    result = {"triton": triton.__version__, "shapes": shapes,
              "runtime": [v.describe() for v in runtime]}  # fmt: skip
    if not args.tree:
        from phloem.worker.triton_prebuild import TritonShapes, launch_all

        prebuild = tv.record_variants(lambda: launch_all(TritonShapes(**shapes)), target)
        keys = {(v.module, v.qualname, v.specialization) for v in prebuild}
        missed = [v for v in runtime if (v.module, v.qualname, v.specialization) not in keys]
        result.update(prebuild=[v.describe() for v in prebuild],
                      missed=[v.describe() for v in missed])  # fmt: skip
    if args.compile:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-variants-")
        times = []
        for v in runtime if args.tree else prebuild:
            start = time.perf_counter()
            tv.compile_variant(v)
            times.append({"kernel": v.describe(), "seconds": round(time.perf_counter() - start, 2)})
        result["compile"] = times
        result["compile_total_s"] = round(sum(t["seconds"] for t in times), 2)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
