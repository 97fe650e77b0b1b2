"""FP8 KV-cache scales calibrated at load (`CacheConfig.kv_cache_scales="calibrate"`).

An FP8 cache stores k / k_scale and v / v_scale in e4m3 with one scale per layer
(`phloem.layers.attention`). Without checkpoint scales they are 1.0. Calibration runs the model
once over a fixed text, reads each layer's K (after RoPE) and V back from a cache in the model
dtype, and sets k_scale = margin * amax(|K|) / 448 (likewise V; margin 4): the layer's largest
value then lands `margin` times below e4m3's largest finite value, so K or V beyond 448 do not
clamp and small values keep more of e4m3's normal range (2^-6 to 448). On the embedded model it
measured level with scale 1.0 (its K and V sit inside that range; e4m3's 3 mantissa bits, not
the scale, set the error): it is for models whose K or V reach past 448 without checkpoint
scales.

The scales are Python floats that CUDA-graph captures bake in, so this runs once, before any
capture, and never again. It is deterministic: the same built-in paragraph (tokenized by the
model's tokenizer), or with no tokenizer the same seeded random tokens, gives the same scales.
Layers whose scales came from the checkpoint keep them (`Attention.kv_scale_source`).
Per tensor, not per KV head: every reader of the cache (the reference, phloem's Triton kernels,
FlashInfer's `k_scale` / `v_scale`) takes one scale per layer. Under tensor parallelism each
rank calibrates its own KV heads (its own cache; every rank runs the forward pass together).
"""

from __future__ import annotations

import logging

import torch

from phloem.forward_context import ForwardContext, forward_context
from phloem.layers.attention import Attention
from phloem.ops.attention import AttentionMetadata
from phloem.ops.attention.reference import ReferenceAttention
from phloem.ops.kv_store import FP8_MAX, check_kv_scale

logger = logging.getLogger(__name__)

# Written for phloem: plain English prose, unrelated to any benchmark text.
CALIBRATION_TEXT = (
    "The river rises in the hills above the town and runs for some forty miles before it "
    "reaches the sea. In spring the water is high and brown with the snow that melts on the "
    "slopes; by late summer it has fallen so far that children wade across the shallows near "
    "the old mill. The mill itself has not turned for a century. Its stones were carried away "
    "to build a wall around the churchyard, and the wheel rotted where it stood until a storm "
    "brought it down. People in the town still argue about who owned the land. Some say the "
    "miller's family sold it to the railway company when the line was built, others that it "
    "was never sold at all and belongs to whoever can prove a claim. The records burned in a "
    "fire at the council offices, so the question is unlikely to be settled. Meanwhile the "
    "field beside the river is used for the summer fair, when tents go up along the bank, a "
    "brass band plays in the afternoon, and the evening ends with a race of small wooden boats "
    "that the children paint themselves. Most of the boats sink or drift into the reeds, but "
    "every year one or two reach the bridge, and their owners are cheered as if they had "
    "crossed an ocean. Visitors often ask why such a quiet place keeps so many traditions. The "
    "answer, according to the oldest residents, is simply that nobody has thought of a good "
    "reason to stop."
)
NUM_CALIBRATION_TOKENS = 256  # tokens of the forward pass (the text, or random ids)
# k_scale = margin * amax / 448: 4x headroom, as later text can exceed the calibration's amax
# (margin 1 clamped and measured worse; benchmarks/results/2026-11-27f-cpu-fp8-kv-scales)
DEFAULT_MARGIN = 4.0


def calibration_token_ids(tokenizer, vocab_size: int, num_tokens: int = NUM_CALIBRATION_TOKENS):
    """The calibration pass's token ids: `CALIBRATION_TEXT` encoded by `tokenizer` (cut to
    `num_tokens`), or with `tokenizer` None (or one whose ids reach `vocab_size`) `num_tokens` ids drawn uniformly from [0, vocab_size)
    by a generator seeded with 0 (deterministic, but not text: activations of random tokens are
    not those of prose, so a tokenizer is preferred)."""
    if tokenizer is not None:
        ids = list(tokenizer.encode(CALIBRATION_TEXT))[:num_tokens]
        if ids and max(ids) < vocab_size:
            return ids
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()


@torch.no_grad()
def observe_kv(model, token_ids: list[int], block_size: int = 16) -> list[torch.Tensor]:
    """One forward pass of `model` over `token_ids` (one sequence, plain torch attention, a
    cache in the model dtype on the model's device). Returns, per attention layer in
    `layer_idx` order, its cached K and V as float32 [2, len(token_ids), num_kv_heads, head_dim]
    (K after RoPE: what an FP8 cache would store). Mutates nothing of the model."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
    )
    param = next(model.parameters())
    n, device = len(token_ids), param.device
    num_blocks = -(-n // block_size)
    caches = [
        torch.zeros(num_blocks, 2, block_size, a.num_kv_heads, a.head_dim, dtype=param.dtype,
                    device=device)
        for a in layers
    ]  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).reshape(1, -1),
        block_size=block_size,
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    ctx = ForwardContext(attn_metadata=meta, kv_caches=caches, backend=ReferenceAttention(),
                         valid_slots=True)  # fmt: skip
    with forward_context(ctx):
        model(torch.tensor(token_ids, device=device), torch.arange(n, device=device))
    return [c.transpose(0, 1).flatten(1, 2)[:, :n].float() for c in caches]


def calibrate_kv_scales(model, token_ids: list[int], margin: float = DEFAULT_MARGIN) -> int:
    """Set each attention layer's `k_scale` / `v_scale` to margin * amax / 448 of its K / V
    over one pass on `token_ids` (`observe_kv`), except layers whose scales came from the
    checkpoint; marks the set ones `kv_scale_source = "calibrated"` (mutates the model).
    Returns how many layers it set.

    Raises:
        ValueError: if `margin` is not a finite number > 0, or a layer's K or V is all zeros
            or not finite (no usable scale: naming the layer).
    """
    check_kv_scale("kv_cache_scales margin", margin)
    layers = {m.layer_idx: m for m in model.modules() if isinstance(m, Attention)}
    if all(a.kv_scale_source == "checkpoint" for a in layers.values()):
        return 0  # nothing to calibrate: skip the forward pass
    observed = observe_kv(model, token_ids)
    num_set = 0
    for idx, kv in enumerate(observed):
        layer = layers[idx]
        if layer.kv_scale_source == "checkpoint":
            continue
        amax_k, amax_v = (float(x.abs().amax()) for x in kv)
        layer.k_scale = check_kv_scale(f"layer {idx} k_scale", margin * amax_k / FP8_MAX)
        layer.v_scale = check_kv_scale(f"layer {idx} v_scale", margin * amax_v / FP8_MAX)
        layer.kv_scale_source = "calibrated"
        num_set += 1
    return num_set


def calibrate_at_load(model, source, vocab_size: int) -> int:
    """`calibrate_kv_scales` at engine start (`kv_cache_scales="calibrate"`, an FP8 cache):
    on `CALIBRATION_TEXT` tokenized by `source`'s tokenizer, or on seeded random tokens when it
    has none that loads (logged; ids below `vocab_size`). Returns how many layers it set."""
    from phloem.models.loader import load_tokenizer

    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError) as err:  # no tokenizer files, or none transformers can build
        logger.warning("FP8 KV calibration: no tokenizer (%s); calibrating on random tokens", err)
        tokenizer = None
    token_ids = calibration_token_ids(tokenizer, vocab_size)
    num_set = calibrate_kv_scales(model, token_ids)
    logger.info("FP8 KV calibration: %d layers from %d tokens (%s)", num_set, len(token_ids),
                "built-in paragraph" if tokenizer is not None else "random ids")  # fmt: skip
    return num_set
