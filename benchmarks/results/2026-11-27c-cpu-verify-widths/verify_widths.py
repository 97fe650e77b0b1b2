"""CPU timings of one padded verify step (32 rows of 1-2 or 2-5 drafts, 64 context tokens each)
at verify-graph widths w (q = 1 + w), through `VerifyGraphRunner` with re-run graphs (the
reference attention standing in for FlashInfer's plan); the eager step beside it.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python DIR/verify_widths.py tiny|mid [repeats]
"""

import sys
import time

import numpy as np
import torch

from phloem.ops.attention.reference import ReferenceAttention
from phloem.worker.input_batch import HostStep
from phloem.worker.model_runner import ModelRunner
from phloem.worker.piecewise_graph import RerunPieceGraphs
from tests.worker.piecewise_harness import tiny_phloem_model

torch.set_num_threads(1)
BS, CTX, B, REPS = 16, 64, 32, int(sys.argv[2]) if len(sys.argv) > 2 else 20
BLOCKS = B * (CTX // BS + 2)


class Planless(ReferenceAttention):  # the reference, declared able to replay (re-run graphs)
    supports_verify_graphs = True

    def prepare_verify_replay(self, meta) -> None:
        pass


def _arr(values):
    return np.array(values, dtype=np.int64)


def host_step(drafts):
    ids, pos, slots, logits, tables, qsl = [], [], [], [], [], 0
    for b, d in enumerate(drafts):
        table = list(range(b * (CTX // BS + 2), (b + 1) * (CTX // BS + 2)))
        tables.append(table)
        for j in range(1 + d):
            p = CTX + j
            ids.append(7 + j)
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        logits += range(qsl, qsl + 1 + d)
        qsl += 1 + d
    return HostStep(
        _arr(ids),
        _arr(pos),
        _arr(slots),
        [1 + d for d in drafts],
        [CTX + 1 + d for d in drafts],
        tables,
        logits,
        list(range(B)),
        None,
        [],
        list(drafts),
    )


def time_it(fn):
    fn()
    best = []
    for _ in range(REPS):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return 1e3 * float(np.median(best))


def main(size):
    over = (
        {}
        if size == "tiny"
        else dict(
            hidden_size=512,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            num_hidden_layers=4,
        )
    )
    model = tiny_phloem_model("llama", **over)
    for low, high, widths in ((1, 2, (2, 4, 8, 16)), (2, 5, (5, 8, 16))):
        drafts = np.random.default_rng(0).integers(low, high + 1, B).tolist()
        print(f"{size}, drafts {low}-{high} a row:")
        run(model, host_step(drafts), widths, size)


def run(model, host, widths, size):
    runner = ModelRunner(model, BLOCKS, BS, model.dtype, torch.device("cpu"), Planless())
    with torch.inference_mode():
        inputs = runner.prepare_inputs(host)
        eager = time_it(
            lambda: runner.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        )
        print(f"{size}: eager {B} rows, {len(host.input_ids)} tokens: {eager:.2f} ms")
        for w in widths:
            runner.capture_verify_graphs({1 + w: [B]}, RerunPieceGraphs())
            ms = time_it(lambda: runner.verify_runner.run(host))
            print(f"{size}: width {w:2d} ({B} x {1 + w} = {B * (1 + w)} tokens): {ms:.2f} ms")


main(sys.argv[1])
