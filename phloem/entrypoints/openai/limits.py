"""What one request may ask of the server: body size, `n`, prompts, prompt length, shutdown drain.

The limits a deployer sets (`phloem serve --max-request-body-bytes ...`; the flags are derived
from `ServerLimits`), and the cheap length bound checked before a prompt is tokenized:

    characters of a prompt > max_chars_per_token(tokenizer) x max_model_len   ->  400, untokenized

No token of the vocabulary covers more characters than its longest entry (byte-level BPE keys
hold one character per byte; SentencePiece keys hold their text), and Unicode normalization
(NFC/NFKC) composes at most `NORMALIZATION_SLACK` code points into one, so a prompt longer than
the bound cannot fit in the context whatever the tokenizer does. A prompt under it is tokenized
on a worker thread (`server.py`), never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# NFC composes at most 4 code points into one (U+1F87: alpha + 3 combining marks; a Hangul
# syllable takes 3 jamo). Normalizers that delete characters (BERT's strip_accents) are not
# covered: the decoder-only tokenizers phloem runs (byte-level BPE, SentencePiece) have none.
NORMALIZATION_SLACK = 4


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and shutdown limits of `phloem serve`; its flags are derived from these
    fields (`--max-n`, ...), with each field's `help` and default."""

    max_request_body_bytes: int = field(
        default=16 << 20,
        metadata={"help": "largest request body [bytes]; a larger one gets 413 unparsed"},
    )
    max_n: int = field(
        default=128, metadata={"help": "largest n (choices per prompt) of one request"}
    )
    max_prompts_per_request: int = field(
        default=128, metadata={"help": "most prompts in one /v1/completions request"}
    )
    shutdown_timeout: float = field(
        default=300.0,
        metadata={
            "help": "on SIGTERM/SIGINT, seconds in-flight requests may still run; streams still "
            "open then end with an error event and [DONE]"
        },
    )

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        for name in ("max_request_body_bytes", "max_n", "max_prompts_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(
                f"shutdown_timeout must be a finite number >= 0, got {self.shutdown_timeout!r}"
            )


def limit_fields():
    """(flag, field) of every `ServerLimits` field: `--max-n` for `max_n`."""
    return [("--" + f.name.replace("_", "-"), f) for f in fields(ServerLimits)]


def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters one token of `tokenizer` stands for (see above)."""
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    return max(longest, 1) * NORMALIZATION_SLACK


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """Characters above which a prompt cannot fit in `max_model_len` tokens."""
    return max_chars_per_token(tokenizer) * max_model_len
