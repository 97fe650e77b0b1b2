"""Test-only fault injection through the engine's executor factory (`LLMEngine(config,
executor_factory=FaultExecutor)`), so production code carries no fault hooks.

`FaultExecutor` is the default executor over a worker whose model misbehaves on two marker
tokens, through a PyTorch forward hook on its token embedding (the input side only: a model with
tied embeddings keeps its LM head intact):

- `NAN_TOKEN` in a step's input: that token's embedding comes out NaN, so its request's hidden
  states, KV and logits turn NaN in its own rows only; the sampler flags the rows and the engine
  fails that request alone (`NON_FINITE_MESSAGE`) while the batch goes on: the real NaN path.
- `DIE_TOKEN` in a step's input: the forward pass raises, so `LLMEngine.step()` raises (a fault
  of the whole step: the engine loop dies).

A request is marked by putting the token in its prompt (e.g. a completions `prompt` given as
token ids). Hooks do not run inside CUDA-graph replays: CPU (eager) engines only.
"""

from __future__ import annotations

import torch

from phloem.engine.executor import UniProcExecutor

# Special tokens of the embedded SmolLM2 vocabulary that text prompts never tokenize to and
# greedy outputs of the tests never contain: <jupyter_script> and <empty_output>.
DIE_TOKEN = 15
NAN_TOKEN = 16
DIE_MESSAGE = "injected engine fault"


def _inject(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of the embedding: `args[0]` the step's input ids [tokens], `output` their
    embeddings [tokens, hidden]."""
    input_ids = args[0]
    if bool((input_ids == DIE_TOKEN).any()):
        raise RuntimeError(DIE_MESSAGE)
    poisoned = input_ids == NAN_TOKEN
    if bool(poisoned.any()):
        return output.masked_fill(poisoned.unsqueeze(-1), float("nan"))
    return output


class FaultExecutor(UniProcExecutor):
    """The default executor; its worker's model injects the marker tokens' faults."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        worker.model.model.embed_tokens.register_forward_hook(_inject)
