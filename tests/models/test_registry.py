"""The architecture registry."""

import pytest

from phloem.models.llama import LlamaForCausalLM
from phloem.models.qwen3 import Qwen3ForCausalLM
from phloem.models.registry import get_model_class, supported_architectures


def test_known_architectures() -> None:
    assert get_model_class(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert get_model_class(["MistralForCausalLM"]) is LlamaForCausalLM
    assert get_model_class(["SomethingElse", "Qwen3ForCausalLM"]) is Qwen3ForCausalLM
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        supported_architectures()
    )


def test_unknown_architecture_message() -> None:
    with pytest.raises(ValueError) as info:
        get_model_class(["GPTNeoXForCausalLM"])
    message = str(info.value)
    assert "GPTNeoXForCausalLM" in message
    for arch in supported_architectures():
        assert arch in message
    with pytest.raises(ValueError, match="supported"):
        get_model_class(None)
