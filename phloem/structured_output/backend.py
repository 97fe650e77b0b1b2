"""The grammar-library interface: every method phloem calls on a grammar backend, declared once.

A backend turns a `StructuredOutputsParams` into a compiled grammar for one tokenizer
(`compile`, the expensive part: run in a thread pool), checks a constraint without the tokenizer
(`validate`: cheap, at admission, so a bad schema is a ValueError before any step), and makes
per-sequence matchers. A matcher walks the grammar token by token: `fill_bitmask` writes the
allowed next tokens as bits (bit t % 32 of int32 word t // 32 set = token t allowed, the layout
xgrammar and llguidance share), `accept_token` advances it, `rollback` undoes accepted tokens
(for speculative decoding), `is_terminated` says the grammar accepted its stop token.

Two libraries implement it: `llguidance_backend` (the default) and `xgrammar_backend` (the
choice and its numbers: benchmarks/results/2026-11-25-cpu-structured-outputs/ and
2026-11-26c-cpu-structured-masks/); another plugs in by implementing these two classes (and,
for a batched library, `fill_bitmasks` and `accept_tokens`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from phloem.sampling_params import StructuredOutputsParams


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class TokenizerData:
    """What a backend needs of the model's tokenizer.

    Attributes:
        tokenizer: a transformers `PreTrainedTokenizerFast` (the vocabulary and its decoding).
        vocab_size: width of the model's logits [tokens] (may exceed the tokenizer's length).
        stop_token_ids: the ids that end a sequence (EOS), the only tokens a complete grammar
            allows.
    """

    tokenizer: object
    vocab_size: int
    stop_token_ids: tuple[int, ...]


class GrammarMatcher(abc.ABC):
    """One sequence's position in its grammar (not thread-safe: one sequence, one thread)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 [R, W], W =
        `bitmask_width(vocab_size)`): bit t % 32 of word t // 32 set = token t allowed."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's rejected drafts).

        Raises:
            ValueError: more tokens than the matcher keeps history for.
        """

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""


class GrammarBackend(abc.ABC):
    """A grammar library for one tokenizer (see the module docstring)."""

    name: str

    @staticmethod
    @abc.abstractmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Check that the constraint compiles (schema features, regex syntax, grammar syntax)
        without the tokenizer.

        Raises:
            ValueError: naming the field (`structured_outputs.json`, ...) and the library's
                reason.
        """

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar for this tokenizer (opaque; thread-safe to call from a pool).

        Raises:
            ValueError: as `validate`.
        """

    @abc.abstractmethod
    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""

    def ready_matcher(self, compiled: object) -> GrammarMatcher | None:
        """A fresh matcher of `compiled` made at once, where that costs microseconds (the
        manager then makes it on the engine loop, and the sequence is ready when registered);
        None where it costs more (the manager builds `matcher` in its pool). Here: None."""
        return None

    def compile_with_matcher(
        self, params: StructuredOutputsParams
    ) -> tuple[object, GrammarMatcher]:
        """`compile`, and a matcher of it for the constraint's first sequence. A library whose
        compile check builds a matcher anyway overrides this to hand that one out.

        Raises:
            ValueError: as `compile`.
        """
        compiled = self.compile(params)
        return compiled, self.matcher(compiled)

    def accept_tokens(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[bool]:
        """Advance matchers[i] by token_ids[i]; [True where accepted]. A matcher whose token was
        rejected may be left unusable (its sequence fails); here, one after the other, it is
        left unchanged (`accept_token`). A library with a batched advance overrides this."""
        return [m.accept_token(t) for m, t in zip(matchers, token_ids)]

    def advance(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[bool | None]:
        """Advance matchers[i] by token_ids[i] where its grammar is not complete yet
        (`accept_tokens`); [True: complete (before or after the token), False: goes on, None:
        the token was rejected (the matcher may be left unusable: its sequence fails)]. A
        library that reads many matchers' completion cheaply overrides this."""
        results: list[bool | None] = [True if m.is_terminated() else False for m in matchers]
        live = [i for i, done in enumerate(results) if not done]
        accepted = self.accept_tokens([matchers[i] for i in live], [token_ids[i] for i in live])
        for i, ok in zip(live, accepted):
            results[i] = matchers[i].is_terminated() if ok else None
        return results

    def terminated(self, matchers: list[GrammarMatcher]) -> list[bool]:
        """[matchers[i].is_terminated()]; a library overrides this where it reads them without
        a Python call per matcher."""
        return [m.is_terminated() for m in matchers]

    def fill_bitmasks(
        self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        """Row rows[i] of `bitmask` (int32 [R, W], C-contiguous) = the mask of matchers[i]; the
        other rows are left as they are (one after the other here; a library with a batched
        fill overrides this)."""
        for m, row in zip(matchers, rows):
            m.fill_bitmask(bitmask, row)
