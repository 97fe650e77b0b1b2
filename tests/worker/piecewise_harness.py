"""Steps through a `ModelRunner` twice, eagerly and through its piecewise graphs, from the same KV
cache: for the CPU tests (graphs that re-run their pieces) and the GPU test (CUDA graphs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phloem.core.scheduler_output import NewSequenceData, ScheduledSequence, SchedulerOutput
from phloem.models.registry import get_model_class
from phloem.ops.attention.reference import ReferenceAttention
from phloem.sampling_params import SamplingParams
from phloem.worker.input_batch import HostStep
from phloem.worker.model_runner import ModelRunner
from phloem.worker.piecewise_graph import PieceGraph, RerunPieceGraphs

BLOCK_SIZE = 4
NUM_BLOCKS = 40  # the scratch block is block 40


class CountingGraphs(RerunPieceGraphs):
    """Re-running pieces that count their replays (proof that a step took the piecewise path)."""

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, piece) -> PieceGraph:
        graph = super().capture(piece)
        run = graph.replay

        def replay() -> None:
            self.replays += 1
            run()

        graph.replay = replay
        return graph


def tiny_phloem_model(
    arch: str, device: str = "cpu", dtype=torch.float32, seed: int = 0, **overrides
):
    """A tiny random-weight phloem model of `arch` ("llama", "qwen3") with HF's layout
    (`overrides`: config fields, e.g. a head_dim FlashInfer takes)."""
    import transformers

    from tests.engine.tiny_models import tiny_config

    torch.manual_seed(seed)
    config = tiny_config(arch)
    config.vocab_size = 512
    for name, value in overrides.items():
        setattr(config, name, value)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    name = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    model = get_model_class([name])(config, dtype)
    model.load_weights(hf.state_dict().items())
    return model.to(device).eval()


def make_runner(model, device: str = "cpu", backend=None) -> ModelRunner:
    dtype = next(model.parameters()).dtype
    backend = backend or ReferenceAttention()
    return ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, dtype, torch.device(device), backend)


@dataclass
class Seq:
    seq_id: str
    prompt: list[int]
    blocks: list[int]  # its whole block table (handed out on its first step)
    computed: int = 0


def step(seqs: list[tuple[Seq, int]]) -> SchedulerOutput:
    """The scheduler output computing n tokens of each (seq, n); every sequence samples."""
    scheduled = []
    for seq, n in seqs:
        new = None
        if seq.computed == 0:
            new = NewSequenceData(seq.prompt, [], SamplingParams(temperature=0.0))
        scheduled.append(
            ScheduledSequence(
                seq.seq_id, seq.computed, n, True, new_block_ids=seq.blocks if new else (),
                new_sequence=new,
            )
        )  # fmt: skip
        seq.computed += n
    return SchedulerOutput(scheduled=scheduled)


def both_ways(runner: ModelRunner, sched: SchedulerOutput):
    """Run one step eagerly, then (from the same cache) through the piecewise graphs, every row
    taking logits. Returns (eager hidden, piecewise hidden, eager caches, piecewise caches,
    caches before); the runner is left with the piecewise caches."""
    states = runner.input_batch.update(sched)
    host = HostStep.build(sched, states, BLOCK_SIZE, runner.backend.reads_prefix_lens)
    host.logits_indices = list(range(len(host.input_ids)))
    before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        inputs = runner.prepare_inputs(host)
        eager = runner.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata).clone()
        eager_caches = [c.clone() for c in runner.kv_caches]
        for cache, saved in zip(runner.kv_caches, before):
            cache.copy_(saved)
        piecewise = runner.piecewise_runner.run(host).clone()
    return eager, piecewise, eager_caches, [c.clone() for c in runner.kv_caches], before


def mixed_steps(vocab: int, seed: int = 0) -> list[list[tuple[Seq, int]]]:
    """Three steps over sequences A, B, C (A owns block 0, whose slot 0 padding rows would hit
    if they wrote position 0 of a real block): two prompt chunks (30 tokens: padded to 32),
    then one-token steps of A and B mixed with C's first chunk (15: padded to 16), then 48
    tokens (a bucket exactly). Every token is a prompt token (no pending ids)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    a = Seq("A", ids(12), [0, 7, 3])
    b = Seq("B", ids(40), [5, 1, 9, 2, 11, 12, 13, 14, 15, 16, 17])
    c = Seq("C", ids(44), [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30])
    return [
        [(a, 10), (b, 20)],
        [(a, 1), (c, 13), (b, 1)],
        [(b, 19), (c, 28), (a, 1)],
    ]
