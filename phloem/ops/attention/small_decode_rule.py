"""Which decode steps take the small-decode kernel (issues 19, 24): the switch, the batch cap and
the KV-length rule, read once from the environment (the factory,
`phloem.ops.attention.get_attention_backend`, wraps the plain backend by them).

The kernel (`small_decode.py`, one Triton launch, split-KV merged inside) wins where a step is
launch- and latency-bound, a few sequences of short KV, and loses to FlashInfer's split-KV
decode where the KV is long (its splits then do the bytes one wave of programs at a time). An
H200 measured per layer of Llama-3.1-8B (us, FlashInfer / small-decode, H 32 / H_kv 8;
benchmarks/results/2026-11-27f-h200):

    KV len     B=1            B=4            B=16
     128     9.50 /  6.56   10.70 /  7.96   12.55 / 12.50
     384    10.94 /  7.76   12.31 / 11.78   17.46 / 15.78
    1024    11.58 / 10.13   14.47 / 16.79   28.16 / 28.30
    4096    14.67 / 22.16   27.47 / 30.52   73.48 / 76.89

Linear between the measured lengths, the two cross near 1,500 tokens at B=1, 500 at B=4 and
1,000 at B=16 (TP=2 shapes, H 16 / H_kv 4, at 1,024: B=1 wins, B=4 loses, B=16 wins; 4,096
loses everywhere). Hence `LengthRule`: a step takes the kernel while its longest sequence is
<= 1,024 KV tokens at batch 1 and <= 512 at batch 2-16 (the B=4 crossing, the worst one; B=2
and B=8 were not measured). A padded graph step counts its real sequences (the padding is one
token long; a step of 1 has its own bucket).

PHLOEM_SMALL_DECODE_ATTENTION:
    unset / "auto"  the length rule, on a CUDA device over FlashInfer (what was measured);
                    off elsewhere (the CPU's reference backend)
    "0"             off
    "1"             every decode-only step of <= max_batch sequences, any length, any device
PHLOEM_SMALL_DECODE_MAX_BATCH: the largest decode step it takes (default 16).
PHLOEM_SMALL_DECODE_MAX_KV: one KV-length limit for every batch size (replaces the rule's two).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from phloem.ops.attention.metadata import AttentionMetadata

ENV_SWITCH = "PHLOEM_SMALL_DECODE_ATTENTION"  # "auto" (unset) / "0" / "1"
ENV_MAX_BATCH = "PHLOEM_SMALL_DECODE_MAX_BATCH"  # largest decode step it takes (default 16)
ENV_MAX_KV = "PHLOEM_SMALL_DECODE_MAX_KV"  # one KV-length limit for every batch size
MODES = ("auto", "0", "1")
DEFAULT_MAX_BATCH = 16
BATCH1_MAX_KV, BATCHED_MAX_KV = 1024, 512  # tokens; the H200 crossings (module docstring)


@dataclass(frozen=True)
class LengthRule:
    """The longest sequence (KV tokens, the step's new one included) a decode step may have
    to take the small-decode kernel; longer steps run the plain backend (FlashInfer)."""

    batch1: int = BATCH1_MAX_KV
    """tokens, a step of one sequence"""
    batched: int = BATCHED_MAX_KV
    """tokens, a step of 2..max_batch sequences"""

    def allows(self, num_seqs: int, longest: int) -> bool:
        """Whether a decode step of `num_seqs` real sequences, the longest `longest` KV
        tokens, is within the rule."""
        return longest <= (self.batch1 if num_seqs == 1 else self.batched)


@dataclass(frozen=True)
class SmallDecodeSettings:
    """The small-decode switch as read from the environment (module docstring)."""

    mode: str = "auto"
    """"auto", "0" or "1" (PHLOEM_SMALL_DECODE_ATTENTION)"""
    max_batch: int = DEFAULT_MAX_BATCH
    """sequences, the largest decode step taken (PHLOEM_SMALL_DECODE_MAX_BATCH)"""
    max_kv: int | None = None
    """tokens, one length limit for every batch size (PHLOEM_SMALL_DECODE_MAX_KV); None: the
    rule's (`LengthRule`)"""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SmallDecodeSettings:
        """The settings of `environ` (default os.environ).

        Raises:
            ValueError: naming the variable for a mode other than auto/0/1 or a count that is
                not an integer >= 1.
        """
        env = os.environ if environ is None else environ
        mode = env.get(ENV_SWITCH, "auto") or "auto"
        if mode not in MODES:
            raise ValueError(f"{ENV_SWITCH} must be auto, 0 or 1, got {mode!r}")
        counts = {}
        for name, default in ((ENV_MAX_BATCH, str(DEFAULT_MAX_BATCH)), (ENV_MAX_KV, None)):
            raw = env.get(name, default)
            if raw is not None and (not raw.isdigit() or int(raw) < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {raw!r}")
            counts[name] = None if raw is None else int(raw)
        return cls(mode, counts[ENV_MAX_BATCH], counts[ENV_MAX_KV])

    def enabled(self, device: torch.device | str | None, plain_name: str) -> bool:
        """Whether a plain backend named `plain_name` on `device` is wrapped: "1" always,
        "auto" on CUDA over FlashInfer, "0" never."""
        if self.mode != "auto":
            return self.mode == "1"
        on_cuda = device is not None and torch.device(device).type == "cuda"
        return on_cuda and plain_name == "flashinfer"

    def length_rule(self) -> LengthRule | None:
        """The KV-length rule ("auto"), or None: every length ("1")."""
        if self.mode == "1" and self.max_kv is None:
            return None
        if self.max_kv is not None:
            return LengthRule(self.max_kv, self.max_kv)
        return LengthRule()


def is_small_decode(meta: AttentionMetadata, max_batch: int) -> bool:
    """Whether a step is decode-only (every q_len 1) with at most `max_batch` sequences."""
    batch = meta.num_seqs
    return (
        0 < batch <= max_batch and meta.max_query_len == 1 and meta.query_start_loc_cpu[-1] == batch
    )
