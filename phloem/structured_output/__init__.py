"""phloem.structured_output: constrained decoding (JSON schema, regex, choice, grammar) through a
grammar library behind one declared interface (`backend.GrammarBackend`), compiled once per
distinct constraint in a thread pool (`manager.StructuredOutputManager`), applied as a token
bitmask on the logits before sampling (`phloem.layers.sampler.apply_token_bitmask`).

Two backends implement the interface: llguidance (the default: it compiles a schema in about a
millisecond and fills a mask ~3x faster than xgrammar on sampled walks) and xgrammar (vLLM's
default; precomputes per-grammar token-mask caches, ~0.4 s a schema). The numbers:
benchmarks/results/2026-11-25-cpu-structured-outputs/. The library is imported only when a
request asks for a constraint."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

from phloem.config import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsConfig
from phloem.sampling_params import SamplingParams, StructuredOutputsParams
from phloem.structured_output.backend import GrammarBackend, TokenizerData

DEFAULT_BACKEND = StructuredOutputsConfig.backend
# (backend, constraint key) -> error message (None: compiles)
_VERDICTS: dict[tuple[str, tuple[str, str]], str | None] = {}
_MAX_VERDICTS = 4096


def validate_constraint(params: StructuredOutputsParams, backend: str = DEFAULT_BACKEND) -> None:
    """Check that the constraint compiles with `backend` (without a tokenizer), caching the
    verdict by constraint, so a batch under one schema checks it once.

    Raises:
        ValueError: naming the field (`structured_outputs.json`, ...) and the library's reason.
    """
    key = (backend, params.key())
    if key not in _VERDICTS:
        if len(_VERDICTS) >= _MAX_VERDICTS:
            _VERDICTS.clear()
        _VERDICTS[key] = _verdict(params, backend)
    error = _VERDICTS[key]
    if error is not None:
        raise ValueError(error)


def _verdict(params: StructuredOutputsParams, backend: str) -> str | None:
    try:
        backend_class(backend).validate(params)
    except ValueError as e:
        return str(e)
    return None


def validate_constraints(
    requests: Sequence[object], backend: str = DEFAULT_BACKEND, num_threads: int = 1
) -> None:
    """Check a batch's constraints ahead of their requests' `validate_constraint`: of the
    `SamplingParams` in `requests` (other items are skipped), the distinct constraints without a
    verdict are checked on `num_threads` threads (llguidance's check releases the GIL) and their
    verdicts cached. One after the other on the engine loop, a batch of 1,024 distinct schemas
    cost ~0.4 ms each (benchmarks/results/2026-11-26d-cpu-structured-distinct). Raises nothing:
    a bad constraint raises from its request's `validate_constraint`."""
    constraints = [r.structured_outputs for r in requests if isinstance(r, SamplingParams)]
    todo: dict[tuple[str, tuple[str, str]], StructuredOutputsParams] = {}
    for params in constraints:
        if params is None:
            continue
        key = (backend, params.key())
        if key not in _VERDICTS:
            todo.setdefault(key, params)
    if len(todo) < 2 or num_threads < 2:
        return  # `validate_constraint` checks them as they come
    with concurrent.futures.ThreadPoolExecutor(num_threads, "phloem-validate") as pool:
        verdicts = list(pool.map(_verdict, todo.values(), [backend] * len(todo)))
    if len(_VERDICTS) + len(todo) > _MAX_VERDICTS:
        _VERDICTS.clear()
    _VERDICTS.update(zip(todo, verdicts))


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


def backend_class(name: str) -> type[GrammarBackend]:
    """The backend class called `name` (imported lazily).

    Raises:
        ValueError: an unknown name (the known ones are `config.STRUCTURED_OUTPUT_BACKENDS`).
    """
    if name == "llguidance":
        from phloem.structured_output.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend
    if name == "xgrammar":
        from phloem.structured_output.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    raise ValueError(
        f"structured-output backend must be one of {STRUCTURED_OUTPUT_BACKENDS}, got {name!r}"
    )


def make_backend(
    data: TokenizerData, num_threads: int = 1, name: str = DEFAULT_BACKEND
) -> GrammarBackend:
    """The grammar backend `name` over `data`'s tokenizer, filling masks on `num_threads`."""
    return backend_class(name)(data, num_threads=num_threads)  # type: ignore[call-arg]
