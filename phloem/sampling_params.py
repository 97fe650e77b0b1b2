"""Sampling parameters of one request (vLLM-compatible names and semantics).

A frozen-after-validation dataclass with no I/O; `validate()` raises `ValueError` naming the field
and the limit. The sampler (`phloem.layers.sampler`) and the stop rules (`phloem.core.stop_checker`)
read it; nothing else interprets these fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "seed")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Fields (units in brackets):
        n: number of completions for the prompt [sequences]; they share the prompt's KV blocks.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; -1 (or 0) disables it.
        min_p: drop tokens whose probability is below min_p x the top probability; 0 disables.
        seed: per-request random seed; the same seed gives the same tokens whatever the batch.
        max_tokens: most tokens to generate [tokens]; None means up to the context length.
        min_tokens: EOS and stop_token_ids are banned until this many tokens exist [tokens].
        stop: strings that end generation; they are never included in the output text.
        stop_token_ids: token ids that end generation (kept in token_ids, not in text).
        ignore_eos: keep generating past the EOS token.
        logprobs: number of top log-probabilities to return per sampled token (None = none).
        presence_penalty, frequency_penalty: OpenAI-style additive penalties in [-2, 2].
        repetition_penalty: multiplicative penalty (> 0; 1 disables), CTRL-style.
        skip_special_tokens: drop special tokens when detokenizing.

    Raises:
        ValueError: from `validate()` (called by the constructor), naming the bad field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    _frozen: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(f"SamplingParams is frozen; cannot set {name!r}")
        super().__setattr__(name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True if any of the repetition, frequency or presence penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self) -> None:
        """Check types and ranges. Raises ValueError naming the field and its limit."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("max_tokens", "logprobs", "seed"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not all(isinstance(s, str) and s for s in self.stop):  # type: ignore[union-attr]
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0
            for t in self.stop_token_ids  # type: ignore[union-attr]
        ):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied (e.g. a per-child seed for n > 1)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values.update(changes)
        return SamplingParams(**values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict; unknown keys raise ValueError naming the key."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        for key in values:
            if key not in known:
                raise ValueError(f"unknown sampling field {key!r}; known: {sorted(known)}")
        return cls(**values)
