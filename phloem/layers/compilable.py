"""The seam through which an elementwise layer runs compiled: `Compilable`.

A layer's math is its `compute` method; `forward` calls it, or the compiled version of it when
one was handed over with `use_compiled` (worker/fusion.py compiles `compute` once per layer
class and gives every instance the same function, the instance being its first argument).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class Compilable(nn.Module):
    """An `nn.Module` whose `forward` is `compute`, or a compiled `compute` once
    `use_compiled(fn)` was called (fn(self, *args) must equal self.compute(*args))."""

    def __init__(self) -> None:
        super().__init__()
        self._compiled: Callable[..., Any] | None = None

    def compute(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def use_compiled(self, fn: Callable[..., Any]) -> None:
        """Run `fn(self, ...)` instead of `self.compute(...)` from now on."""
        self._compiled = fn

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._compiled
        if fn is None:
            return self.compute(*args, **kwargs)
        return fn(self, *args, **kwargs)
