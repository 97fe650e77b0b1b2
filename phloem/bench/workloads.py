"""Synthetic, seeded workloads given as token ids (no tokenizer needed), by name.

Each request is (prompt token ids, output length); requests of a prefix group share their first
`prefix_len` prompt tokens exactly. All run with `ignore_eos`, so output lengths are exact.

| name            | shape (defaults)                                                           |
|-----------------|----------------------------------------------------------------------------|
| `batchllm`      | 400 groups x degree 16 = 6,400 requests; prefix 2000, suffix 200, out 100; |
|                 | requests shuffled (BatchLLM, arXiv 2412.03594, §6)                         |
| `shared-prefix` | SGLang generated-shared-prefix: 64 groups x 16; prefix 2048, suffix 128,   |
|                 | out 256                                                                    |
| `decode-heavy`  | 1000 requests, 1000 in / 1000 out                                          |
| `prefill-heavy` | 1000 requests, 2048 in / 128 out                                           |
| `random`        | 1000 requests, no sharing, ShareGPT-like lengths: lognormal, input median  |
|                 | 150 (sigma 1.0, in [4, 4096]), output median 128 (sigma 0.9, in [4, 1024]); |
|                 | means about 240 in / 190 out, as ShareGPT V3 conversations are             |
| `latency`       | batch 1: one request of 128 in / 256 out, run alone                        |

`num_requests` (or `num_groups` for the prefix workloads) scales a workload down; shapes stay.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Token ids are drawn from [_LOW_ID, vocab): low ids are often special tokens.
_LOW_ID = 1000


@dataclass
class Workload:
    """Requests plus the structure the roofline needs.

    Attributes:
        name: workload name; shape: its parameters (recorded in the JSON).
        prompts: token ids per request; output_lens: tokens to generate per request.
        groups: (shared prefix length, request indices) per prefix group; lone requests form
            groups with prefix length 0.
        sequential: run one request at a time (the latency workload), not as one batch.
    """

    name: str
    shape: dict
    prompts: list[list[int]]
    output_lens: list[int]
    groups: list[tuple[int, list[int]]] = field(default_factory=list)
    sequential: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(_LOW_ID, vocab) for _ in range(n)]


def _lognormal_lens(
    rng: random.Random, n: int, median: int, sigma: float, bounds: tuple[int, int]
) -> list[int]:
    """`n` lengths [tokens] drawn from a lognormal of this median and sigma, rounded and clipped
    to `bounds` (the long-tailed lengths of real chat traffic)."""
    import math

    lo, hi = bounds
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def _lone(name, shape, prompts, outs, sequential=False) -> Workload:
    groups = [(0, [i]) for i in range(len(prompts))]
    return Workload(name, shape, prompts, outs, groups, sequential)


def _prefix_groups(
    name: str,
    rng: random.Random,
    vocab: int,
    num_groups: int,
    degree: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    shuffle: bool,
) -> Workload:
    prompts: list[list[int]] = []
    groups: list[tuple[int, list[int]]] = []
    for _ in range(num_groups):
        prefix = _ids(rng, prefix_len, vocab)
        members = []
        for _ in range(degree):
            members.append(len(prompts))
            prompts.append(prefix + _ids(rng, suffix_len, vocab))
        groups.append((prefix_len, members))
    order = list(range(len(prompts)))
    if shuffle:
        rng.shuffle(order)
    position = {old: new for new, old in enumerate(order)}
    prompts = [prompts[i] for i in order]
    groups = [(p, sorted(position[i] for i in members)) for p, members in groups]
    shape = dict(
        num_groups=num_groups,
        degree=degree,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        output_len=output_len,
        shuffled=shuffle,
    )
    return Workload(name, shape, prompts, [output_len] * len(prompts), groups)


WORKLOADS = ("batchllm", "shared-prefix", "decode-heavy", "prefill-heavy", "random", "latency")


def make_workload(
    name: str,
    vocab_size: int,
    seed: int = 0,
    num_requests: int | None = None,
    num_groups: int | None = None,
    input_len: int | None = None,
    output_len: int | None = None,
    degree: int | None = None,
    prefix_len: int | None = None,
    suffix_len: int | None = None,
) -> Workload:
    """Build a named workload (see the module table); None keeps each default. For `random`,
    `input_len` / `output_len` set the medians of the lognormal lengths.

    Raises:
        ValueError: for an unknown name or non-positive sizes.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {list(WORKLOADS)}")
    if vocab_size <= _LOW_ID:
        raise ValueError(f"vocab_size must exceed {_LOW_ID}, got {vocab_size}")
    rng = random.Random(seed)
    if name in ("batchllm", "shared-prefix"):
        d = (400, 16, 2000, 200, 100) if name == "batchllm" else (64, 16, 2048, 128, 256)
        return _prefix_groups(
            name,
            rng,
            vocab_size,
            num_groups or d[0],
            degree or d[1],
            d[2] if prefix_len is None else prefix_len,
            suffix_len or d[3],
            output_len or d[4],
            shuffle=name == "batchllm",
        )
    if name == "random":
        n = num_requests or 1000
        ins = _lognormal_lens(rng, n, input_len or 150, 1.0, (4, 4096))
        outs = _lognormal_lens(rng, n, output_len or 128, 0.9, (4, 1024))
        shape = dict(num_requests=n, input_median=input_len or 150, input_sigma=1.0,
                     output_median=output_len or 128, output_sigma=0.9)  # fmt: skip
        return _lone(name, shape, [_ids(rng, k, vocab_size) for k in ins], outs)
    defaults = {"decode-heavy": (1000, 1000, 1000), "prefill-heavy": (1000, 2048, 128)}
    n, i, o = defaults.get(name, (1, 128, 256))
    n, i, o = num_requests or n, input_len or i, output_len or o
    if min(n, i, o) < 1:
        raise ValueError("num_requests, input_len and output_len must be positive")
    prompts = [_ids(rng, i, vocab_size) for _ in range(n)]
    shape = dict(num_requests=n, input_len=i, output_len=o)
    return _lone(name, shape, prompts, [o] * n, sequential=name == "latency")
