"""Llama (and Mistral-style GQA checkpoints): the HF `LlamaForCausalLM` architecture on phloem layers.

Forward works on the step's packed tokens (no batch dimension): input_ids [T] and positions [T] in,
hidden [T, hidden_size] out; attention reads the paged KV cache from the forward context.
`load_weights` takes HF parameter names and fuses q/k/v and gate/up through each parameter's
`weight_loader`. Qwen2 and Qwen3 reuse these blocks (see qwen2.py, qwen3.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from phloem.distributed.parallel_state import tp_defers_all_reduce_to_norms
from phloem.layers.activation import SiluAndMul
from phloem.layers.attention import Attention, kv_scale_targets
from phloem.layers.embedding import LMHead, VocabEmbedding
from phloem.layers.linear import (
    MergedColumnLinear,
    QKVLinear,
    RowParallelLinear,
    default_weight_loader,
)
from phloem.layers.norm import RMSNorm
from phloem.layers.rotary import RotaryEmbedding, rope_parameters_from_hf

logger = logging.getLogger(__name__)

# (fused parameter, HF checkpoint part, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


def fused_param_name(name: str) -> tuple[str, str | int | None]:
    """HF checkpoint name -> (phloem parameter name, shard id or None), e.g.
    "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight", "k")."""
    for fused, part, shard_id in STACKED_PARAMS:
        if part in name:
            return name.replace(part, fused), shard_id
    return name, None


def head_dim_of(hf_config: Any) -> int:
    """`head_dim` from the config when set (Mistral/Qwen3 style), else hidden_size / num_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def reject_sliding_window(hf_config: Any) -> None:
    """Raise NotImplementedError if any layer uses sliding-window attention (not supported yet)."""
    layer_types = getattr(hf_config, "layer_types", None) or []
    if "sliding_attention" in layer_types or getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention layers are not supported yet")
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < getattr(hf_config, "max_position_embeddings", 0):
        logger.warning(
            "config has sliding_window=%s; phloem attends to the full context, so outputs differ "
            "from the reference beyond %s tokens",
            window,
            window,
        )


def build_rotary(hf_config: Any) -> RotaryEmbedding:
    """The model's RoPE module (from `rope_parameters`, honouring `partial_rotary_factor`)."""
    head_dim = head_dim_of(hf_config)
    rope = rope_parameters_from_hf(hf_config)
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(head_dim, rotary_dim, hf_config.max_position_embeddings, rope)


class LlamaAttention(nn.Module):
    """qkv_proj -> (optional per-head q/k RMSNorm) -> RoPE -> paged attention -> o_proj."""

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.head_dim = head_dim_of(hf_config)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVLinear(hidden, self.head_dim, num_heads, num_kv_heads, qkv_bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, o_bias, dtype)
        self.rotary_emb = rotary_emb  # shared by all layers (one cos/sin table per model)
        if qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            layer_idx,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions int64 [T], hidden [T, hidden_size] -> [T, hidden_size]."""
        return self.post_attention(self.attn.attend(self.pre_attention(positions, hidden)))

    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The part before the backend call: QKV projection, q/k norms, RoPE and the KV write
        (`Attention.store_kv`; mutates the layer's cache). positions int64 [T], hidden
        [T, hidden_size] (or its `Fp8Activation`) -> rotated q [T, num_heads, head_dim]."""
        return self.pre_attention_qkv(positions, self.qkv_proj(hidden))

    def pre_attention_qkv(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """`pre_attention` after the QKV projection: qkv [T, q_size + 2 * kv_size] -> rotated q
        [T, num_heads, head_dim] (the q/k norms, RoPE and the KV write)."""
        q, k, v = self.qkv_proj.split(qkv)
        if self.q_norm is not None and self.k_norm is not None:
            num_tokens = q.shape[0]
            q = self.q_norm(q.reshape(num_tokens, -1, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, -1, self.head_dim))
        return self.attn.store_kv(q, k, v, positions, self.rotary_emb)

    def pre_attention_fused(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rotated q [T, num_heads, head_dim], residual stream) with RoPE and the KV write run
        as the QKV GEMM's epilogue (`QKVLinear.forward_rope_kv`; `norm` the input norm, fused
        too where it fuses), or None, with nothing run, where that path does not take the step
        (PHLOEM_FUSED_QKV_ROPE off, prefill-sized steps, q/k norms: the caller runs the
        projection, then `pre_attention_qkv`)."""
        if self.q_norm is not None or self.k_norm is not None:
            return None
        rope = self.attn.rope_kv_args(positions, self.rotary_emb)
        if rope is None:
            return None
        return self.qkv_proj.forward_rope_kv(hidden, residual, norm, rope)

    def post_attention(self, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [T, num_heads, head_dim] -> [T, hidden_size] (its
        tensor-parallel all-reduce included)."""
        return self.o_proj(attn_out.reshape(attn_out.shape[0], -1))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up fused; where the down projection's kernel takes
    [gate | up] itself (decode-sized calls of the skinny GEMM), SiLU-and-mul runs inside it
    (`RowParallelLinear.forward_silu_and_mul`)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden, [intermediate, intermediate], bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_silu_and_mul(self.gate_up_proj(x), self.act_fn)

    def forward_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), the norm fused into gate_up's GEMM where
        that kernel takes it (`LinearBase.forward_rms_norm`)."""
        gate_up, residual = self.gate_up_proj.forward_rms_norm(x, residual, norm)
        return self.down_proj.forward_silu_and_mul(gate_up, self.act_fn), residual


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the following RMSNorm, and at decode sizes
    both into the GEMM that reads the norm (qkv, gate_up: `LinearBase.forward_rms_norm`)."""

    def __init__(self, hf_config: Any, layer_idx: int, dtype: torch.dtype, **attn_kwargs: Any):
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"hidden_act {hf_config.hidden_act!r}; only 'silu' is supported"
            )
        self.self_attn = LlamaAttention(hf_config, layer_idx, dtype, **attn_kwargs)
        self.mlp = LlamaMLP(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            getattr(hf_config, "mlp_bias", False),
            dtype,
        )
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); their sum is the layer's HF output."""
        q, residual = self.pre_attention(positions, hidden, residual)
        return self.post_attention(self.self_attn.attn.attend(q), residual)

    def pre_attention(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (with the residual add when `residual` is given) and the attention's part
        before the backend call (`LlamaAttention.pre_attention`: writes this layer's K/V).
        Returns (rotated q [T, num_heads, head_dim], residual stream [T, hidden_size])."""
        fused = self.self_attn.pre_attention_fused(positions, hidden, residual,
                                                   self.input_layernorm)  # fmt: skip
        if fused is not None:
            return fused
        qkv_proj = self.self_attn.qkv_proj  # the norm fused into its GEMM where it takes it
        qkv, residual = qkv_proj.forward_rms_norm(hidden, residual, self.input_layernorm)
        return self.self_attn.pre_attention_qkv(positions, qkv), residual

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj of the attention output [T, num_heads, head_dim], the post-attention norm
        (+ residual) and the MLP. Returns (mlp output, residual stream), as `forward`."""
        hidden = self.self_attn.post_attention(attn_out)
        return self.mlp.forward_rms_norm(hidden, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, **attn_kwargs: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
        rotary_emb = build_rotary(hf_config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, i, dtype, rotary_emb=rotary_emb, **attn_kwargs)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        if tp_defers_all_reduce_to_norms():
            self.defer_all_reduces_to_norms()

    def defer_all_reduces_to_norms(self) -> None:
        """Leave each row-parallel layer's all-reduce (o_proj, down_proj) to the RMSNorm that
        consumes its output: the post-attention norm, the next layer's input norm, the final
        norm. That norm then sums, adds the residual and normalizes, in one kernel where the
        group has it (`phloem.distributed.fused_norm_all_reduce`, `symm_norm_all_reduce`). A
        layer with a bias keeps its all-reduce (its bias must be added once, after the sum).
        The norms after o_proj take buffer slot 0, those after down_proj slot 1, so consecutive
        fused calls alternate slots. Mutates the layers."""
        consumers = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, consumers):
            for slot, (producer, norm) in enumerate((
                (layer.self_attn.o_proj, layer.post_attention_layernorm),
                (layer.mlp.down_proj, next_norm),
            )):  # fmt: skip
                if producer.bias is None:
                    producer.defers_all_reduce = norm.reduces_input = True
                    norm.reduce_slot = slot

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The pieces in order, each layer's backend call between two of them (one code path
        with `phloem.worker.piecewise_graph`, which captures the pieces in CUDA graphs)."""
        q, residual = self.first_piece(input_ids, positions)
        last = len(self.layers) - 1
        for i in range(len(self.layers)):
            attn_out = self.attention(i).attend(q)
            if i < last:
                q, residual = self.middle_piece(i + 1, positions, attn_out, residual)
        return self.last_piece(attn_out, residual)

    # -- the pieces between attention backend calls (`LlamaForCausalLM.pieces`) -------------

    def attention(self, layer_idx: int) -> Attention:
        """Layer layer_idx's `Attention`, whose `attend` runs between two pieces."""
        return self.layers[layer_idx].self_attn.attn

    def first_piece(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, then layer 0 up to its backend call. Returns (q, residual)."""
        return self.layers[0].pre_attention(positions, self.embed_tokens(input_ids), None)

    def middle_piece(
        self,
        layer_idx: int,
        positions: torch.Tensor,
        attn_out: torch.Tensor,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx - 1 after its backend call, then layer layer_idx up to its own.
        Returns (q, residual)."""
        hidden, residual = self.layers[layer_idx - 1].post_attention(attn_out, residual)
        return self.layers[layer_idx].pre_attention(positions, hidden, residual)

    def last_piece(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer after its backend call, then the final norm: hidden [T, hidden_size]."""
        hidden, residual = self.layers[-1].post_attention(attn_out, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """HF `LlamaForCausalLM` / `MistralForCausalLM` on packed tokens and a paged KV cache.

    Args:
        hf_config: a transformers config of the Llama family (honours head_dim, attention_bias,
            mlp_bias, tie_word_embeddings, rope_parameters default/linear/llama3).
        dtype: parameter dtype.
    Attributes:
        num_layers, num_kv_heads (per TP rank), head_dim: what the KV cache needs.
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        reject_sliding_window(hf_config)
        self.config = hf_config
        self.dtype = dtype
        self.model = LlamaModel(hf_config, dtype, **self.attention_kwargs(hf_config))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        first_attn = self.model.layers[0].self_attn
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = first_attn.qkv_proj.num_kv_heads
        self.head_dim = first_attn.head_dim

    def attention_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """Keyword arguments of `LlamaAttention` beyond the config (subclasses override)."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states of the step's packed tokens.

        Args:
            input_ids: int64 [T]; positions: int64 [T] (absolute position of each token).
        Returns:
            [T, hidden_size] in the model dtype (after the final norm).
        Raises:
            RuntimeError: outside `with forward_context(...)`.
        """
        return self.model(input_ids, positions)

    def pieces(self) -> LlamaModel:
        """The forward pass split at each layer's attention backend call (the contract of
        `phloem.worker.piecewise_graph.PiecewiseModel`): `first_piece(input_ids, positions)`,
        `middle_piece(i, positions, attn_out, residual)` for layers 1..L-1 and
        `last_piece(attn_out, residual)` are graph-safe (KV writes at the context's slots, no
        host sync); `attention(i).attend(q, out)` between them is the backend's. `forward`
        runs the same pieces, so both paths compute the same."""
        return self.model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits float32 [N, vocab_size]."""
        return self.lm_head(hidden)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        """Load HF-named tensors (e.g. "model.layers.0.self_attn.q_proj.weight").

        Separate q/k/v and gate/up tensors are fused by shard id; rotary `inv_freq` buffers are
        ignored, and so is `lm_head.weight` when embeddings are tied. FP8 KV-cache scales
        (`self_attn.k_scale`, ...: `phloem.layers.attention.kv_scale_targets`) go to the
        layer's `Attention.load_kv_scale`.

        Returns:
            the names of this model's parameters that were filled.
        Raises:
            ValueError: for an unknown name or a shape mismatch; with `strict`, also when some
                parameter received no tensor.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        shards: dict[str, set[str | int]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            kv_scale = kv_scale_targets(name)
            if kv_scale is not None:
                self.get_submodule(kv_scale[0]).load_kv_scale(kv_scale[1], tensor, name)
                continue
            target, shard_id = fused_param_name(name)
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"{type(self).__name__} has no parameter for checkpoint tensor {name!r}"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard_id)
            if shard_id is None:
                loaded.add(target)
            else:
                shards.setdefault(target, set()).add(shard_id)
        for target, got in shards.items():
            want = {s for fused, _, s in STACKED_PARAMS if fused in target}
            if got == want:
                loaded.add(target)
        if self.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if strict and missing:
            raise ValueError(f"{type(self).__name__}: checkpoint lacks parameters {missing}")
        return loaded
