"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
SentencePiece (a token's leading space depends on its left neighbour), so each step decodes a
short window `[prefix_offset, len)` and emits only the text beyond `[prefix_offset, read_offset)`,
holding back text that ends in an incomplete character (U+FFFD).

    |-- context --|-- already emitted --|-- new --|
    prefix_offset       read_offset          len(token_ids)

Two ways run this rule, with the same text out:

- the `tokenizers` library's `DecodeStream` (one call per token into Rust: the two decodes of
  the window happen there), for tokenizers whose `decode` is exactly their `tokenizers`
  backend's (`stream_backend`: phloem's `FastTokenizer`, a transformers fast tokenizer without
  `clean_up_tokenization_spaces` and without its own `decode`);
- two `tokenizer.decode` calls per token in Python, for every other tokenizer (transformers'
  slow ones), for a prompt context that ends inside a character (its text then ends in U+FFFD,
  which the completing output token replaces; `DecodeStream` would emit that character, the
  window rule does not), and for `flush` of held-back tokens (the end of a sequence).

Both rest on one property of the decoders (byte-level BPE, byte-fallback SentencePiece,
Metaspace, WordLevel): text that ends on a character boundary is a prefix of the text of any
longer token list. Where it fails (byte-fallback tokens whose bytes are not UTF-8 turn the valid
bytes grouped with them into U+FFFD), `DecodeStream` raises and the sequence goes on with the
Python rule from the same offsets. tests/engine/test_detokenizer.py checks that the two ways
agree token for token on multi-byte text for such tokenizers.
"""

from __future__ import annotations

import sys
from typing import Any

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def stream_backend(tokenizer) -> Any:
    """The `tokenizers.Tokenizer` whose decode equals `tokenizer.decode`, or None.

    Only two kinds are trusted: phloem's `FastTokenizer` (its decode is its backend's), and a
    transformers fast tokenizer that keeps transformers' `decode` and `_decode` and does not
    clean up tokenization spaces (its decode is then its backend's too).
    """
    from phloem.tokenizer import FastTokenizer

    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.backend
    if "transformers" not in sys.modules:  # not a transformers tokenizer: never imported
        return None
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return tokenizer.backend_tokenizer
    return None


class IncrementalDetokenizer:
    """Text of one generated sequence, updated a token at a time.

    Args:
        tokenizer: a transformers tokenizer or phloem's `FastTokenizer`.
        prompt_token_ids: the prompt; its last few tokens give the first output token context.
        skip_special_tokens: drop special tokens from the text.
        stop: stop strings; the text is cut before the first one found.
        incremental: keep `text` up to date after every token (needed for streaming). Without
            it and without stop strings, tokens are only collected and `flush()` decodes the
            text once (same text; two decode calls per sequence, context + outputs and the
            context alone, instead of two per token).
    """

    def __init__(
        self, tokenizer, prompt_token_ids, skip_special_tokens=True, stop=(), incremental=True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.incremental = incremental or bool(self.stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""
        self._backend = stream_backend(tokenizer) if self.incremental else None
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            context_text = self._backend.decode(context, skip_special_tokens=skip_special_tokens)
            if not context_text.endswith(_REPLACEMENT):
                self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    @property
    def uses_decode_stream(self) -> bool:
        """True while tokens go through `DecodeStream` (see the module docstring)."""
        return self._stream is not None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string hit (text then ends before it), else None.

        Mutates `text`.
        """
        self._token_ids.append(token_id)
        if not self.incremental:
            return None
        if self._stream is None:
            return self._advance(final=False)
        try:
            delta = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception: invalid prefix
            # earlier text changed (byte-fallback tokens of an invalid UTF-8 run turn valid
            # bytes before them into U+FFFD): the window rule from here on, as before
            self._stream = None
            return self._advance(final=False)
        if delta is None:
            return None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return self._append(delta)

    def add_tokens(self, token_ids: list[int]) -> tuple[int, str] | None:
        """Append tokens one `add_token` at a time; returns (the index in `token_ids` of the
        token that hit a stop string, the stop string), else None. Tokens after a hit are not
        appended. Without `incremental` (no stop strings, no streaming) they are only
        collected, so the run is appended at once (a verify step's accepted drafts:
        results/2026-11-27c-cpu-spec-per-draft). Mutates `text`."""
        if not self.incremental:
            self._token_ids.extend(token_ids)
            return None
        for i, token_id in enumerate(token_ids):
            stop = self.add_token(token_id)
            if stop is not None:
                return i, stop
        return None

    def flush(self) -> str | None:
        """Emit text still held back (the sequence has ended); returns a stop string hit.

        Mutates `text`. Decodes nothing when the last `add_token` emitted all its tokens'
        text (nothing is held back: `_advance` would decode the same window twice and find no
        new text).
        """
        if not self.incremental:  # one decode of context + outputs, minus the context's text
            context = self._decode(self._token_ids[: self._read_offset])
            self.text = self._decode(self._token_ids)[len(context) :]
            return None
        if self._read_offset == len(self._token_ids):
            return None
        return self._advance(final=True)

    def _advance(self, final: bool) -> str | None:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return None
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return self._append(new_text[len(prefix_text) :])

    def _append(self, delta: str) -> str | None:
        """Add emitted text; cut it before the first stop string found in the new tail."""
        if not self.stop:
            self.text += delta
            return None
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        hits = [
            (pos, stop) for stop in self.stop if (pos := self.text.find(stop, search_from)) >= 0
        ]
        if not hits:
            return None
        pos, stop = min(hits)
        self.text = self.text[:pos]
        return stop
