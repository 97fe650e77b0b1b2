"""Device time of applying a step's grammar bitmask to the logits, before and after the in-place
kernel (issue 21), and what constraining adds to a sampler step.

For each row count (every row constrained, the GPU benchmark's 128,256-token vocabulary):
- `before`: the sampler's old path (uint8 unpack of the words, gather, masked fill, scatter:
  [R, V] temporaries), kept here as the baseline;
- `after`: `phloem.ops.token_bitmask.apply_token_bitmask_` (CUDA: the Triton kernel; CPU:
  numpy-unpacked chunks filled row by row);
- `sampler_*`: `Sampler.launch` with and without the grammar, greedy and at temperature 0.7
  (the structured_outputs.py benchmark's setting; every row its own seeded generator); at 0.7
  also the noise draw alone (`noise_ms`, drawn beside the fill since bcb558c) and the
  constrained launch given it (`sampler_grammar_given_noise_ms`);
- `h2d_ms`: the copy of the pinned bitmask to the device (CUDA only; it runs on the compute
  stream before the mask).
Bitmask densities: `string` (~97% of tokens allowed, a JSON string's state), `key` (~0.1%: a
key or a number), `half` (random bits). Times are medians over `--repeats` (CUDA: synchronized
around each call). Masks are checked equal (before vs after) once per case; masking is idempotent, so the timed
calls reuse one logits tensor.

    python benchmarks/structured_apply.py --rows 128,1024 --out DIR/apply.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from phloem.layers.sampler import Sampler, SamplingRow
from phloem.ops.staging import to_device
from phloem.ops.token_bitmask import apply_token_bitmask_
from phloem.sampling_params import SamplingParams

VOCAB = 128_256


def before(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> torch.Tensor:
    """The sampler's bitmask application until 2026-11-26 (issue 21), for comparison."""
    num_rows, vocab_size = bitmask.shape[0], logits.shape[1]
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    bits = (bitmask.contiguous().view(torch.uint8)[:, :, None] >> shifts) & 1
    disallowed = bits.view(num_rows, -1)[:, :vocab_size] == 0
    logits[row_indices] = logits[row_indices].masked_fill(disallowed, float("-inf"))
    return logits


def random_bitmask(rows: int, density: str, rng: np.random.Generator) -> np.ndarray:
    """int32 [rows, ceil(V / 32)]: each token allowed with the density's probability."""
    p = {"string": 0.97, "key": 0.001, "half": 0.5}[density]
    allowed = rng.random((rows, (VOCAB + 31) // 32 * 32)) < p
    return np.packbits(allowed, axis=1, bitorder="little").view(np.int32)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median ms of `fn()` (synchronized on CUDA)."""
    times = []
    for _ in range(repeats + 1):  # the first call warms up (allocator, kernel compile)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[1:])


def case(rows: int, density: str, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    rng = np.random.default_rng(rows)
    host = torch.from_numpy(random_bitmask(rows, density, rng))
    if device.type == "cuda":
        host = host.pin_memory()
    bitmask = to_device(host, device)
    index = torch.arange(rows, device=device)
    logits = torch.randn(rows, VOCAB, device=device).to(dtype)
    want = before(logits.clone(), bitmask, index)
    assert torch.equal(apply_token_bitmask_(logits.clone(), bitmask, index), want)
    out = {"rows": rows, "density": density, "dtype": str(dtype).removeprefix("torch.")}
    # masking is idempotent and neither path's work depends on the values: one tensor serves
    out["before_ms"] = timed(lambda: before(logits, bitmask, index), device, repeats)
    out["after_ms"] = timed(lambda: apply_token_bitmask_(logits, bitmask, index), device, repeats)
    if device.type == "cuda":
        out["h2d_ms"] = timed(lambda: to_device(host, device), device, repeats)
    return out


def sampler_case(rows: int, temperature: float, device: torch.device, repeats: int) -> dict:
    """`Sampler.launch` ms with and without a `half` grammar on every row (model dtype bf16 on
    CUDA, float32 on the CPU; every row its own seeded generator, as in structured_outputs.py),
    the noise draw alone (`draw_noise`: what a constrained step does beside its fill) and the
    constrained launch given that noise (what is left after the fill)."""
    rng = np.random.default_rng(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = torch.randn(rows, VOCAB, device=device).to(dtype)
    grammar = (
        to_device(random_bitmask(rows, "half", rng), device),
        torch.arange(rows, device=device),
    )
    params = SamplingParams(temperature=temperature)
    generators = [torch.Generator(device).manual_seed(i) for i in range(rows)]
    sample_rows = [SamplingRow(params, [1], [], g) for g in generators]
    sampler = Sampler(seed=0, device=device)
    noise = sampler.draw_noise(sample_rows, VOCAB, device)

    def launch(with_grammar: bool, drawn=None) -> None:
        sampler.launch(logits, sample_rows, grammar if with_grammar else None, drawn).result()

    out = {"rows": rows, "temperature": temperature,
           "sampler_free_ms": timed(lambda: launch(False), device, repeats),
           "sampler_grammar_ms": timed(lambda: launch(True), device, repeats)}  # fmt: skip
    if noise is not None:
        out["noise_ms"] = timed(
            lambda: sampler.draw_noise(sample_rows, VOCAB, device), device, repeats
        )
        out["sampler_grammar_given_noise_ms"] = timed(lambda: launch(True, noise), device, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="128,1024", help="constrained rows, comma-separated")
    parser.add_argument("--densities", default="string,key,half")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtypes = [torch.bfloat16, torch.float32]
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else
                    platform.processor() or platform.machine(),
                    "torch_threads": torch.get_num_threads(), "vocab": VOCAB, "apply": [],
                    "sampler": []}  # fmt: skip
    for rows in [int(r) for r in args.rows.split(",")]:
        for density in args.densities.split(","):
            for dtype in dtypes:
                result["apply"].append(case(rows, density, dtype, device, args.repeats))
                print(json.dumps(result["apply"][-1]), flush=True)
        for temperature in (0.0, 0.7):
            result["sampler"].append(sampler_case(rows, temperature, device, args.repeats))
            print(json.dumps(result["sampler"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
