"""Host cost of one step's noise for seeded rows: per-row `torch.Generator` draws (the sampler
before issue 21's change, still its path for a row with only a generator) against the
counter-based seed streams (`ops.seeded_noise`), through `Sampler.draw_noise` on the CPU.

Prints, per (rows, vocab): the median wall time of one draw and the aten operators dispatched
(from the torch profiler). On the CPU a draw's time is its compute; with a tiny vocabulary it is
the host's dispatch cost, which on CUDA is what the per-row path spends launching one kernel a
row. The CUDA launches follow from the operators: the generator path launches one
`exponential_` a row, the stream path one Triton kernel and one copy of the keys, after host
work that the last lines time (the CPU path's operators are its torch reference's, by chunk).

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/seeded_noise.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

from phloem.layers.sampler import Sampler, SamplingRow, seeded_generator
from phloem.ops.seeded_noise import SeedStream, row_keys
from phloem.sampling_params import SamplingParams


def _rows(num: int, streams: bool) -> list[SamplingRow]:
    """`num` seeded rows at temperature 0.7, with generators or with seed streams."""
    params = SamplingParams(temperature=0.7)
    if streams:
        return [SamplingRow(params, [], [], None, (), SeedStream(i)) for i in range(num)]
    return [SamplingRow(params, [], [], seeded_generator(i, "cpu")) for i in range(num)]


def _measure(num_rows: int, vocab: int, streams: bool, repeats: int) -> tuple[float, Counter]:
    """(median ms of one draw, aten operators of one draw by name)."""
    sampler, rows = Sampler(seed=0), _rows(num_rows, streams)
    sampler.draw_noise(rows, vocab, "cpu")  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.draw_noise(rows, vocab, "cpu")
        times.append((time.perf_counter() - start) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sampler.draw_noise(rows, vocab, "cpu")
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    return statistics.median(times), ops


def _cuda_host_ms(num_rows: int, repeats: int = 200) -> float:
    """Median ms of the host work `seeded_exponentials_` does on CUDA before its copy and its
    one launch (the rows' keys and the staged [2, R] tensor) and after (advancing the streams)."""
    streams = [SeedStream(i * 7919, i) for i in range(num_rows)]
    index = list(range(num_rows))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.stack((row_keys(streams), torch.tensor(index)))
        for stream in streams:
            stream.draws += 1
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1024x16,1024x4096,64x32768,64x128256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| rows x vocab | path | ms / draw | aten ops | exponential_ |")
    print("|---|---|---:|---:|---:|")
    for shape in args.shapes.split(","):
        num_rows, vocab = (int(x) for x in shape.split("x"))
        for streams in (False, True):
            ms, ops = _measure(num_rows, vocab, streams, args.repeats)
            path = "seed streams" if streams else "generators"
            print(f"| {num_rows} x {vocab} | {path} | {ms:.2f} | {sum(ops.values())} | "
                  f"{ops['aten::exponential_']} |")  # fmt: skip
    for num_rows in (64, 1024):
        print(f"host work of the CUDA path, {num_rows} rows: {_cuda_host_ms(num_rows):.3f} ms")


if __name__ == "__main__":
    main()
