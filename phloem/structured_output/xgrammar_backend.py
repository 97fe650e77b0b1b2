"""The xgrammar backend (Dong et al., "XGrammar: Flexible and Efficient Structured Generation
Engine for Large Language Models", arXiv 2411.15100): a pushdown automaton over byte-level
grammars with a per-state cache of context-independent token masks (§3.1-3.2), so a mask fill
checks only the few context-dependent tokens.

JSON is compiled without free whitespace (`any_whitespace=False`: compact separators), so a
model cannot spend its token budget on spaces and newlines inside a value. A choice list becomes
the grammar `root ::= "c1" | "c2" | ...`. Known gap (xgrammar 0.2.8): a string with maxLength
becomes up to n characters of a class that excludes only the quote, the backslash, CR and LF,
which lets raw control bytes through (invalid JSON) and allows no escapes
(benchmarks/results/2026-11-26c-cpu-structured-masks/).
"""

from __future__ import annotations

import json

import numpy as np

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.backend import GrammarBackend, GrammarMatcher, TokenizerData

_JSON_OBJECT = '{"type": "object"}'
# compact separators: without free whitespace xgrammar's defaults are ", " and ": " (a space
# per field, and not the language llguidance's backend allows)
_SEPARATORS = (",", ":")


def _choice_ebnf(choice) -> str:
    """The grammar whose only sentences are the strings of `choice` (JSON string escapes are
    xgrammar's EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def _error(params: StructuredOutputsParams, error: Exception) -> ValueError:
    """The ValueError naming the field for a library error (whose message starts with a log
    prefix "[time] file:line: ")."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "] " in message and message.startswith("["):
        message = message.split(": ", 1)[-1]
    return ValueError(f"structured_outputs.{params.kind} is invalid or unsupported: {message}")


class XGrammarMatcher(GrammarMatcher):
    """An `xgrammar.GrammarMatcher` (its rollback history is unbounded)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.inner.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.inner.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        try:
            self.inner.rollback(num_tokens)
        except Exception as e:  # noqa: BLE001 - the library raises RuntimeError
            raise ValueError(f"cannot roll back {num_tokens} tokens: {e}") from None

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())


class XGrammarBackend(GrammarBackend):
    """xgrammar over one tokenizer. Compilation runs in xgrammar's C++ (thread-safe: the engine
    calls `compile` from its pool); xgrammar's own cache is off (phloem's manager caches by
    constraint). `fill_bitmasks` fills many rows on `num_threads` C++ threads."""

    name = "xgrammar"

    def __init__(self, tokenizer: TokenizerData, num_threads: int = 1) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.tokenizer,
            vocab_size=tokenizer.vocab_size,
            stop_token_ids=list(tokenizer.stop_token_ids) or None,
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, num_threads))

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        kind = params.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(
                    _schema_text(params), any_whitespace=False, separators=_SEPARATORS
                )
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
        except Exception as e:  # noqa: BLE001 - the library raises RuntimeError for bad input
            raise _error(params, e) from None

    def compile(self, params: StructuredOutputsParams):
        compiler = self.compiler
        kind = params.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    _schema_text(params), any_whitespace=False, separators=_SEPARATORS
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    _JSON_OBJECT, any_whitespace=False, separators=_SEPARATORS
                )
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(_choice_ebnf(params.choice))
            return compiler.compile_grammar(params.grammar)
        except Exception as e:  # noqa: BLE001 - as in validate
            raise _error(params, e) from None

    def matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def ready_matcher(self, compiled) -> XGrammarMatcher:
        """`matcher`: ~10 us (the per-grammar work is in the compiled grammar)."""
        return self.matcher(compiled)

    def fill_bitmasks(
        self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        """Row rows[i] of `bitmask` (int32 [R, W], C-contiguous) = the mask of matchers[i],
        filled in place on the backend's threads."""
        inner = [m.inner for m in matchers]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(inner, bitmask, indices=list(rows))


def _schema_text(params: StructuredOutputsParams) -> str:
    schema = params.json
    return schema if isinstance(schema, str) else json.dumps(schema)
