"""Counter-based Exp(1) noise for seeded sampling rows: every seeded row of a step in one kernel.

A seeded request's randomness is a `SeedStream`: its seed and the number of draws it has made.
Draw number c of seed s is the row of V exponentials

    key     = mix64(mix64(s) + (c + 1) * GAMMA)            (one 64-bit key per row and draw)
    h[v]    = mix64(key + (v + 1) * GAMMA)                 (v = 0 .. V-1, all mod 2^64)
    bits[v] = h[v] >> 41                                   (the top 23 bits)
    u[v]    = (2 * bits[v] + 1) * 2^-24                    (exact in float32, in (0, 1))
    q[v]    = -log(u[v])                                   (Exp(1); float32)

`mix64` is the splitmix64 output function (Steele, Lea and Flood 2014, "Fast Splittable
Pseudorandom Number Generators"; the finalizer constants of Stafford's "variant 13"): a bijection
of 64-bit words whose every output bit depends on every input bit. The key walks a splitmix64
sequence from the seed, one step per draw, and a row is the splitmix64 sequence started at its
key, so a row is a pure function of (seed, draw counter, v): the same on any device, in any batch,
at any position, and two rows' sequences meet only if their keys fall within V steps of each
other (about 2V / 2^64 a pair).

u uses 23 bits so that 2 * bits + 1 < 2^24 is exact in float32 and u is never 0 or 1: q lies in
[-log(1 - 2^-24), -log(2^-24)] = [6.0e-8, 16.6], so no clamp is needed (a tail of Exp(1) beyond
16.6, probability 6e-8, is cut off).

Two implementations compute the same bits:

- torch (CPU, and the reference): int64 tensor ops; multiplication wraps mod 2^64 and right
  shifts are made logical with a mask.
- CUDA: one Triton kernel (`phloem.ops.seeded_noise_triton`, imported lazily) writes q straight
  into the rows of the caller's [R, V] noise tensor: one launch a step however many rows are
  seeded (the per-row `torch.Generator` draws it replaces cost one launch a row, issue 21).
  Its bits equal the reference's; its log may differ from torch's by an ulp.

The row keys are computed on the host (torch int64 on the CPU, [R] values) and copied once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phloem.ops.staging import to_device


def _signed(value: int) -> int:
    """The int64 whose two's-complement bits are `value` mod 2^64."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


GAMMA = _signed(0x9E3779B97F4A7C15)  # splitmix64's increment (odd; 2^64 / golden ratio)
MIX_1 = _signed(0xBF58476D1CE4E5B9)
MIX_2 = _signed(0x94D049BB133111EB)
NUM_BITS = 23  # bits of u (2 * bits + 1 < 2^24: exact in float32)
SHIFT = 64 - NUM_BITS
_CPU_CHUNK_ELEMENTS = 2**21  # entries hashed together on the CPU (int64: 16 MB a temporary)


@dataclass
class SeedStream:
    """A seeded request's noise stream: the state `Sampler` draws it from and advances.

    Fields:
        seed: in [0, 2^64) (`SamplingParams.generator_seed`).
        draws: the draws made so far (the counter c of the next draw); one per sampling step
            of the row (greedy rows and greedy steps draw nothing).
    """

    seed: int
    draws: int = 0


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits by k in [1, 63] (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 x (any shape), in place; returns x. Wraps mod 2^64."""
    x ^= _shr(x, 30)
    x *= MIX_1
    x ^= _shr(x, 27)
    x *= MIX_2
    x ^= _shr(x, 31)
    return x


def row_keys(streams: Sequence[SeedStream]) -> torch.Tensor:
    """int64 [R] on the CPU: the key of each stream's next draw (module docstring). Reads the
    streams, does not advance them."""
    seeds = torch.tensor([_signed(s.seed) for s in streams], dtype=torch.int64)
    draws = torch.tensor([_signed(s.draws + 1) for s in streams], dtype=torch.int64)
    return mix64_(mix64_(seeds) + draws * GAMMA)


def uniform_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [R, V]: the top `NUM_BITS` bits of each row's hashes, in [0, 2^23) (the reference
    the Triton kernel is tested against). keys: int64 [R] on any device."""
    index = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * GAMMA
    return _shr(mix64_(keys[:, None] + index[None, :]), SHIFT)


def exponentials_reference(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [R, V] Exp(1) noise of the rows with these keys (int64 [R]), in plain torch."""
    u = (uniform_bits(keys, vocab_size) * 2 + 1).float() * 2.0**-24
    return u.log_().neg_()


def seeded_exponentials_(
    q: torch.Tensor, row_indices: Sequence[int], streams: Sequence[SeedStream]
) -> None:
    """Write stream i's next draw into row `row_indices[i]` of q for every i, and advance each
    stream by one draw. Rows not named are untouched.

    q: float32 [R, V], V contiguous, modified. row_indices: distinct rows of q, one per stream.
    CUDA: one Triton launch (plus one host-to-device copy of the keys and row indices); other
    devices: the torch reference, a chunk of rows (2^21 entries) at a time. Raises ValueError when the
    lengths differ or q is not float32 [R, V] with V contiguous."""
    if len(row_indices) != len(streams):
        raise ValueError(f"{len(row_indices)} row indices for {len(streams)} streams")
    if q.dim() != 2 or q.dtype != torch.float32 or q.stride(1) != 1:
        raise ValueError(f"q must be float32 [R, V], V contiguous; got {q.dtype} {q.shape}")
    if not streams:
        return
    keys = row_keys(streams)
    if q.is_cuda:
        from phloem.ops.seeded_noise_triton import launch

        staged = to_device(torch.stack((keys, torch.tensor(row_indices))), q.device)
        launch(q, staged[0], staged[1])
    else:
        chunk_rows = max(1, _CPU_CHUNK_ELEMENTS // q.shape[1])
        for start in range(0, len(streams), chunk_rows):
            chunk = slice(start, start + chunk_rows)
            index = torch.tensor(row_indices[chunk], dtype=torch.long)
            q[index] = exponentials_reference(keys[chunk], q.shape[1])
    for stream in streams:
        stream.draws += 1
