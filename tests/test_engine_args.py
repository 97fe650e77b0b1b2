"""`EngineArgs` is the one source of the engine's settings: every engine flag of the CLI maps to
one of its fields and back, `LLM(**kwargs)` accepts exactly its fields, and the defaults of the
flags, of `LLM` and of the per-concern configs agree."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json

import pytest

from phloem.config import (
    ATTENTION_BACKENDS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from phloem.engine_args import EngineArgs, cli_flags
from phloem.entrypoints.cli import add_engine_args, build_parser

FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}
# The engine flags README.md and users' scripts name; they must keep working.
LEGACY_FLAGS = [
    "--model", "--cache-dir", "--no-checkpoint-cache", "--dtype", "--device", "--max-model-len",
    "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory-bytes",
    "--gpu-memory-utilization", "--num-gpu-blocks", "--no-chunked-prefill", "--load-format",
    "--seed", "--enforce-eager", "--no-prefix-sharing", "--no-memory-centric-admission",
    "--no-async-scheduling", "--attention-backend", "--kv-cache-dtype", "--kv-layout",
]  # fmt: skip
# A value unlike the default for each field, to parse through its flag.
OTHER_VALUES = {
    "model": "some/dir", "dtype": "bfloat16", "max_model_len": 77, "block_size": 8,
    "max_num_seqs": 3, "max_num_batched_tokens": 99, "kv_cache_memory_bytes": 12345,
    "gpu_memory_utilization": 0.5, "num_gpu_blocks": 7, "seed": 5, "load_format": "dummy",
    "device": "cpu", "attention_backend": "reference", "kv_cache_dtype": "fp8",
    "kv_layout": "HND", "cache_dir": "/tmp/x", "data_parallel_size": 2,
    "data_parallel_routing": "contiguous", "cuda_graph_mode": "decode",
    "tensor_parallel_size": 2, "max_prefill_tokens_per_step": 256, "quantization": "fp8",
    "structured_outputs_backend": "xgrammar", "kv_cache_scales": "calibrate",
    "speculative_config": {"method": "suffix", "num_speculative_tokens": 3},
}  # fmt: skip


def _engine_parser(**defaults) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, **defaults)
    return parser


def _engine_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_flag_maps_to_a_field_and_back():
    actions = _engine_actions(_engine_parser())
    assert {a.dest for a in actions} == set(FIELDS)
    flags = {s for a in actions for s in a.option_strings}
    for name, f in FIELDS.items():
        flag, no_flag = cli_flags(f)
        assert flag in flags and (no_flag is None or no_flag in flags), name
    for flag in LEGACY_FLAGS:
        assert flag in flags, flag


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_each_flag_sets_its_field(name):
    f = FIELDS[name]
    flag, no_flag = cli_flags(f)
    if no_flag is not None:  # a boolean: both flags, whatever the default
        for argv, value in (([flag], True), ([no_flag], False)):
            args = EngineArgs.from_cli_args(_engine_parser().parse_args(argv))
            assert args == dataclasses.replace(EngineArgs(), **{name: value}), argv
        return
    value = OTHER_VALUES[name]
    assert value != f.default
    text = json.dumps(value) if isinstance(value, dict) else str(value)
    args = EngineArgs.from_cli_args(_engine_parser().parse_args([flag, text]))
    assert args == dataclasses.replace(EngineArgs(), **{name: value})


def test_cli_defaults_are_the_engine_args_defaults():
    assert EngineArgs.from_cli_args(_engine_parser().parse_args([])) == EngineArgs()
    # every subcommand with engine flags, serve with its one documented override
    parser = build_parser()
    for argv, overrides in (
        (["generate", "-i", "a", "-o", "b"], {}),
        (["run-batch", "-i", "a", "-o", "b"], {}),
        (["bench", "throughput"], {}),
        (["serve"], {"memory_centric_admission": False}),
    ):
        args = EngineArgs.from_cli_args(parser.parse_args(argv))
        assert args == dataclasses.replace(EngineArgs(), **overrides), argv
    serve = parser.parse_args(["serve", "--memory-centric-admission"])
    assert EngineArgs.from_cli_args(serve).memory_centric_admission is True


def test_llm_accepts_exactly_the_engine_args():
    from phloem import LLM

    params = inspect.signature(LLM.__init__).parameters
    assert list(params) == ["self", "model", "kwargs"]
    assert params["model"].default == EngineArgs.model
    with pytest.raises(TypeError, match="'not_a_setting'"):
        LLM(block_size=4, not_a_setting=1)
    with pytest.raises(TypeError, match="'enable_prefix_sharing'"):
        EngineArgs.from_kwargs(enable_prefix_sharing=False)
    values = {**OTHER_VALUES, "enforce_eager": True, "async_scheduling": False}
    assert dataclasses.asdict(EngineArgs.from_kwargs(**values)) == {
        **dataclasses.asdict(EngineArgs()),
        **values,
    }
    with pytest.raises(TypeError, match="'nope'"):
        add_engine_args(argparse.ArgumentParser(), nope=1)


def test_defaults_agree_with_the_configs():
    """The settings' defaults are the per-concern configs' (one set); the one exception is
    `async_scheduling`, off in a directly built `SchedulerConfig` (see its docstring)."""
    config = EngineArgs().create_engine_config()
    assert config.model == ModelConfig()
    assert config.cache == CacheConfig()
    assert config.seed == EngineConfig().seed
    assert config.scheduler == dataclasses.replace(
        SchedulerConfig(),
        async_scheduling=True,
        max_model_len=config.scheduler.max_num_batched_tokens,  # a placeholder, see below
    )
    assert EngineArgs.async_scheduling is True and SchedulerConfig.async_scheduling is False


def test_budget_default_and_placeholder_context():
    """No budget given: SchedulerConfig's with chunked prefill, else the context length; the
    scheduler's max_model_len is the budget until the engine resolves the model's."""
    chunked = EngineArgs().create_engine_config().scheduler
    assert chunked.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens
    whole = EngineArgs(enable_chunked_prefill=False, max_model_len=300).create_engine_config()
    assert whole.scheduler.max_num_batched_tokens == 300 == whole.scheduler.max_model_len
    unset = EngineArgs(enable_chunked_prefill=False).create_engine_config().scheduler
    assert unset.max_num_batched_tokens == SchedulerConfig.max_model_len


@pytest.mark.parametrize(
    "name, value",
    [("block_size", 0), ("max_num_batched_tokens", 0), ("dtype", "int8"),
     ("attention_backend", "nope"), ("gpu_memory_utilization", 1.5), ("seed", "x"),
     ("cuda_graph_mode", "full")],
)  # fmt: skip
def test_invalid_values_name_the_setting(name, value):
    with pytest.raises(ValueError, match=name):
        EngineArgs.from_kwargs(**{name: value}).create_engine_config()


def test_one_list_of_attention_backends():
    from phloem.ops.attention import BACKENDS

    assert tuple(BACKENDS) == ATTENTION_BACKENDS
    assert tuple(FIELDS["attention_backend"].metadata["choices"]) == ATTENTION_BACKENDS


def test_readme_documents_every_engine_flag():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    flags = {s for a in _engine_actions(_engine_parser()) for s in a.option_strings}
    missing = sorted(flag for flag in flags if f"`{flag}" not in readme)
    assert not missing, f"README.md does not document {missing}"


def test_offline_defaults_on_a_large_gpu_are_the_tuned_step_limits(monkeypatch, caplog):
    import logging

    from phloem import engine_args

    caplog.set_level(logging.INFO, logger="phloem.engine_args")
    monkeypatch.setattr(engine_args, "_cuda_memory_gib", lambda device: 139.8)
    sched = EngineArgs().create_engine_config().scheduler
    assert (
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
    ) == engine_args.OFFLINE_LARGE_GPU_LIMITS
    assert "max_num_seqs=2048, max_num_batched_tokens=8192" in caplog.text
    assert "GPU with 140 GiB" in caplog.text
    # the server's own defaults on such a GPU (vLLM's); explicit values always win
    sched = EngineArgs().create_engine_config("serve").scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (1024, 8192)
    assert "serve on a GPU with 140 GiB" in caplog.text
    # and its prefill cap (measured against vLLM); offline jobs keep whole-budget steps
    assert sched.max_prefill_tokens_per_step == engine_args.SERVE_LARGE_GPU_PREFILL_CAP == 512
    assert EngineArgs().create_engine_config().scheduler.max_prefill_tokens_per_step is None
    args = EngineArgs(max_prefill_tokens_per_step=8192)
    assert args.create_engine_config("serve").scheduler.max_prefill_tokens_per_step == 8192
    args = EngineArgs(enable_chunked_prefill=False, max_model_len=8192)
    assert args.create_engine_config("serve").scheduler.max_prefill_tokens_per_step is None
    sched = EngineArgs(max_num_seqs=64).create_engine_config().scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (64, 8192)
    sched = EngineArgs(max_num_batched_tokens=1024).create_engine_config().scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (2048, 1024)
    # without chunked prefill a step must hold a whole prompt: the budget is max_model_len
    args = EngineArgs(enable_chunked_prefill=False, max_model_len=16384)
    assert args.create_engine_config().scheduler.max_num_batched_tokens == 16384


@pytest.mark.parametrize("gib", [None, 24.0])
def test_offline_defaults_on_a_cpu_or_small_gpu_are_the_scheduler_defaults(monkeypatch, gib):
    from phloem import engine_args

    monkeypatch.setattr(engine_args, "_cuda_memory_gib", lambda device: gib)
    for usage_context in ("offline", "serve"):
        sched = EngineArgs().create_engine_config(usage_context).scheduler
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (256, 4096)
        assert sched.max_prefill_tokens_per_step is None


def test_cpu_device_never_asks_cuda():
    from phloem.engine_args import _cuda_memory_gib

    assert _cuda_memory_gib("cpu") is None


def test_unknown_usage_context_is_named():
    with pytest.raises(ValueError, match="usage_context"):
        EngineArgs().create_engine_config("online")
