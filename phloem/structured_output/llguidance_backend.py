"""The llguidance backend (Microsoft's Guidance grammar engine: an Earley parser over a lexer of
derivative-based regexes, computing each token mask on the fly by walking a token trie): no
per-grammar precomputation, so a new schema costs about a millisecond. A mask costs tens of
microseconds between keys and on numbers, and up to 0.2-0.9 ms inside a string of a 128K
vocabulary, where most tokens are allowed, unless a slice (`SLICES`) covers the string's
characters (numbers: benchmarks/results/2026-11-25-cpu-structured-outputs/,
2026-11-26c-cpu-structured-masks/, 2026-11-26d-cpu-structured-distinct/).

JSON is compiled without free whitespace (`whitespace_flexible: False`), so a model cannot spend
its token budget on spaces and newlines inside a value, and an object schema with `properties`
that does not say `additionalProperties` gets none (`close_objects`: as xgrammar's strict mode
and OpenAI's strict schemas; otherwise a model may add keys without end). A choice list becomes the Lark rule
`start: "c1" | "c2" | ...`; an EBNF (GBNF) grammar is converted to Lark. The grammar is complete
when the matcher stops (nothing but EOS may follow): the sequence then finishes without
sampling the EOS token.
"""

from __future__ import annotations

import json
import os

import numpy as np

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.backend import GrammarBackend, GrammarMatcher, TokenizerData
from phloem.structured_output.split_fill import FILL_MODES, SplitFill, split_by_group

_JSON_OPTIONS = {"whitespace_flexible": False}

# The slicer's token sets: a mask whose lexer state allows all of a slice's language gets the
# slice's tokens at once instead of walking them in the token trie; a token belongs to the first
# slice whose regex it matches. llguidance's defaults hold JSON string contents of 1-10, 1-30
# and any number of characters, so inside a string with maxLength, once fewer than 10
# characters remain, every mask would walk the whole vocabulary; a slice for each remaining
# length 3-9 (and 16) keeps those masks sliced. None for 1 or 2: once any slice applies, every
# other slice's trie is walked apart (each again from its root), while a state that allows none
# walks the whole trie once, which costs less when 1-2 characters are left. The masks are the
# same with any slices; the cost per mask at 128K tokens falls 0.21 (defaults) -> 0.09 ms
# (benchmarks/results/2026-11-26d-cpu-structured-distinct, 2026-11-27f-cpu-grammar-fill).
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'  # a JSON string's unescaped character (as llguidance's)
SLICES = (
    r"[\x20\x0A\x0D\x09]+",  # whitespace
    *(f"{_STRING_CHAR}{{1,{n}}}" for n in (*range(3, 11), 16, 30)),
    f"{_STRING_CHAR}+",
)


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def close_objects(schema):
    """A copy of a JSON schema in which every object schema with `properties` and no
    `additionalProperties` gets `additionalProperties: false` (recursively)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = close_objects(out[key])
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) of a constraint; checks nothing.

    Raises:
        ValueError: an EBNF grammar that does not convert to Lark (the converter's message).
    """
    import llguidance as llg
    from llguidance.gbnf_to_lark import gbnf_to_lark

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        schema = close_objects(json.loads(schema) if isinstance(schema, str) else schema)
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in params.choice)  # type: ignore[union-attr]
        return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    try:
        return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(params.grammar))
    except Exception as e:  # noqa: BLE001 - the converter raises its own error types
        raise ValueError(str(e)) from None


def _error(params: StructuredOutputsParams, message: str) -> ValueError:
    first = message.strip().splitlines()[0] if message.strip() else "rejected"
    return ValueError(f"structured_outputs.{params.kind} is invalid or unsupported: {first}")


class LLGuidanceMatcher(GrammarMatcher):
    """An `llguidance.LLMatcher` (its rollback history is unbounded) and the id of the lexer it
    shares with other matchers (`group`: the batched calls order rows by it)."""

    __slots__ = ("inner", "group")

    def __init__(self, inner, group: int) -> None:
        self.inner = inner
        self.group = group

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.inner, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        # try_consume_tokens leaves a rejected token unconsumed (consume_token would put the
        # matcher in its error state for good)
        return self.inner.try_consume_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        if not self.inner.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.inner.get_error()}")

    def is_terminated(self) -> bool:
        return bool(self.inner.is_stopped())


class LLGuidanceGrammar:
    """A compiled constraint: its grammar text (llguidance's JSON form) and the templates its
    sequences' matchers are copied from, up to `num_templates` of them, each built from the
    text on first use (~1 ms at 128K tokens) and never advanced itself. Thread-safe. The
    templates live as long as the manager caches the constraint (~0.1 MB each at 128K tokens,
    more as their shared lexers learn states); a constraint with one sequence has none.

    Attributes:
        text: the grammar (what `LLMatcher` is built from).
    """

    def __init__(self, text: str, num_templates: int) -> None:
        import threading

        self.text = text
        self._templates: list[object | None] = [None] * max(1, num_templates)
        self._next = 0  # round robin over the templates
        self._lock = threading.Lock()

    def next_slot(self, built_only: bool) -> tuple[int, object | None] | None:
        """(slot, its template or None: to build) for the next sequence, round robin; with
        `built_only`, None (and no turn taken) when that slot's template is not built yet."""
        with self._lock:
            slot = self._next % len(self._templates)
            template = self._templates[slot]
            if built_only and template is None:
                return None
            self._next += 1
            return slot, template

    def keep(self, slot: int, template: object) -> object:
        """Store a template built for `slot` (another thread may have built one first: that one
        is kept and returned)."""
        with self._lock:
            if self._templates[slot] is None:
                self._templates[slot] = template
            return self._templates[slot]

    @property
    def num_built(self) -> int:
        """Templates built so far."""
        return sum(t is not None for t in self._templates)


class LLGuidanceBackend(GrammarBackend):
    """llguidance over one tokenizer. `compile` returns an `LLGuidanceGrammar` (checked by
    building a matcher over the vocabulary, which becomes its first sequence's); the later
    sequences of a constraint get `deep_copy`s of its templates, round robin.

    Why copies of a few templates: a copy (~1 us) shares its template's lexer, whose lazily
    built automaton and token sets its siblings have warmed up, so a matcher built apart (~1
    ms each, ~3 ms on a busy 14-thread host: 1,024 of them held a batch's admission ~0.25 s on
    an H200 host) costs 1.21x the CPU a mask over a 128-step decode (1.7x over its first 64
    steps), and on 2 threads fills 16% slower though it scales 1.85x to the copies' 1.80x
    (benchmarks/results/2026-11-27g-cpu-fill-threads). The lexer is behind a lock, so
    copies of ONE template fill one at a time on any number of threads (one schema once ran
    at 0.10x unconstrained that way); with `templates_per_thread` x `num_threads` templates
    and the batched calls ordering rows by template (the library's threads take contiguous
    runs of rows), threads rarely meet on one lexer (benchmarks/results/
    2026-11-26e-cpu-structured-one-schema). `templates_per_thread=0`: every matcher built apart.
    `fill_bitmasks` and `accept_tokens` work on many rows on `num_threads` native threads (the
    GIL released). `fill_mode="split"` fills on `num_threads` Python threads, each with whole
    templates on its own 1-thread executor (`split_fill`: no lexer wanted by two threads; a
    static split); "pull" the same, each thread taking the next template when free (one
    library call a template); "pool" (default) on the library's work-stealing pool.

    Args:
        tokenizer: the model's (`TokenizerData`).
        num_threads: threads of the batched fill and advance.
        templates_per_thread: templates per constraint, per thread (0: no copies).
        same_tokenizer_as: another backend over the same `tokenizer`, whose llguidance
            tokenizer info (~1.2 s to build at 128K tokens) this one shares (benchmarks).
        slices: the slicer's regexes (`SLICES`; benchmarks compare others: they change the
            cost of a mask, never the mask); ignored with `same_tokenizer_as`.
        fill_mode: "pool", "split" or "pull" (`FILL_MODES`); None: $PHLOEM_GRAMMAR_FILL, else
            "pool".

    Raises:
        ValueError: `templates_per_thread` < 0, or an unknown fill mode.
    """

    name = "llguidance"

    def __init__(
        self,
        tokenizer: TokenizerData,
        num_threads: int = 1,
        templates_per_thread: int = 4,
        same_tokenizer_as: LLGuidanceBackend | None = None,
        slices: tuple[str, ...] = SLICES,
        fill_mode: str | None = None,
    ) -> None:
        import llguidance as llg
        import llguidance.hf

        if templates_per_thread < 0:
            raise ValueError(f"templates_per_thread must be >= 0, got {templates_per_thread}")
        fill_mode = fill_mode or os.environ.get("PHLOEM_GRAMMAR_FILL") or "pool"
        if fill_mode not in FILL_MODES:
            raise ValueError(f"grammar fill mode must be one of {FILL_MODES}, got {fill_mode!r}")
        self.fill_mode = fill_mode
        self._llg = llg
        eos = list(tokenizer.stop_token_ids) or None
        if same_tokenizer_as is not None:
            self.tokenizer = same_tokenizer_as.tokenizer
        else:
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer.tokenizer,
                n_vocab=tokenizer.vocab_size,
                eos_token=eos,
                slices=list(slices),
            )
        self._executor = llg.LLExecutor(max(1, num_threads))
        self._split = SplitFill(llg, num_threads) if fill_mode != "pool" else None
        self._num_templates = templates_per_thread * max(1, num_threads)
        # (matchers list, its `_by_group` order) and (matchers, rows, the fill's pairs) of the
        # last calls: the manager passes the same lists while a batch's rows stay the same
        # (`step_rows`), so a steady decode batch orders its rows once, not twice a step
        self._order: tuple[list, list[int]] = ([], [])
        self._fill_pairs: tuple[list, list[int], list] = ([], [], [])

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        import llguidance as llg

        try:
            error = llg.LLMatcher.validate_grammar(grammar_text(params))
        except ValueError as e:
            raise _error(params, str(e)) from None
        if error:
            raise _error(params, error)

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        """The constraint's `LLGuidanceGrammar`, checked by building a matcher of it over this
        tokenizer.

        Raises:
            ValueError: as `validate`, or the grammar does not build over this vocabulary.
        """
        return self.compile_with_matcher(params)[0]

    def compile_with_matcher(
        self, params: StructuredOutputsParams
    ) -> tuple[LLGuidanceGrammar, GrammarMatcher]:
        """The grammar and the matcher built to check it, handed to the first sequence (a
        matcher built apart costs as much as the check: one build per distinct schema).

        Raises:
            ValueError: as `compile`.
        """
        try:
            text = grammar_text(params)
            matcher = self._llg.LLMatcher(self.tokenizer, text)
        except ValueError as e:
            raise _error(params, str(e)) from None
        if matcher.is_error():
            raise _error(params, matcher.get_error())
        return LLGuidanceGrammar(text, self._num_templates), LLGuidanceMatcher(matcher, id(matcher))

    def matcher(self, compiled: LLGuidanceGrammar) -> LLGuidanceMatcher:
        """A copy of the grammar's next template, round robin, the template built first where
        it is not yet (~1 ms); built apart with `templates_per_thread=0`. Thread-safe: the
        manager makes matchers in its pool."""
        if not self._num_templates:
            built = self._llg.LLMatcher(self.tokenizer, compiled.text)
            return LLGuidanceMatcher(built, id(built))
        slot, template = compiled.next_slot(built_only=False)  # type: ignore[misc]
        if template is None:
            template = compiled.keep(slot, self._llg.LLMatcher(self.tokenizer, compiled.text))
        return LLGuidanceMatcher(template.deep_copy(), id(template))  # type: ignore[attr-defined]

    def ready_matcher(self, compiled: LLGuidanceGrammar) -> LLGuidanceMatcher | None:
        """A copy of the next template once it is built (microseconds), else None."""
        taken = compiled.next_slot(built_only=True) if self._num_templates else None
        if taken is None:
            return None
        template = taken[1]
        return LLGuidanceMatcher(template.deep_copy(), id(template))  # type: ignore[union-attr]

    def accept_tokens(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[bool]:
        """Advance matchers[i] by token_ids[i] on the library's threads (`consume_token_par`,
        the GIL released; rows ordered by shared lexer); a matcher that rejects its token is
        left in its error state (the engine fails that sequence). [True where accepted]."""
        order = self._ordered(matchers)
        pairs = [(matchers[i].inner, token_ids[i]) for i in order]  # type: ignore[attr-defined]
        accepted = self._executor.consume_token_par(pairs)
        results = [False] * len(matchers)
        for i, ok in zip(order, accepted):
            results[i] = bool(ok)
        return results

    def advance(self, matchers: list[GrammarMatcher], token_ids: list[int]) -> list[bool | None]:
        """`GrammarBackend.advance` with the matchers' stop states read straight from the
        library (no Python call per row) and the live ones advanced together on its threads
        (`consume_token_par`, rows ordered by shared lexer)."""
        inners = [m.inner for m in matchers]  # type: ignore[attr-defined]
        results: list[bool | None] = [True if m.is_stopped() else False for m in inners]
        order = self._ordered(matchers)
        if any(results):  # complete already: not advanced
            order = [i for i in order if not results[i]]
            if not order:
                return results
        accepted = self._executor.consume_token_par([(inners[i], token_ids[i]) for i in order])
        if len(order) == len(inners) and all(accepted):  # nearly every step: every row advanced
            return [m.is_stopped() for m in inners]
        for i, ok in zip(order, accepted):
            results[i] = inners[i].is_stopped() if ok else None
        return results

    def terminated(self, matchers: list[GrammarMatcher]) -> list[bool]:
        return [m.inner.is_stopped() for m in matchers]  # type: ignore[attr-defined]

    def fill_bitmasks(
        self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        """Row rows[i] of `bitmask` (int32 [R, W], C-contiguous) = the mask of matchers[i],
        written in place by the library's threads (rows ordered by shared lexer) or, with
        `fill_mode="split"`, by `num_threads` threads each given whole templates."""
        from llguidance.numpy import fill_next_token_bitmask_par

        kept_matchers, kept_rows, pairs = self._fill_pairs
        if matchers is not kept_matchers or rows is not kept_rows:
            pairs = self._fill_order(matchers, rows)
            self._fill_pairs = (matchers, rows, pairs)
        if self._split is not None:
            self._split.fill(pairs, bitmask)
        else:
            fill_next_token_bitmask_par(self._executor, pairs, bitmask)

    def _fill_order(self, matchers: list, rows: list[int]) -> list:
        """The fill's (matcher, row) pairs, rows ordered by shared lexer; with the split
        fill, [part][pair] (`split_by_group`: whole templates a part; "pull": one template a
        part), each part in that order (the advance reuses it: `_ordered`)."""
        order = self._ordered(matchers)
        if self._split is None:
            return [(matchers[i].inner, rows[i]) for i in order]
        # "pull": a part a template, largest first (as many parts as groups: one group each)
        num_parts = len(order) if self.fill_mode == "pull" else self._split.num_threads
        parts = split_by_group([matchers[i].group for i in order], num_parts)
        return [[(matchers[order[j]].inner, rows[order[j]]) for j in part] for part in parts]

    def _ordered(self, matchers: list) -> list[int]:
        """`_by_group(matchers)`, kept for the last list (the same list object: never mutated
        by its owner, `step_rows.StepRows`; a list the caller changes in place would be
        ordered wrong, which no caller does)."""
        kept, order = self._order
        if matchers is not kept:
            order = _by_group(matchers)
            self._order = (matchers, order)
        return order


def _by_group(matchers: list) -> list[int]:
    """Indices of `matchers` (`LLGuidanceMatcher`s) with the copies of one template together:
    the library's threads take contiguous runs of the list, so a lexer is mostly used by one
    thread at a time."""
    groups = [m.group for m in matchers]
    return sorted(range(len(groups)), key=groups.__getitem__)
