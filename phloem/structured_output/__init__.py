"""phloem.structured_output: constrained decoding (JSON schema, regex, choice, grammar) through a
grammar library behind one declared interface (`backend.GrammarBackend`), compiled once per
distinct constraint in a thread pool (`manager.StructuredOutputManager`), applied as a token
bitmask on the logits before sampling (`phloem.layers.sampler.apply_token_bitmask`).

The library is imported only when a request asks for a constraint."""

from __future__ import annotations

from phloem.sampling_params import StructuredOutputsParams
from phloem.structured_output.backend import GrammarBackend, TokenizerData

_VERDICTS: dict[tuple[str, str], str | None] = {}  # constraint key -> error message (None: ok)
_MAX_VERDICTS = 4096


def validate_constraint(params: StructuredOutputsParams) -> None:
    """Check that the constraint compiles (without a tokenizer), caching the verdict by
    constraint, so a batch under one schema checks it once.

    Raises:
        ValueError: naming the field (`structured_outputs.json`, ...) and the library's reason.
    """
    from phloem.structured_output.xgrammar_backend import XGrammarBackend

    key = params.key()
    if key not in _VERDICTS:
        if len(_VERDICTS) >= _MAX_VERDICTS:
            _VERDICTS.clear()
        try:
            XGrammarBackend.validate(params)
            _VERDICTS[key] = None
        except ValueError as e:
            _VERDICTS[key] = str(e)
    error = _VERDICTS[key]
    if error is not None:
        raise ValueError(error)


def tokenizer_data(tokenizer, vocab_size: int, eos_token_id: int | None) -> TokenizerData:
    """What a backend needs of the engine's tokenizer: a transformers `PreTrainedTokenizerFast`
    (phloem's own `FastTokenizer` is wrapped around its `tokenizers` backend), the logits'
    width and the stop ids (EOS)."""
    from transformers import PreTrainedTokenizerFast

    from phloem.tokenizer import FastTokenizer

    if isinstance(tokenizer, FastTokenizer):
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    stop = () if eos_token_id is None else (eos_token_id,)
    return TokenizerData(tokenizer, vocab_size, stop)


def make_backend(data: TokenizerData, num_threads: int = 1) -> GrammarBackend:
    """The grammar backend phloem uses (xgrammar) over `data`'s tokenizer."""
    from phloem.structured_output.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(data, num_threads=num_threads)
