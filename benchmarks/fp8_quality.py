"""Quality of FP8 W8A8 (`quantization="fp8"`) and of the FP8 KV cache (`kv_cache_dtype="fp8"`) on
the embedded SmolLM2-135M, teacher-forced: the dense model and each FP8 variant read the same
held-out English text in one forward pass; reported are the top-1 agreement of their next-token
predictions, both perplexities (issue 18's bar: agreement >= 0.97 and perplexity within 2% over
~2,000 tokens), the mean KL divergence from the dense model, and the agreement over the positions
where the dense model's top two logits are at least 1 apart (not near-ties). `--xqa` measures the
KV cache alone: stored in bfloat16, in FP8 read with 16-bit math (the default GPU path), and in
FP8 with the rounding of FlashInfer's XQA decode kernel (`XqaEmulatedAttention`: the query and
the softmax weights rounded to e4m3, PHLOEM_FP8_DECODE_KERNEL=xqa), each with dense float32
weights.

Text: prose from the Python reference documentation shipped with CPython (`pydoc_data.topics`,
code blocks dropped): English the model was not tuned on, present wherever Python is.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/fp8_quality.py [--num-tokens 2000] [--xqa] \
        [--kv-scales 4,2,1,0.5]

`--kv-scales MARGINS` measures the KV cache alone with calibrated scales
(`phloem.worker.kv_calibration`, margin x amax / 448 per layer) beside bf16 and scale 1.0, and
per layer the K/V statistics behind them (`measure_scales`).

writes benchmarks/results/<date>-cpu-fp8-quality/quality.json (top level: W8A8; "fp8_kv",
"w8a8_fp8_kv", "bf16": the other variants; with --xqa only "bf16_kv", "fp8_kv", "fp8_kv_xqa";
with --kv-scales the keys `measure_scales` names).
tests/quantization/test_fp8_quality.py runs the same measurement on 256 tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

TOPICS = ("execmodel", "import", "comparisons", "customization", "assignment")


def held_out_text() -> str:
    """Prose paragraphs of CPython's reference documentation (indented code blocks dropped)."""
    from pydoc_data.topics import topics

    lines = []
    for name in TOPICS:
        lines += [ln for ln in topics[name].splitlines() if ln and not ln.startswith("   ")]
    return "\n".join(lines)


def load_embedded(quantization: str | None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of the embedded model on the CPU, dense or with `quantization`."""
    from phloem.config import ModelConfig
    from phloem.models.loader import (
        load_hf_config,
        load_model,
        load_tokenizer,
        resolve_model,
        startup_source,
    )

    source = startup_source(resolve_model(None), ModelConfig(dtype="float32", device="cpu"))
    hf_config = load_hf_config(source)
    model = load_model(source, hf_config, dtype, "cpu", quantization=quantization)
    return model, load_tokenizer(source)


KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}  # besides "auto"


@torch.no_grad()
def logits_of(
    model,
    token_ids: list[int],
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    xqa: bool = False,
) -> torch.Tensor:
    """float32 [len(token_ids), vocab] logits of one sequence read in one forward pass (plain
    torch paged attention, blocks 0, 1, ... in order; the KV cache in the model dtype, in
    bfloat16, or FP8 e4m3 with each layer's k_scale / v_scale for `kv_cache_dtype="fp8"`;
    `xqa`: an FP8 cache read with XQA's rounding, `XqaEmulatedAttention`)."""
    from phloem.forward_context import ForwardContext, forward_context
    from phloem.ops.attention import AttentionMetadata
    from phloem.ops.attention.reference import ReferenceAttention, XqaEmulatedAttention

    n = len(token_ids)
    num_blocks = -(-n // block_size)
    dtype = KV_DTYPES.get(kv_cache_dtype, model.lm_head.weight.dtype)
    shape = (num_blocks, 2, block_size, model.num_kv_heads, model.head_dim)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).reshape(1, -1),
        block_size=block_size,
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    backend = XqaEmulatedAttention() if xqa else ReferenceAttention()
    ctx = ForwardContext(attn_metadata=meta, kv_caches=caches, backend=backend)
    with forward_context(ctx):
        hidden = model(torch.tensor(token_ids), torch.arange(n))
    return model.compute_logits(hidden).float()


def compare(dense_logits: torch.Tensor, fp8_logits: torch.Tensor, token_ids: list[int]) -> dict:
    """Top-1 agreement of the predictions of positions 0..n-2, and each model's perplexity of
    tokens 1..n-1."""
    targets = torch.tensor(token_ids[1:])
    top2 = dense_logits[:-1].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= 1.0  # the dense model's top-1 is not a near-tie
    logp_dense = torch.log_softmax(dense_logits[:-1].double(), dim=-1)
    logp_fp8 = torch.log_softmax(fp8_logits[:-1].double(), dim=-1)
    kl = float((logp_dense.exp() * (logp_dense - logp_fp8)).sum(-1).mean())

    def perplexity(logits: torch.Tensor) -> float:
        logp = torch.log_softmax(logits[:-1], dim=-1)
        return float(torch.exp(-logp.gather(1, targets[:, None]).mean()))

    same = dense_logits[:-1].argmax(-1) == fp8_logits[:-1].argmax(-1)
    ppl_dense, ppl_fp8 = perplexity(dense_logits), perplexity(fp8_logits)
    return {
        "num_tokens": len(token_ids),
        "top1_agreement": float(same.float().mean()),
        "top1_agreement_margin_ge_1": float(same[clear].float().mean()),
        "positions_margin_ge_1": int(clear.sum()),
        "kl_divergence": kl,
        "perplexity_dense": ppl_dense,
        "perplexity_fp8": ppl_fp8,
        "perplexity_ratio": ppl_fp8 / ppl_dense,
    }


def measure(
    num_tokens: int, bf16_context: bool = False, fp8_kv: bool = False, xqa: bool = False
) -> dict:
    """`compare` of the dense and FP8 W8A8 embedded model (float32) on the first `num_tokens`
    tokens of `held_out_text()`. With `fp8_kv`, also the FP8 KV cache alone (dense weights,
    under "fp8_kv") and on top of W8A8 ("w8a8_fp8_kv"); with `bf16_context`, also the dense
    model run in bfloat16 (how far a 7-bit mantissa alone moves the same metrics: FP8 e4m3 has
    3), under "bf16"; with `xqa` (and `fp8_kv`), also the FP8 KV cache alone read with XQA's
    rounding, under "fp8_kv_xqa"."""
    dense, tokenizer = load_embedded(None)
    token_ids = tokenizer.encode(held_out_text())[:num_tokens]
    dense_logits = logits_of(dense, token_ids)
    extra = {}
    if fp8_kv:
        extra["fp8_kv"] = compare(dense_logits, logits_of(dense, token_ids, 16, "fp8"), token_ids)
    if fp8_kv and xqa:
        xqa_logits = logits_of(dense, token_ids, 16, "fp8", xqa=True)
        extra["fp8_kv_xqa"] = compare(dense_logits, xqa_logits, token_ids)
    del dense
    fp8, _ = load_embedded("fp8")
    result = compare(dense_logits, logits_of(fp8, token_ids), token_ids)
    if fp8_kv:
        both = logits_of(fp8, token_ids, 16, "fp8")
        extra["w8a8_fp8_kv"] = compare(dense_logits, both, token_ids)
    del fp8
    if bf16_context:
        bf16, _ = load_embedded(None, torch.bfloat16)
        extra["bf16"] = compare(dense_logits, logits_of(bf16, token_ids), token_ids)
    return {**result, **extra}


def measure_kv(num_tokens: int) -> dict:
    """The KV cache's share alone (dense float32 weights, `compare` against the float32
    cache) on the first `num_tokens` tokens of `held_out_text()`: "bf16_kv" (a bfloat16
    cache), "fp8_kv" (e4m3, 16-bit math) and "fp8_kv_xqa" (e4m3, XQA's rounding)."""
    dense, tokenizer = load_embedded(None)
    token_ids = tokenizer.encode(held_out_text())[:num_tokens]
    dense_logits = logits_of(dense, token_ids)
    runs = {"bf16_kv": ("bfloat16", False), "fp8_kv": ("fp8", False), "fp8_kv_xqa": ("fp8", True)}
    result = {}
    for name, (kv_dtype, xqa) in runs.items():
        logits = logits_of(dense, token_ids, 16, kv_dtype, xqa=xqa)
        result[name] = compare(dense_logits, logits, token_ids)
    return result


def set_kv_scales(model, scales: list[tuple[float, float]] | None) -> None:
    """Give every attention layer of `model` its (k_scale, v_scale) from `scales` (layer
    order), or 1.0 for both with None (mutates the model)."""
    from phloem.layers.attention import Attention

    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        attn.k_scale, attn.v_scale = scales[attn.layer_idx] if scales else (1.0, 1.0)


def kv_stats(kv: torch.Tensor, scale: float) -> dict:
    """Of one layer's K or V (float32 [T, H_kv, D]): the fraction of |x| below 2^-6 (e4m3's
    smallest normal at scale 1) and 2^-9 (its smallest subnormal), amax, per KV head the
    fraction below 2^-6, and the e4m3 round trip's relative error (||e4m3(x/s)*s - x|| /
    ||x||) at scale 1.0 and at `scale`."""
    from phloem.ops.kv_store import FP8_KV_DTYPE, to_cache_dtype

    a = kv.abs()

    def rel_err(s: float) -> float:
        back = to_cache_dtype(kv, FP8_KV_DTYPE, s).float() * s
        return float((back - kv).norm() / kv.norm())

    return {
        "below_2^-6": float((a < 2**-6).float().mean()),
        "below_2^-9": float((a < 2**-9).float().mean()),
        "below_2^-6_per_head": [round(float(x), 4) for x in (a < 2**-6).float().mean((0, 2))],
        "amax": float(a.amax()),
        "rel_err_scale_1": rel_err(1.0),
        "rel_err_calibrated": rel_err(scale),
    }


def measure_scales(num_tokens: int, margins: tuple[float, ...], xqa: bool = False) -> dict:
    """Calibrated FP8 KV scales (`phloem.worker.kv_calibration`) on the embedded model, dense
    float32 weights, against the float32 cache on the first `num_tokens` tokens of
    `held_out_text()`: "bf16_kv", "fp8_kv" (scales 1.0), "fp8_kv_cal_m<margin>" (calibrated on
    the built-in paragraph, scale = margin * amax / 448), "fp8_kv_cal_random" (on random tokens,
    the first margin), "fp8_kv_oracle" (amax of the held-out text itself / 448); with `xqa`
    also scale 1.0 and the first margin read with XQA's rounding. "layers": `kv_stats` of each
    layer's K and V on the held-out text (calibrated: the first margin's scales)."""
    from phloem.worker import kv_calibration as cal

    dense, tokenizer = load_embedded(None)
    token_ids = tokenizer.encode(held_out_text())[:num_tokens]
    dense_logits = logits_of(dense, token_ids)
    cal_ids = cal.calibration_token_ids(tokenizer, len(tokenizer))
    random_ids = cal.calibration_token_ids(None, dense.lm_head.weight.shape[0])
    held_out = cal.observe_kv(dense, token_ids)
    amax = [tuple(float(x.abs().amax()) for x in kv) for kv in held_out]
    runs: dict[str, tuple[list | None, str, bool]] = {"bf16_kv": (None, "bfloat16", False),
                                                      "fp8_kv": (None, "fp8", False)}  # fmt: skip
    calibrated = {}
    for margin in margins:
        set_kv_scales(dense, None)
        cal.calibrate_kv_scales(dense, cal_ids, margin)
        calibrated[margin] = [(a.k_scale, a.v_scale) for a in _attn_layers(dense)]
        runs[f"fp8_kv_cal_m{margin:g}"] = (calibrated[margin], "fp8", False)
    set_kv_scales(dense, None)
    cal.calibrate_kv_scales(dense, random_ids, margins[0])
    runs["fp8_kv_cal_random"] = ([(a.k_scale, a.v_scale) for a in _attn_layers(dense)], "fp8",
                                 False)  # fmt: skip
    runs["fp8_kv_oracle"] = ([(k / 448, v / 448) for k, v in amax], "fp8", False)
    if xqa:
        runs["fp8_kv_xqa"] = (None, "fp8", True)
        runs[f"fp8_kv_cal_m{margins[0]:g}_xqa"] = (calibrated[margins[0]], "fp8", True)
    result: dict = {"calibration_tokens": len(cal_ids)}
    for name, (scales, kv_dtype, with_xqa) in runs.items():
        set_kv_scales(dense, scales)
        logits = logits_of(dense, token_ids, 16, kv_dtype, xqa=with_xqa)
        result[name] = compare(dense_logits, logits, token_ids)
    first = calibrated[margins[0]]
    result["layers"] = [
        {"k": kv_stats(kv[0], first[i][0]), "v": kv_stats(kv[1], first[i][1]),
         "k_scale": first[i][0], "v_scale": first[i][1]}
        for i, kv in enumerate(held_out)
    ]  # fmt: skip
    return result


def _attn_layers(model) -> list:
    """The model's attention layers in `layer_idx` order."""
    from phloem.layers.attention import Attention

    found = [m for m in model.modules() if isinstance(m, Attention)]
    return sorted(found, key=lambda m: m.layer_idx)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=2000)
    parser.add_argument("--out", default=None, help="JSON path (default: a dated results dir)")
    parser.add_argument("--xqa", action="store_true",
                        help="the KV cache alone: bf16, FP8, FP8 with XQA's rounding")  # fmt: skip
    parser.add_argument("--kv-scales", default=None, metavar="MARGINS",
                        help="calibrated KV scales: comma-separated margins (e.g. 1,2,0.5)")  # fmt: skip
    args = parser.parse_args()
    start = time.perf_counter()
    if args.kv_scales:
        margins = tuple(float(m) for m in args.kv_scales.split(","))
        result = measure_scales(args.num_tokens, margins, xqa=args.xqa)
    elif args.xqa:
        result = measure_kv(args.num_tokens)
    else:
        result = measure(args.num_tokens, bf16_context=True, fp8_kv=True)
    result.update(
        elapsed_s=time.perf_counter() - start,
        device=platform.processor() or "cpu",
        torch=torch.__version__,
        command="python " + " ".join(sys.argv),
    )
    day = datetime.date.today().isoformat()
    out = Path(args.out or f"benchmarks/results/{day}-cpu-fp8-quality/quality.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
