"""SamplingParams.validate(): every field's type and range, including integer extremes and the
documented seed range, so that no value that passes can fail inside an engine step."""

from __future__ import annotations

import pytest

from phloem.sampling_params import MAX_N, SEED_MAX, SEED_MIN, SamplingParams


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, 2**63 - 1, 2**63, SEED_MAX])
def test_seed_range_accepts_int64_and_uint64(seed):
    params = SamplingParams(seed=seed)
    assert params.generator_seed() == seed % 2**64
    assert 0 <= params.generator_seed(5) < 2**64


@pytest.mark.parametrize("seed", [SEED_MAX + 1, 18446744073709551616, SEED_MIN - 1, 10**30])
def test_seed_outside_the_range_is_refused(seed):
    with pytest.raises(ValueError, match=r"^seed must be in \[-2\^63, 2\^64 - 1\]"):
        SamplingParams(seed=seed)


def test_child_seeds_wrap_modulo_2_64():
    """Sequence i of n uses (seed + i) mod 2^64: the largest seed's second child is seed 0."""
    params = SamplingParams(seed=SEED_MAX, n=3)
    assert [params.generator_seed(i) for i in range(3)] == [SEED_MAX, 0, 1]
    assert SamplingParams(seed=-1).generator_seed() == SEED_MAX  # as torch.Generator takes -1


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("skip_special_tokens", "no", "skip_special_tokens must be a boolean"),
        ("skip_special_tokens", 0, "skip_special_tokens must be a boolean"),
        ("ignore_eos", "yes", "ignore_eos must be a boolean"),
        ("stop", 5, "stop must be a string or a list of strings"),
        ("stop", {"a": 1}, "stop must be a string or a list of strings"),
        ("stop", ["ok", 3], "stop must be a list of non-empty strings"),
        ("stop_token_ids", "abc", "stop_token_ids must be a list of integers"),
        ("stop_token_ids", [2**64], "stop_token_ids must be non-negative integers"),
        ("stop_token_ids", [True], "stop_token_ids must be non-negative integers"),
        ("n", True, "n must be an integer"),
        ("n", 10**30, "n must be at most"),
        ("n", MAX_N + 1, f"n must be in \\[1, {MAX_N}\\]"),
        ("top_k", 2**70, "top_k must be at most"),
        ("max_tokens", 2**80, "max_tokens must be at most"),
        ("max_tokens", 1.5, "max_tokens must be an integer"),
        ("min_tokens", -(2**70), "min_tokens must be at most"),
        ("logprobs", "1", "logprobs must be an integer"),
        ("logprobs", 10**20, "logprobs must be at most"),
        ("temperature", 10**400, "temperature must be finite"),
        ("temperature", 10**5000, "temperature must be finite, got an integer of 16610 bits"),
        ("n", 10**5000, "n must be at most 9223372036854775807 in magnitude, got an integer"),
        ("seed", -(10**5000), "seed must be in .*got an integer of 16610 bits"),
        ("top_p", "0.5", "top_p must be a number"),
        ("repetition_penalty", float("nan"), "repetition_penalty must be finite"),
    ],
    ids=lambda v: "huge" if isinstance(v, int) and v.bit_length() > 256 else None,
)
def test_every_field_is_type_and_range_checked(field, value, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        SamplingParams(**{field: value})


def test_int_floats_become_floats_and_limits_hold():
    params = SamplingParams(temperature=2, top_p=1, n=MAX_N, top_k=2**63 - 1)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_from_dict_needs_a_dict():
    with pytest.raises(ValueError, match="sampling fields must be a dict"):
        SamplingParams.from_dict(["temperature", 0])  # type: ignore[arg-type]
