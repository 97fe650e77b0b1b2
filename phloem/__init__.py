"""phloem: an LLM inference engine for large batches whose prompts share prefixes.

`import phloem` stays light (no torch): `LLM` and the outputs load on first use, so the pure
Python `phloem.core` imports without torch.
"""

from typing import TYPE_CHECKING, Any

from phloem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from phloem.engine.llm import LLM
    from phloem.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from phloem.engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        import phloem.outputs

        return getattr(phloem.outputs, name)
    raise AttributeError(f"module 'phloem' has no attribute {name!r}")
