"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
SentencePiece (a token's leading space depends on its left neighbour), so each step decodes a
short window `[prefix_offset, len)` and emits only the text beyond `[prefix_offset, read_offset)`,
holding back text that ends in an incomplete character (U+FFFD).

    |-- context --|-- already emitted --|-- new --|
    prefix_offset       read_offset          len(token_ids)
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text of one generated sequence, updated a token at a time.

    Args:
        tokenizer: a transformers tokenizer.
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

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string hit (text then ends before it), else None.

        Mutates `text`.
        """
        self._token_ids.append(token_id)
        if not self.incremental:
            return None
        return self._advance(final=False)

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
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return None
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
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
