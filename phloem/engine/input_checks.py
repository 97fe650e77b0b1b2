"""What a request must satisfy before it reaches a model, as plain functions: every front (the
in-process `LLMEngine`, the data-parallel parent, the server's engine-core client) raises the
same ValueError, naming the field and the limit, without needing an engine."""

from __future__ import annotations

from phloem.sampling_params import SamplingParams


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError naming the limit when a prompt cannot run: empty, not shorter than
    `max_model_len` tokens (one position must stay for the output), or holding ids outside
    [0, vocab_size)."""
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens but max_model_len is "
            f"{max_model_len}: at most {max_model_len - 1} prompt tokens fit"
        )
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        raise ValueError(
            f"prompt_token_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )


def check_params(sampling_params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError naming the field and the limit when sampling parameters that passed
    `SamplingParams.validate()` exceed what the model can do (stop_token_ids outside the
    vocabulary), or whose structured-output constraint does not compile (an unsupported schema
    feature, a bad regex or grammar: `phloem.structured_output.validate_constraint`, the message
    names `structured_outputs.<field>`)."""
    bad = [t for t in sampling_params.stop_token_ids or () if t >= vocab_size]
    if bad:
        raise ValueError(
            f"stop_token_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    if sampling_params.structured_outputs is not None:
        from phloem.structured_output import validate_constraint

        validate_constraint(sampling_params.structured_outputs)
