"""The device time of one step's sampling, constrained and not (issue 21).

`benchmarks/structured_serial_sim.py` fits the H200 run's constrained step (period 50-56 ms,
the loop's collect waiting 5.7-7.2 ms after a 12-14 ms launch) only with ~17 ms of device work
between the enqueue of a constrained step's sampling and its tokens; a forward pass of 35 ms and
a sampling of 3 ms would leave the collect no wait. This times that work alone, on the device
the benchmark ran on, over `--rows` x `--vocab-size` random bfloat16 logits, every row seeded
and at temperature 0.7 (the benchmark's parameters):

- `noise`: `Sampler.draw_noise` (what `presample` enqueues beside the fill);
- `bitmask_copy`: `ops.token_bitmask.bitmask_to_device` of a host bitmask allowing about half
  the tokens (int32 [rows, ceil(V / 32)]);
- `sample_constrained`: `Sampler.launch` with that bitmask and the noise drawn before (what
  `ModelRunner.sample` enqueues once the fill is done), through the tokens' copy to the host;
- `sample_unconstrained`: `Sampler.launch` without either (drawing its noise: what the
  unconstrained `launch` enqueues).

Each is timed from an idle device to the end of its work (`torch.cuda.synchronize` before and
after; the host's enqueue time included, reported apart as `*_enqueue`); medians of `--repeats`.
On a CPU the same calls run eagerly (a check of the script, not a device time).

    python benchmarks/sampler_device_time.py --rows 1024 --vocab-size 128256 --out DIR/s.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """(median ms from an idle device to the end of `fn()`'s device work, median ms of the
    host's call alone); one untimed call first."""
    fn()
    _sync(device)
    total, host = [], []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
        _sync(device)
        total.append(time.perf_counter() - start)
    return 1e3 * statistics.median(total), 1e3 * statistics.median(host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from phloem.layers.sampler import Sampler, SamplingRow
    from phloem.ops.seeded_noise import SeedStream
    from phloem.ops.token_bitmask import bitmask_to_device
    from phloem.sampling_params import SamplingParams

    device = torch.device(args.device)
    rows_n, vocab = args.rows, args.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows_n, vocab, device=device, generator=gen).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, seed=1)
    rows = [SamplingRow(params, (), (), None, seed_stream=SeedStream(i)) for i in range(rows_n)]
    words = -(-vocab // 32)
    host_mask = np.random.default_rng(0).integers(-(2**31), 2**31, (rows_n, words), np.int64)
    host_mask = host_mask.astype(np.int32)
    if device.type == "cuda":  # the manager's buffers are pinned on a GPU host
        host_mask = torch.from_numpy(host_mask).pin_memory().numpy()
    row_indices = np.arange(rows_n, dtype=np.int64)
    sampler = Sampler(seed=0, device=device)
    noise = sampler.draw_noise(rows, vocab, device)
    grammar = bitmask_to_device(host_mask, row_indices, device)
    cases = {
        "noise": lambda: sampler.draw_noise(rows, vocab, device),
        "bitmask_copy": lambda: bitmask_to_device(host_mask, row_indices, device),
        "sample_constrained": lambda: sampler.launch(logits, rows, grammar, noise),
        "sample_unconstrained": lambda: sampler.launch(logits, rows),
    }
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "rows": rows_n, "vocab_size": vocab}  # fmt: skip
    for name, fn in cases.items():
        total, host = timed(fn, device, args.repeats)
        result[f"{name}_ms"], result[f"{name}_enqueue_ms"] = round(total, 3), round(host, 3)
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
