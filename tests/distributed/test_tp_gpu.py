"""Tensor parallelism on CUDA (skipped without two GPUs; run by benchmarks/tp_device.sh): TP = 2
over NCCL, with decode CUDA graphs (their replays hold the all-reduces) and eagerly, generates
TP = 1's greedy tokens for a tiny bfloat16 Llama and Qwen2 with one KV head. In bfloat16 the
sums' order differs between TP sizes, and random weights over a 49K vocabulary leave the top two
logits ~0.3 apart on average, so near-ties flip (on 4 H100s 3 of 12 sequences differed within 8
tokens): the check is vLLM's `check_logprobs_close` made stricter. Where a sequence first
diverges, each engine's token is in the other's top-5 and the reference's lead of its token over
the other's is a near-tie (< MAX_TIE nats); most tokens agree before the first divergence.

The symmetric-memory choices start each TP = 2 engine in a new process: torch's symmetric memory
rendezvouses once per process (`parallel_state.symm_mem_setup`), and in the test's own process a
second TP = 2 engine (or a later case) would fall back to NCCL, leaving its kernel untested."""

from __future__ import annotations

import gc
import multiprocessing
import random

import pytest
import torch

from phloem import LLM, SamplingParams

MAX_TIE = 0.3  # nats: the largest lead of the reference's top-1 that bf16 rounding may flip

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)


def write_model(path, arch: str, num_kv_heads: int) -> None:
    import transformers

    from phloem.model_configs import synthetic_tokenizer
    from tests.engine.tiny_models import tiny_config

    torch.manual_seed(5)
    config = tiny_config(arch)
    config.num_key_value_heads = num_kv_heads
    # head_dim 64: FlashInfer's kernels (which the CUDA graphs replay) compile 64, 128 and 256 only
    config.hidden_size, config.head_dim, config.intermediate_size = 256, 64, 512
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    synthetic_tokenizer(config.vocab_size, config.eos_token_id).save_pretrained(path)


@pytest.mark.parametrize(
    ("arch", "num_kv_heads", "all_reduce"),
    [("llama", 2, "nccl"), ("qwen2", 1, "nccl"), ("llama", 2, "symm_mem"),
     ("qwen2", 1, "fused_norm"), ("llama", 2, "symm_norm")],
)  # fmt: skip
def test_tp2_matches_tp1_on_cuda(arch, num_kv_heads, all_reduce, tmp_path, monkeypatch):
    """symm_mem: decode steps' all-reduces through the one-shot symmetric-memory kernel, captured
    in the CUDA graphs (the ranks inherit PHLOEM_TP_ALLREDUCE); fused_norm: decode steps'
    all-reduces fused with the residual add and RMSNorm (FlashInfer's one-shot kernel);
    symm_norm: the same fusion as phloem's Triton kernel over symmetric memory, its device-side
    barrier replayed by the graphs (and run eagerly by the third engine)."""
    monkeypatch.setenv("PHLOEM_TP_ALLREDUCE", all_reduce)
    write_model(tmp_path, arch, num_kv_heads)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(5 + 3 * i)]}
               for i in range(12)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    symm = all_reduce in ("symm_mem", "symm_norm")
    tokens = {}
    for size, eager in ((1, False), (2, False), (2, True)):
        args = (str(tmp_path), size, eager, prompts, params)
        tokens[size, eager], (small, fused) = (
            in_new_process(*args) if symm and size == 2 else engine_outputs(*args)
        )
        assert small == (size == 2 and all_reduce == "symm_mem")
        assert fused == (size == 2 and all_reduce in ("fused_norm", "symm_norm"))
        gc.collect()
        torch.cuda.empty_cache()
    for key in ((2, False), (2, True)):
        assert_logprobs_close(tokens[1, False], tokens[key], str(key))


def engine_outputs(path: str, size: int, eager: bool, prompts: list, params) -> tuple:
    """One engine's greedy outputs, per sequence (token ids, logprobs), and whether it set up
    (the symmetric-memory all-reduce, a fused all-reduce + norm)."""
    from phloem.distributed.parallel_state import tp_fused_norm_all_reduce, tp_small_all_reduce

    with LLM(path, tensor_parallel_size=size, dtype="bfloat16", enforce_eager=eager,
             max_num_seqs=16, num_gpu_blocks=512) as llm:  # fmt: skip
        assert llm.llm_engine.executor.worker.cuda_graphs is not eager
        paths = (tp_small_all_reduce() is not None, tp_fused_norm_all_reduce() is not None)
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], paths


def _engine_process(conn, *args) -> None:
    conn.send(engine_outputs(*args))
    conn.close()


def in_new_process(*args) -> tuple:
    """`engine_outputs(*args)` in a new (spawned, non-daemon) process."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_engine_process, args=(sender, *args))
    process.start()
    sender.close()
    try:
        return receiver.recv()
    except EOFError:
        process.join(timeout=30)
        pytest.fail(f"the engine's process failed (exit code {process.exitcode}; stderr above)")
    finally:
        process.join(timeout=60)


def assert_logprobs_close(ref: list, got: list, name: str) -> None:
    """`ref` and `got`: per sequence (token ids, per position {token_id: logprob} of the top-5
    and the chosen token). Each sequence agrees up to its first divergence, where the two tokens
    are a near-tie of both engines' top-5; at least half of the reference's tokens come before a
    divergence (a broken all-reduce diverges at once, to tokens outside the top-5)."""
    agreed = 0
    for seq, ((ref_ids, ref_lps), (ids, lps)) in enumerate(zip(ref, got)):
        for pos, (want, have) in enumerate(zip(ref_ids, ids)):
            if want == have:
                agreed += 1
                continue
            where = f"{name} sequence {seq} position {pos}: {have} for {want}"
            assert have in ref_lps[pos] and want in lps[pos], (where, ref_lps[pos], lps[pos])
            lead = ref_lps[pos][want] - ref_lps[pos][have]
            assert 0 <= lead < MAX_TIE, (where, f"reference lead {lead:.3f} nats")
            break
    total = sum(len(ids) for ids, _ in ref)
    assert agreed >= 0.5 * total, (name, f"{agreed} of {total} tokens before a divergence")
