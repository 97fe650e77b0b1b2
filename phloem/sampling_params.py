"""Sampling parameters of one request (vLLM-compatible names and semantics).

A frozen-after-validation dataclass with no I/O; `validate()` raises `ValueError` naming the field
and the limit. The sampler (`phloem.layers.sampler`) and the stop rules (`phloem.core.stop_checker`)
read it; nothing else interprets these fields.

Limits that follow from what the engine can do are checked here, so a request that passes
`validate()` cannot fail inside a step for its values: integers fit int64 (the engine's tensors),
floats are finite as float64, `n` is at most `MAX_N`, and seeds lie in `[SEED_MIN, SEED_MAX]`.
Limits that depend on the model (stop_token_ids within the vocabulary) are checked when the
engine admits the request (`LLMEngine.validate_params`).

Seeds: any integer in [-2^63, 2^64) (the union of int64 and uint64) is accepted and taken modulo
2^64 (`generator_seed`): -1 and 2^64 - 1 seed the same generator, as `torch.Generator` does. The
i-th of n sequences uses `(seed + i) mod 2^64`, so seed + i never leaves the range.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "seed")
_OPTIONAL_FIELDS = ("max_tokens", "logprobs", "seed")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")
INT64_MAX = 2**63 - 1
SEED_MIN = -(2**63)  # the smallest seed accepted (int64's minimum)
SEED_MAX = 2**64 - 1  # the largest seed accepted (uint64's maximum)
MAX_N = 4096  # most sequences per request: each is a scheduler request with its own state
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _show(value: Any) -> str:
    """`repr(value)` for an error message; an integer too long to print as decimal (Python
    refuses past 4,300 digits) is described by its size instead."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on what a request may generate (vLLM's `StructuredOutputsParams`).

    Exactly one field is set:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid
            against it.
        regex: a regular expression the whole output matches.
        choice: a non-empty list of non-empty strings; the output is one of them.
        grammar: a grammar in EBNF (GBNF) text, whose start rule is `root`.
        json_object: True: the output is any JSON object (OpenAI's `{"type": "json_object"}`).

    Checked here: the kinds and types. Whether the schema, regex or grammar compiles is checked
    by the grammar library when a request is admitted (`phloem.structured_output`).

    Raises:
        ValueError: from the constructor, naming the field (`structured_outputs.<field>`), when
            none or several are set, or one has the wrong type or is empty.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_fields = [n for n in _CONSTRAINT_FIELDS if getattr(self, n) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_fields or 'none'}"
            )
        if self.json is not None:
            _check_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}"
                )
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {choice!r}"
                )
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError(
                    f"structured_outputs.choice must hold non-empty strings, got {choice!r}"
                )
            object.__setattr__(self, "choice", tuple(choice))
        if self.json_object not in (None, True, False):
            raise ValueError(
                f"structured_outputs.json_object must be a boolean, got {self.json_object!r}"
            )

    @property
    def kind(self) -> str:
        """The field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(n for n in _CONSTRAINT_FIELDS if getattr(self, n) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints (a schema dict and its JSON text
        give one key); what compiled grammars are cached by. Computed once per object (a
        request's constraint is keyed at every check and at registration; a schema's canonical
        JSON text costs ~0.03 ms), so a schema dict must not be mutated after first use."""
        cached = self.__dict__.get("_key")
        if cached is None:
            cached = self._canonical_key()
            object.__setattr__(self, "_key", cached)
        return cached

    def _canonical_key(self) -> tuple[str, str]:
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, dict) else json.loads(self.json)  # type: ignore[arg-type]
            return kind, json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(list(self.choice))  # type: ignore[arg-type]
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    @classmethod
    def from_dict(cls, values: Any) -> StructuredOutputsParams:
        """Build from a JSON-like dict; unknown keys raise ValueError naming the key."""
        if isinstance(values, cls):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(values).__name__}")
        for key in values:
            if key not in _CONSTRAINT_FIELDS:
                raise ValueError(
                    f"unknown structured_outputs field {key!r}; known: {list(_CONSTRAINT_FIELDS)}"
                )
        return cls(**values)


def _check_schema(schema: Any) -> None:
    """structured_outputs.json must be a JSON object (a dict or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}"
        )


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Fields (units in brackets):
        n: number of completions for the prompt, 1..MAX_N [sequences]; they share the prompt's
            KV blocks.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; -1 (or 0) disables it.
        min_p: drop tokens whose probability is below min_p x the top probability; 0 disables.
        seed: per-request random seed in [-2^63, 2^64), taken modulo 2^64; the same seed gives
            the same tokens whatever the batch. Sequence i of n uses seed + i (modulo 2^64).
        max_tokens: most tokens to generate [tokens]; None means up to the context length.
        min_tokens: EOS and stop_token_ids are banned until this many tokens exist [tokens].
        stop: a string or a list of strings that end generation; never included in the text.
        stop_token_ids: token ids that end generation (kept in token_ids, not in text); the
            engine checks them against the model's vocabulary when it admits the request.
        ignore_eos: keep generating past the EOS token.
        logprobs: number of top log-probabilities to return per sampled token (None = none).
        presence_penalty, frequency_penalty: OpenAI-style additive penalties in [-2, 2].
        repetition_penalty: multiplicative penalty (> 0; 1 disables), CTRL-style.
        skip_special_tokens: drop special tokens when detokenizing.
        structured_outputs: a constraint on the output (`StructuredOutputsParams`, or a dict of
            its fields); None: unconstrained. The grammar decides where EOS is allowed, and
            the sequence finishes "stop" when the grammar is complete.

    Raises:
        ValueError: from `validate()` (called by the constructor), naming the bad field and its
            limit; wrong types (a string for a bool, a float for an int, ...) included.
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
    structured_outputs: StructuredOutputsParams | None = None
    _frozen: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        for name in _FLOAT_FIELDS:  # ints become floats here (a huge int has no float value)
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                try:
                    setattr(self, name, float(value))
                except OverflowError:
                    raise ValueError(f"{name} must be finite, got {_show(value)}") from None
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

    def generator_seed(self, index: int = 0) -> int | None:
        """The seed of sequence `index`'s generator: (seed + index) mod 2^64, in [0, 2^64)
        (what `torch.Generator.manual_seed` takes); None when the request has no seed."""
        if self.seed is None:
            return None
        return (self.seed + index) % 2**64

    def validate(self) -> None:
        """Check types and ranges. Raises ValueError naming the field and its limit."""
        self._validate_types()
        self._validate_ranges()

    def _validate_types(self) -> None:
        """Check every int, bool and float field's type (and an int's 64-bit magnitude, the
        seed's range). Raises ValueError naming the field; called before the range checks,
        which assume these types."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if name != "seed" and not -INT64_MAX <= value <= INT64_MAX:
                raise ValueError(
                    f"{name} must be at most {INT64_MAX} in magnitude, got {_show(value)}"
                )
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(
                f"seed must be in [-2^63, 2^64 - 1] = [{SEED_MIN}, {SEED_MAX}], "
                f"got {_show(self.seed)}"
            )
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"{name} must be finite, got {value!r}")

    def _validate_ranges(self) -> None:
        """Check each field's range and the stop lists' items, assuming the types that
        `_validate_types` checked. Raises ValueError naming the field and its limit."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
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
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX
            for t in self.stop_token_ids  # type: ignore[union-attr]
        ):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied (e.g. a per-child seed for n > 1)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values.update(changes)
        return SamplingParams(**values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict; unknown keys raise ValueError naming the key."""
        if not isinstance(values, dict):
            raise ValueError(f"sampling fields must be a dict, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        for key in values:
            if key not in known:
                raise ValueError(f"unknown sampling field {key!r}; known: {sorted(known)}")
        return cls(**values)
