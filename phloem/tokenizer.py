"""A fast tokenizer read straight from an HF directory's tokenizer.json, without transformers.

Importing transformers costs about a second before any work (its package init scans every
model's module); the `tokenizers` library it wraps loads a tokenizer.json in ~0.1 s. For the
directories phloem writes itself (the converted-checkpoint cache, `models/checkpoint_cache.py`),
whose tokenizer is fully described by tokenizer.json + tokenizer_config.json +
chat_template.jinja, `FastTokenizer` gives the part of the transformers tokenizer API phloem
uses, with the same results (tests compare it with `PreTrainedTokenizerFast` on the same files):

- `encode(text, add_special_tokens=True)`: the tokenizer.json pipeline (normalizer,
  pre-tokenizer, model, post-processor);
- `decode(ids, skip_special_tokens=False)`: the tokenizer.json decoder (a directory asking for
  transformers' `clean_up_tokenization_spaces` on a non-BPE model is refused:
  `UnsupportedTokenizer`, and the loader uses transformers for it);
- `apply_chat_template(messages, tokenize=False, add_generation_prompt=False)`: the Jinja
  template rendered as transformers renders it (sandboxed environment, `trim_blocks` and
  `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that does not escape HTML,
  `raise_exception` and `strftime_now` globals, the special tokens as variables);
- `eos_token_id`, `bos_token_id`, `pad_token_id`, `get_vocab()`, `chat_template`,
  `convert_tokens_to_ids`, `convert_ids_to_tokens`.

A directory whose tokenizer_config.json sets anything else that may change how transformers
builds the tokenizer (`add_bos_token`, `add_prefix_space`, a model-specific tokenizer class, ...)
is refused (`UnsupportedTokenizer`), and the loader uses transformers for it. For the rest of
the transformers API, load the directory with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import datetime
import json
import os
from functools import cached_property
from typing import Any

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")  # fmt: skip


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# tokenizer_config.json keys whose meaning FastTokenizer reproduces (or that change nothing it
# does); any other key may change how transformers builds the tokenizer (e.g. add_bos_token or
# add_prefix_space rewrite the pipeline at load), so such a directory is left to transformers
_KNOWN_CONFIG_KEYS = frozenset({
    *_SPECIAL_NAMES, "backend", "tokenizer_class", "model_max_length", "chat_template",
    "clean_up_tokenization_spaces", "added_tokens_decoder", "additional_special_tokens",
    "extra_special_tokens", "padding_side", "truncation_side", "model_input_names",
    "is_local", "local_files_only", "gguf_file",  # how transformers loaded it, nothing more
})  # fmt: skip
# the generic classes: a model-specific class (LlamaTokenizerFast, ...) may add behaviour
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


class UnsupportedTokenizer(ValueError):
    """The directory's tokenizer needs a transformers behaviour `FastTokenizer` does not have."""


class FastTokenizer:
    """The tokenizer of an HF directory holding tokenizer.json (see the module docstring).

    Raises (constructor):
        FileNotFoundError: the directory has no tokenizer.json.
        ValueError: tokenizer_config.json is not a JSON object.
        UnsupportedTokenizer: the directory needs a behaviour not reproduced here.
    """

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        self.backend = Tokenizer.from_file(path)
        config: dict[str, Any] = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} must hold a JSON object")
        self.special_tokens = {n: t for n in _SPECIAL_NAMES if (t := _token_text(config.get(n)))}
        unknown = sorted(set(config) - _KNOWN_CONFIG_KEYS)
        if unknown or config.get("tokenizer_class", "TokenizersBackend") not in _GENERIC_CLASSES:
            raise UnsupportedTokenizer(
                f"{directory}: tokenizer_config.json sets {unknown or config['tokenizer_class']}"
            )
        # transformers applies its word-piece clean-up (dropping spaces before punctuation) for
        # non-BPE models only; it is not reproduced here, so such a directory is refused
        if config.get("clean_up_tokenization_spaces") and not self._is_bpe():
            raise UnsupportedTokenizer(f"{directory}: clean_up_tokenization_spaces is set")
        self.chat_template = config.get("chat_template")
        template_path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                self.chat_template = f.read()

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Id of a token string (None if unknown), or the ids of a list of them."""
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        """Token string of an id (None if out of range), or the strings of a list of ids."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (BOS etc.)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (special tokens dropped when `skip_special_tokens`)."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _is_bpe(self) -> bool:
        from tokenizers import models

        return isinstance(self.backend.model, models.BPE)

    @cached_property
    def _template(self):
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)  # fmt: skip

        def strftime_now(fmt: str) -> str:
            return datetime.datetime.now().strftime(fmt)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered with the chat template (token ids when `tokenize`, without
        adding special tokens again); extra keyword arguments reach the template as variables.

        Raises:
            ValueError: the tokenizer has no chat template.
            jinja2.TemplateError: the template rejects the messages (`raise_exception`).
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
