"""Piecewise graphs of non-decode steps (phloem/worker/piecewise_graph.py) on the CPU: pieces that
re-run on the same static buffers stand in for CUDA graphs, so buckets, padding, buffer slices,
piece boundaries and the eager attention between pieces are all checked here."""

import pytest
import torch

from phloem.worker.input_batch import HostStep
from phloem.worker.piecewise_graph import (
    PiecewiseGraphRunner,
    RerunPieceGraphs,
    piecewise_token_sizes,
)
from tests.worker.piecewise_harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    CountingGraphs,
    both_ways,
    make_runner,
    mixed_steps,
    step,
    tiny_phloem_model,
)

BUCKETS = [8, 16, 32, 48]


def test_token_sizes():
    sizes = piecewise_token_sizes(8192)
    assert sizes[:3] == [64, 128, 192] and sizes[-1] == 1024
    assert len(sizes) == 16
    assert piecewise_token_sizes(1024) == sizes
    assert piecewise_token_sizes(300) == [64, 128, 192, 256, 300]
    assert piecewise_token_sizes(64) == [64]
    assert piecewise_token_sizes(10) == [10]
    for cap in (10, 300, 1024):
        assert all(any(s >= n for s in piecewise_token_sizes(cap)) for n in range(1, cap + 1))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        piecewise_token_sizes(0)


def test_token_sizes_must_ascend():
    runner = make_runner(tiny_phloem_model("llama"))
    for bad in ([], [16, 8], [0, 8]):
        with pytest.raises(ValueError, match="token_sizes"):
            PiecewiseGraphRunner(
                runner.model, runner.kv_caches, runner.backend, BLOCK_SIZE, NUM_BLOCKS, bad,
                runner.device, RerunPieceGraphs(),
            )  # fmt: skip


def _backend(name: str, model):
    from phloem.ops.attention import get_attention_backend

    return get_attention_backend(
        name, num_heads=model.model.attention(0).num_heads, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype=torch.float32, device=torch.device("cpu"),
        max_num_blocks_per_seq=NUM_BLOCKS, max_num_seqs=8,
    )  # fmt: skip


@pytest.mark.parametrize(
    "arch, backend", [("llama", "reference"), ("qwen3", "reference"), ("llama", "shared_prefix")]
)
def test_piecewise_steps_equal_eager(arch, backend):
    """Mixed prompt-chunk + one-token steps of 30, 15 and 48 tokens: hidden states equal the
    eager forward's, the KV cache after the step equals the eager one everywhere but the
    scratch block, and padded steps write the scratch block (their padding rows' slot). The
    shared-prefix backend (it reads prefix lengths) runs between the pieces unchanged."""
    model = tiny_phloem_model(arch)
    runner = make_runner(model, backend=_backend(backend, model))
    graphs = CountingGraphs()
    runner.capture_piecewise_graphs(BUCKETS, graphs)
    pieces = model.num_layers + 1
    assert runner.piecewise_runner.num_graphs == len(BUCKETS) * pieces
    scratch = NUM_BLOCKS
    for seqs in mixed_steps(model.config.vocab_size):
        num_tokens = sum(n for _, n in seqs)
        graphs.replays = 0
        for cache in runner.kv_caches:  # the capture left padding K/V there
            cache[scratch].zero_()
        eager, piecewise, eager_caches, caches, before = both_ways(runner, step(seqs))
        assert graphs.replays == pieces
        assert piecewise.shape == eager.shape == (num_tokens, model.config.hidden_size)
        torch.testing.assert_close(piecewise, eager, rtol=1e-5, atol=1e-5)
        for got, want, old in zip(caches, eager_caches, before):
            torch.testing.assert_close(got[:scratch], want[:scratch], rtol=1e-5, atol=1e-5)
            padded = runner.piecewise_runner.bucket(num_tokens) > num_tokens
            assert padded == (not torch.equal(got[scratch], old[scratch]))


def test_padding_rows_never_write_a_real_slot():
    """After a padded step, every slot no real token of the step owns keeps its bytes: the
    padding row of the 15-token step (bucket 16) writes the scratch block only, not slot 0 of
    block 0, which holds sequence A's first token since the step before."""
    runner = make_runner(tiny_phloem_model("llama"))
    runner.capture_piecewise_graphs(BUCKETS, RerunPieceGraphs())
    first, second, _ = mixed_steps(512)
    both_ways(runner, step(first))
    sched = step(second)
    _, _, _, caches, before = both_ways(runner, sched)
    written = set()
    for s in sched.scheduled:
        table = runner.input_batch.states[s.seq_id].block_ids
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_tokens):
            written.add((table[pos // BLOCK_SIZE], pos % BLOCK_SIZE))
    assert (0, 0) not in written
    for got, old in zip(caches, before):
        for block in range(NUM_BLOCKS):
            for offset in range(BLOCK_SIZE):
                same = torch.equal(got[block, :, offset], old[block, :, offset])
                assert same != ((block, offset) in written), (block, offset)


def test_steps_beyond_the_largest_bucket_run_eagerly():
    runner = make_runner(tiny_phloem_model("llama"))
    runner.capture_piecewise_graphs([8, 16], RerunPieceGraphs())
    assert runner.piecewise_runner.bucket(16) == 16 and runner.piecewise_runner.bucket(17) is None
    with pytest.raises(ValueError, match="17 tokens"):
        runner.piecewise_runner.run(HostStep.dummy(17, 1, BLOCK_SIZE, 512))


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, embedded_tokenizer_dir):
    from tests.engine.tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir, "llama", "llama_pieces", 5)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "use_cost_rule": False}


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_greedy_engine_outputs_identical_with_pieces(tiny_llama_dir, spec):
    """An engine whose non-decode steps replay the pieces (chunked prompts mixed with decodes,
    async scheduling's pending ids filled into the static buffer; with n-gram drafts, verify
    steps scoring 1 + k rows a sequence) generates the same greedy tokens as without them, and
    its steps really took the pieces."""
    import random

    from phloem import LLM, SamplingParams

    rng = random.Random(0)
    motifs = [[rng.randrange(3, 40000) for _ in range(rng.randint(3, 6))] for _ in range(8)]
    batch = [m * rng.randint(2, 6) for m in motifs]  # repeats: n-gram drafts to verify
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), block_size=4, max_num_batched_tokens=32, dtype="float32",
              enable_prefix_caching=False, speculative_config=spec)  # fmt: skip

    def generate() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    eager = generate()
    runner = llm.llm_engine.executor.worker.model_runner
    graphs = CountingGraphs()
    runner.capture_piecewise_graphs([8, 16, 24, 32], graphs)
    graphs.replays = 0
    drafter = llm.llm_engine.drafter
    verified = 0 if drafter is None else drafter.stats.num_spec_steps
    assert generate() == eager
    if drafter is not None:  # steps verifying drafts ran through the pieces too
        assert drafter.stats.num_spec_steps > verified
    assert graphs.replays >= 4 * (runner.model.num_layers + 1)
    llm.llm_engine.scheduler.check_integrity()


def test_fp8_norms_inside_the_pieces(tiny_llama_dir):
    """FP8 W8A8 with the norms and SiLU-and-mul emitting `Fp8Activation`s (`emit_fp8`) inside
    the pieces: greedy tokens and their log-probs equal the eager engine's."""
    import random

    from phloem import LLM, SamplingParams
    from phloem.layers.quantization.fp8_math import Fp8Activation
    from phloem.worker.fusion import fuse_fp8_input_quant

    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 40000) for _ in range(3 + 7 * i)]}
               for i in range(5)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", block_size=4, max_num_batched_tokens=32,
              quantization="fp8", enable_prefix_caching=False)  # fmt: skip
    runner = llm.llm_engine.executor.worker.model_runner
    assert fuse_fp8_input_quant(runner.model) == 3 * runner.model.num_layers
    fp8_inputs = []
    runner.model.model.layers[0].self_attn.qkv_proj.register_forward_pre_hook(
        lambda module, args: fp8_inputs.append(isinstance(args[0], Fp8Activation))
    )

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    eager = run()
    graphs = CountingGraphs()
    runner.capture_piecewise_graphs([8, 16, 24, 32], graphs)
    graphs.replays = 0
    assert run() == eager
    assert graphs.replays > 0 and fp8_inputs and all(fp8_inputs)
    llm.close()
