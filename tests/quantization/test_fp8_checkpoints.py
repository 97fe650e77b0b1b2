"""FP8 checkpoints end to end on the CPU: a tiny Llama quantized in memory (`quantization="fp8"`)
is written as HF `quant_method: "fp8"` checkpoints (per-tensor and 128x128 block scales) and as
llm-compressor's compressed-tensors FP8_DYNAMIC checkpoint; each loads to the same FP8 weights
and generates the in-memory model's greedy tokens exactly. Bad input (an unknown quantization,
an old GPU, missing or mis-shaped scales, unsupported schemes) is refused naming the field, the
requirement or the tensor, before any weight is read."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from phloem import LLM, SamplingParams
from phloem.layers.linear import LinearBase
from phloem.models.loader import hf_module_names, load_hf_config, load_model, resolve_model
from tests.engine.tiny_models import VOCAB, write_tiny_model

ROW_MAX = 0.5  # every row's largest |w|: per-channel scales equal within each tensor


def equalize_row_maxima(path) -> None:
    """Give every row of every linear weight the same largest |w| (ROW_MAX, one element per row;
    the others are N(0, 0.08), far below), so that the in-memory per-channel scales are one
    value per tensor and the per-tensor and block formats can hold them exactly."""
    state = load_file(path / "model.safetensors")
    for name, w in state.items():
        if name.endswith("proj.weight"):
            rows = torch.arange(w.shape[0])
            w[rows, rows % w.shape[1]] = ROW_MAX * torch.where(rows % 2 == 0, 1.0, -1.0)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def quantized_parts(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (fp8 weight [rows, cols], fp32 scales [rows]) of an FP8 model."""
    parts = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            rows = [shape[0] for _, shape in module.part_shapes()]
            pairs = zip(module.weight.split(rows), module.weight_scale.split(rows))
            parts.update(zip(hf_module_names(name, module), pairs))
    return parts


def write_fp8_checkpoint(dense_dir, out, parts, fmt: str) -> None:
    """`dense_dir` with its linear weights replaced by `parts` in format `fmt`: "ct"
    (compressed-tensors, per-channel [rows, 1]), "fp8-tensor" or "fp8-block" (128 x 128)."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    shutil.copytree(dense_dir, out)
    state = load_file(out / "model.safetensors")
    for hf, (weight, scale) in parts.items():
        state[f"{hf}.weight"] = weight.contiguous()
        if fmt == "ct":
            state[f"{hf}.weight_scale"] = scale.reshape(-1, 1).contiguous()
            continue
        assert (scale == scale[0]).all()  # equalize_row_maxima made them one value
        if fmt == "fp8-tensor":
            state[f"{hf}.weight_scale"] = scale[0].clone()
        else:
            blocks = (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
            state[f"{hf}.weight_scale_inv"] = torch.full(blocks, float(scale[0]))
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    if fmt == "ct":
        scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
        quant = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                   format="float-quantized").model_dump(mode="json")  # fmt: skip
    elif fmt == "fp8-tensor":
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    else:
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                 "weight_block_size": [128, 128]}  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config))


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(2 + i)] for i in range(5)]


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20,
               max_num_batched_tokens=32, **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, embedded_tokenizer_dir):
    """(dense dir, {format: dir}, in-memory FP8 model's parts, its greedy tokens)."""
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("fp8_ckpt")
    dense = root / "dense"
    dense.mkdir()
    write_tiny_model("llama", dense, embedded_tokenizer_dir, seed=7)
    equalize_row_maxima(dense)
    llm = engine(dense, quantization="fp8")
    model = llm.llm_engine.executor.worker.model
    parts = {k: (w.clone(), s.clone()) for k, (w, s) in quantized_parts(model).items()}
    tokens = greedy(llm)
    del llm
    dirs = {}
    for fmt in ("ct", "fp8-tensor", "fp8-block"):
        dirs[fmt] = root / fmt
        write_fp8_checkpoint(dense, dirs[fmt], parts, fmt)
    return dense, dirs, parts, tokens


@pytest.mark.parametrize("fmt", ["ct", "fp8-tensor", "fp8-block"])
def test_fp8_checkpoint_matches_in_memory_model(checkpoints, fmt):
    _, dirs, parts, tokens = checkpoints
    llm = engine(dirs[fmt])
    model = llm.llm_engine.executor.worker.model
    loaded = quantized_parts(model) if fmt != "fp8-block" else None
    if loaded is not None:  # the same bytes and scales (a CPU block model keeps block scales)
        for hf, (weight, scale) in parts.items():
            assert torch.equal(loaded[hf][0].view(torch.uint8), weight.view(torch.uint8)), hf
            assert torch.equal(loaded[hf][1], scale), hf
    else:
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale_inv.shape == (128, 1)
    assert greedy(llm) == tokens
    assert model.lm_head.weight.dtype == torch.float32  # LM head and embeddings stay dense


def test_quantization_fp8_with_an_fp8_checkpoint_is_accepted(checkpoints):
    _, dirs, _, tokens = checkpoints
    assert greedy(engine(dirs["ct"], quantization="fp8")) == tokens


def test_unknown_quantization_is_refused(checkpoints):
    dense = checkpoints[0]
    with pytest.raises(ValueError, match=r"quantization must be one of \['fp8'\], got 'int8'"):
        engine(dense, quantization="int8")


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_fp8_needs_compute_capability_8_9(checkpoints, capability):
    source = resolve_model(str(checkpoints[0]))
    hf_config = load_hf_config(source)
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9.*has 8\.\d"):
        load_model(source, hf_config, quantization="fp8", device_capability=capability)
    model = load_model(source, hf_config, quantization="fp8", device_capability=(9, 0))
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


def rewrite(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})


def test_missing_or_misshaped_scales_are_named(checkpoints, tmp_path):
    ct = checkpoints[1]["ct"]
    name = "model.layers.1.self_attn.k_proj.weight_scale"
    rewrite(ct, tmp_path / "missing", lambda s: s.pop(name))
    with pytest.raises(ValueError, match=f"lacks tensor '{name}'"):
        engine(tmp_path / "missing")
    rewrite(ct, tmp_path / "shape", lambda s: s.update({name: torch.ones(3, 1)}))
    with pytest.raises(ValueError, match=f"'{name}'.*shape \\[3, 1\\]"):
        engine(tmp_path / "shape")
    weight = "model.layers.0.mlp.up_proj.weight"
    rewrite(ct, tmp_path / "dtype", lambda s: s.update({weight: s[weight].float()}))
    with pytest.raises(ValueError, match=f"'{weight}'.*dtype F32"):
        engine(tmp_path / "dtype")
    block = checkpoints[1]["fp8-block"]
    inv = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    rewrite(block, tmp_path / "block", lambda s: s.update({inv: torch.ones(2, 1)}))
    with pytest.raises(ValueError, match=f"'{inv}'.*expected shape \\[1, 1\\]"):
        engine(tmp_path / "block")


def with_quant_config(src, dst, quant: dict) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("preset", "named"), [("W4A16", r"int4 group group_size 128"), ("NVFP4", r"float4")]
)
def test_unsupported_compressed_tensors_schemes_are_named(checkpoints, tmp_path, preset, named):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    quant = QuantizationConfig(config_groups={"group_0": scheme}).model_dump(mode="json")
    with_quant_config(checkpoints[0], tmp_path / "ckpt", quant)
    with pytest.raises(ValueError, match=f"scheme \\(weights {named}"):
        engine(tmp_path / "ckpt")


def test_unsupported_quant_method_is_named(checkpoints, tmp_path):
    with_quant_config(checkpoints[0], tmp_path / "awq", {"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        engine(tmp_path / "awq")
