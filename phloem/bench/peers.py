"""In-run peers for `phloem bench --compare`: the same workload and weights through another engine.

`transformers`: transformers' own continuous batching (`model.generate_batch`), greedy, EOS off,
on a transformers model holding phloem's weights (`hf_state_dict` unfuses qkv and gate/up).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from phloem.bench.workloads import Workload


def hf_state_dict(model: nn.Module, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """phloem parameters under HF names: `qkv_proj` -> q/k/v_proj (rows [q | k | v]) and
    `gate_up_proj` -> gate/up_proj (rows [gate | up]); everything else keeps its name."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters(remove_duplicate=False):
        tensor = param.detach().to(device)
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".qkv_proj"):
            qkv = modules[owner]
            base = owner[: -len("qkv_proj")]
            q, k, v = tensor.split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=0)
            for part, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{base}{part}.{leaf}"] = t.clone()
        elif owner.endswith(".gate_up_proj"):
            base = owner[: -len("gate_up_proj")]
            gate, up = tensor.chunk(2, dim=0)
            out[f"{base}gate_proj.{leaf}"] = gate.clone()
            out[f"{base}up_proj.{leaf}"] = up.clone()
        else:
            out[name] = tensor
    return out


def build_hf_model(hf_config: Any, state: dict[str, torch.Tensor], dtype, device) -> nn.Module:
    """A transformers causal LM of `hf_config` holding `state` (strict: every weight filled)."""
    import transformers

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"weights do not match the transformers model: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    return model.eval()


def run_transformers_generate_batch(model: nn.Module, workload: Workload) -> dict:
    """Time `generate_batch` on the workload (one warm-up on two prompts first). Output lengths
    are the workload's maximum for every request (generate_batch takes one max_new_tokens), so
    tokens/s counts what it actually generated. Not under inference_mode: generate_batch runs
    its loop in a background thread, which must be able to update the tensors it creates.
    Raises RuntimeError when requests come back incomplete (failed requests)."""
    from transformers import GenerationConfig

    max_new = max(workload.output_lens)
    config = GenerationConfig(
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    prompts = workload.prompts
    model.generate_batch(inputs=prompts[:2], generation_config=config, progress_bar=False)
    _sync()
    start = time.perf_counter()
    if workload.sequential:
        results = {}
        for i, p in enumerate(prompts):
            for key, value in model.generate_batch(
                inputs=[p], generation_config=config, progress_bar=False
            ).items():
                results[f"{i}:{key}"] = value
    else:
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    _sync()
    elapsed = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in results.values())
    if len(results) != workload.num_requests or generated < len(results) * max_new:
        raise RuntimeError(
            f"generate_batch returned {len(results)} of {workload.num_requests} requests with "
            f"{generated} of {len(results) * max_new} tokens"
        )
    return {
        "name": "transformers",
        "method": "generate_batch (continuous batching)",
        "elapsed_s": elapsed,
        "num_requests": len(results),
        "output_tokens": generated,
        "total_tokens_per_s": (workload.num_input_tokens + generated) / elapsed,
        "output_tokens_per_s": generated / elapsed,
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
