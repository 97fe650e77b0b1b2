"""The engine's user-facing settings, declared once (vLLM's `EngineArgs` pattern).

`EngineArgs` has one field per setting, its default and its help text (field metadata). The
engine flags of every `phloem` subcommand (`add_cli_args`) and the keyword arguments of
`LLM(**kwargs)` (`from_kwargs`) are derived from it, and `create_engine_config()` turns it into
the validated `EngineConfig`. Defaults are read from the per-concern configs of `phloem.config`
(one set of defaults), and so are the accepted values of the string settings. Imports no torch
(`step_limit_defaults` asks torch for the GPU's memory when it is called).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phloem.config import (
    ATTENTION_BACKENDS,
    CUDA_GRAPH_MODES,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_SCALES,
    KV_LAYOUTS,
    LOAD_FORMATS,
    QUANTIZATIONS,
    STRUCTURED_OUTPUT_BACKENDS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from phloem.core.replica_partition import DATA_PARALLEL_ROUTINGS

logger = logging.getLogger(__name__)


# Offline defaults of (max_num_seqs, max_num_batched_tokens) on a GPU with >= LARGE_GPU_GIB GiB:
# the settings tuned on H100/H200 (issue 19: the serving-sized 256 / 4,096 ran the batchllm and
# shared-prefix workloads 11-13% slower). Usage-context defaults as in vLLM's `EngineArgs`.
OFFLINE_LARGE_GPU_LIMITS = (2048, 8192)
# Server defaults on such a GPU: vLLM's (1,024 / 8,192). Measured on an H200 (issue 24,
# benchmarks/results/2026-11-26c-h200-serving): against 256 / 4,096, a 1,000-request burst ran at
# 53.4 vs 50.9 req/s, the shared-prefix burst at 82.1 vs 73.0, Poisson 20 and 30 req/s level.
SERVE_LARGE_GPU_LIMITS = (1024, 8192)
# The server's prefill cap on such a GPU (`max_prefill_tokens_per_step`): while requests stream,
# prompt chunks take at most 512 tokens of a step. Measured on an H200 against vLLM 0.26.0 in one
# session (issue 24, benchmarks/results/2026-11-27g-h200/serve): at Poisson 30 req/s, 512/128,
# TTFT p50 / p99 0.66 / 0.92x vLLM's with it vs 0.72 / 1.52x without, TPOT p50 / p99 0.87 /
# 0.78x vs 0.92 / 0.88x (no cap let two prompts share a step: mixed steps' p99 53 vs 17 ms);
# 256 cut TPOT a little more but raised TTFT p99 past vLLM's, 128 could not keep up at 30 req/s.
SERVE_LARGE_GPU_PREFILL_CAP = 512
LARGE_GPU_GIB = 70
USAGE_CONTEXTS = ("offline", "serve")


def _arg(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    no_flag: str | None = None,
) -> Any:
    """A field of `EngineArgs`: its default, help, argparse `type` (None: the default's type)
    and `choices`; for a boolean, `no_flag` names the flag that turns it off (default
    `--no-<name>`)."""
    return field(
        default=default,
        metadata={"help": help, "type": type, "choices": choices, "no_flag": no_flag},
    )


@dataclass(frozen=True)
class EngineArgs:
    """Every user-facing engine setting; see `phloem.config` for what each one does.

    Raises (from `create_engine_config`): ValueError naming the field, for an invalid value.
    """

    model: str | None = _arg(
        ModelConfig.model,
        "HF checkpoint dir or .gguf (default: embedded SmolLM2-135M-Instruct)",
        type=str,
    )
    dtype: str = _arg(ModelConfig.dtype, "weights and activations dtype", choices=DTYPES)
    max_model_len: int | None = _arg(
        ModelConfig.max_model_len, "context length [tokens] (default: the model's)", type=int
    )
    block_size: int = _arg(CacheConfig.block_size, "tokens per KV block")
    max_num_seqs: int | None = _arg(
        None,
        f"most sequences per step (default: {OFFLINE_LARGE_GPU_LIMITS[0]} for offline jobs on a "
        f"GPU with >= {LARGE_GPU_GIB} GiB, else {SchedulerConfig.max_num_seqs})",
        type=int,
    )
    max_num_batched_tokens: int | None = _arg(
        None,
        "token budget per step (prefill chunks + decode tokens) (default with chunked prefill: "
        f"{OFFLINE_LARGE_GPU_LIMITS[1]} for offline jobs on a GPU with >= {LARGE_GPU_GIB} GiB, "
        f"else {SchedulerConfig.max_num_batched_tokens}; without: max_model_len)",
        type=int,
    )
    kv_cache_memory_bytes: int | None = _arg(
        CacheConfig.kv_cache_memory_bytes,
        "bytes for the KV pool (default: 2 GiB on CPU, else --gpu-memory-utilization)",
        type=int,
    )
    gpu_memory_utilization: float = _arg(
        CacheConfig.gpu_memory_utilization, "fraction of GPU memory phloem may use, in (0, 1]"
    )
    num_gpu_blocks: int | None = _arg(
        CacheConfig.num_gpu_blocks,
        "exact KV pool size [blocks] (overrides the byte budgets)",
        type=int,
    )
    enable_chunked_prefill: bool = _arg(
        SchedulerConfig.enable_chunked_prefill,
        "split long prompts across steps",
        no_flag="--no-chunked-prefill",
    )
    seed: int = _arg(EngineConfig.seed, "engine seed for unseeded requests")
    load_format: str = _arg(
        ModelConfig.load_format, "dummy: random weights (benchmarks)", choices=LOAD_FORMATS
    )
    device: str = _arg(ModelConfig.device, "auto: CUDA if available, else CPU", choices=DEVICES)
    enforce_eager: bool = _arg(ModelConfig.enforce_eager, "no CUDA graphs: every step eager")
    cuda_graph_mode: str = _arg(
        ModelConfig.cuda_graph_mode,
        "piecewise: decode steps replay one graph per batch size, other steps of <= 2048 tokens "
        "the pieces between attention calls (attention eager); decode: decode steps only",
        choices=CUDA_GRAPH_MODES,
    )
    attention_backend: str = _arg(
        ModelConfig.attention_backend,
        "auto: prefix-shared attention over FlashInfer on CUDA, else the plain-torch reference",
        choices=ATTENTION_BACKENDS,
    )
    enable_prefix_caching: bool = _arg(
        CacheConfig.enable_prefix_caching,
        "plan shared prefixes over each batch (BatchLLM) and keep finished requests' KV in a "
        "radix cache; off computes every prompt in full (for comparison)",
        no_flag="--no-prefix-sharing",
    )
    memory_centric_admission: bool = _arg(
        SchedulerConfig.memory_centric_admission,
        "admit a request only when the KV blocks for its whole max_tokens fit; off admits "
        "whenever its next chunk fits and relies on preemption",
    )
    async_scheduling: bool = _arg(
        True,  # SchedulerConfig's own default is False: see its docstring
        "schedule and launch each step while the previous one runs on the device",
    )
    online_prefix_grouping: bool = _arg(
        SchedulerConfig.online_prefix_grouping,
        "group requests that arrive together by shared prefix, and join later ones to a "
        "prefix still being computed, so it is computed once (needs prefix caching)",
    )
    max_prefill_tokens_per_step: int | None = _arg(
        SchedulerConfig.max_prefill_tokens_per_step,
        "while running requests stream, prompt chunks get at most this many tokens a step "
        "after the decodes (steady inter-token latency; default: "
        f"{SERVE_LARGE_GPU_PREFILL_CAP} for the server on a GPU with >= {LARGE_GPU_GIB} GiB, "
        "else no cap; the step budget lifts it)",
        type=int,
    )
    quantization: str | None = _arg(
        ModelConfig.quantization,
        "fp8: FP8 e4m3 weights and activations in the linear layers (W8A8; a bf16/fp16 "
        "checkpoint is quantized at load; default: as the checkpoint is)",
        type=str,
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = _arg(
        CacheConfig.kv_cache_dtype,
        "fp8: KV cache in float8 e4m3 with per-layer K/V scales (the checkpoint's, else 1.0): "
        "twice the tokens, half the reads; lossy",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_scales: str = _arg(
        CacheConfig.kv_cache_scales,
        "FP8 KV scales without checkpoint ones: auto (1.0) or calibrate (per layer, 4 x amax / 448 "
        "from one forward pass over a built-in paragraph at load)",
        choices=KV_CACHE_SCALES,
    )
    kv_layout: str = _arg(
        CacheConfig.kv_layout,
        "KV block layout: NHD token-major, HND head-major (contiguous per head and block)",
        choices=KV_LAYOUTS,
    )
    cache_dir: str | None = _arg(
        ModelConfig.cache_dir,
        "converted-checkpoint cache: a .gguf model is converted to an HF directory here on "
        "first use (default: $PHLOEM_CACHE_DIR, else $XDG_CACHE_HOME/phloem or ~/.cache/phloem)",
        type=str,
    )
    checkpoint_cache: bool = _arg(
        ModelConfig.checkpoint_cache,
        "load a .gguf model from its converted HF directory in the cache (off: parse the .gguf "
        "at every start)",
    )
    data_parallel_size: int = _arg(
        1,
        "replica processes of the offline jobs (generate, run-batch, LLM): one global prefix "
        "plan, whole groups dealt to replicas; one CUDA device each, or a share of the CPU "
        "threads (phloem serve runs one engine)",
    )
    data_parallel_routing: str = _arg(
        "prefix",
        "how requests reach the replicas: prefix (the global plan's groups, each prefix "
        "computed once in the cluster) or contiguous (N contiguous slices of the request list, "
        "vLLM's way; each replica plans its own)",
        choices=DATA_PARALLEL_ROUTINGS,
    )
    tensor_parallel_size: int = _arg(
        ParallelConfig.tensor_parallel_size,
        "split the model over this many ranks (Megatron-LM tensor parallelism): one CUDA "
        "device each, or CPU processes; the engine starts the worker processes itself",
    )
    structured_outputs_backend: str = _arg(
        StructuredOutputsConfig.backend,
        "grammar library of structured outputs (structured_outputs, response_format, guided_*)",
        choices=STRUCTURED_OUTPUT_BACKENDS,
    )
    structured_outputs_grammar_process: bool = _arg(
        StructuredOutputsConfig.grammar_process,
        "run the grammars of structured outputs in a process of their own, the bitmask in "
        "shared memory (PHLOEM_GRAMMAR_PROCESS=1 also turns it on)",
    )
    speculative_config: dict | None = _arg(
        None,
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' '
        '(method ngram, suffix, or draft_model with "model": a local path or "embedded"; see '
        "SpeculativeConfig for the other keys)",
        type=json.loads,
    )

    # -- keyword arguments ----------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from keyword arguments (`LLM(model, **kwargs)`).

        Raises:
            TypeError: naming each argument that is not an `EngineArgs` field.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {', '.join(map(repr, unknown))}; "
                f"engine arguments are: {', '.join(sorted(names))}"
            )
        return cls(**kwargs)

    # -- command line ---------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, **defaults: Any) -> None:
        """Add one flag per field (`--max-num-seqs` for `max_num_seqs`) to an "engine" group
        of `parser`, each storing to the field's name; a boolean gets two flags, `--<name>` and
        its `no_flag`. `defaults` overrides a field's default for this parser (e.g. `phloem
        serve` admits without memory-centric admission).

        Raises:
            TypeError: naming a key of `defaults` that is not a field.
        """
        unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}")
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            default = defaults.get(f.name, f.default)
            meta = f.metadata
            flag, no_flag = cli_flags(f)
            if no_flag is not None:
                state = "on" if default else "off"
                on_help = f"{meta['help']} (default {state})"
                for name, const, text in ((flag, True, on_help), (no_flag, False, f"not {flag}")):
                    group.add_argument(name, dest=f.name, action="store_const", const=const,
                                       default=default, help=text)  # fmt: skip
                continue
            group.add_argument(
                flag,
                dest=f.name,
                type=meta["type"] or type(default),
                default=default,
                choices=meta["choices"],
                help=meta["help"] if default is None else f"{meta['help']} (default {default})",
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """EngineArgs of a namespace parsed by a parser given `add_cli_args`."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    # -- the engine's config --------------------------------------------------------------------

    def _check_parallel(self) -> None:
        """ValueError naming the field for a bad data-parallel setting or combination."""
        replicas = self.data_parallel_size
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {replicas!r}")
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTINGS:
            raise ValueError(
                f"data_parallel_routing must be one of {DATA_PARALLEL_ROUTINGS}, "
                f"got {self.data_parallel_routing!r}"
            )

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig(
            backend=self.structured_outputs_backend,
            grammar_process=self.structured_outputs_grammar_process,
        )

    def _step_limits(self, usage_context: str) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) with their defaults filled in as
        `create_engine_config` describes."""
        seqs, budget = self.max_num_seqs, self.max_num_batched_tokens
        if seqs is None or (budget is None and self.enable_chunked_prefill):
            default_seqs, default_budget = step_limit_defaults(usage_context, self.device)
            seqs = default_seqs if seqs is None else seqs
            budget = default_budget if budget is None and self.enable_chunked_prefill else budget
        if budget is None:
            budget = self.max_model_len or SchedulerConfig.max_model_len
        return seqs, budget

    def _prefill_cap(self, usage_context: str) -> int | None:
        """`max_prefill_tokens_per_step`, or when None `SERVE_LARGE_GPU_PREFILL_CAP` for the
        server with chunked prefill on a GPU of >= `LARGE_GPU_GIB` GiB (logged), else None."""
        cap = self.max_prefill_tokens_per_step
        if cap is None and usage_context == "serve" and self.enable_chunked_prefill:
            gib = _cuda_memory_gib(self.device)
            if gib is not None and gib >= LARGE_GPU_GIB:
                cap = SERVE_LARGE_GPU_PREFILL_CAP
                logger.info("max_prefill_tokens_per_step=%d (serve default on this GPU)", cap)
        return cap

    def create_engine_config(self, usage_context: str = "offline") -> EngineConfig:
        """The validated `EngineConfig` of these settings. `max_num_seqs` None, and
        `max_num_batched_tokens` None with chunked prefill, become `step_limit_defaults`'s for
        `usage_context` ("offline": `LLM`, `phloem generate`, `phloem bench`; "serve": the HTTP
        server); `max_num_batched_tokens` None without chunked prefill becomes `max_model_len`
        (or `SchedulerConfig.max_model_len` when that is None too). The scheduler's
        `max_model_len` is a placeholder that the engine replaces with the model's resolved
        context length.

        Raises:
            ValueError: naming the field, for an invalid value or usage context.
        """
        self._check_parallel()
        seqs, budget = self._step_limits(usage_context)
        config = EngineConfig(
            model=ModelConfig(
                model=self.model,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                load_format=self.load_format,
                device=self.device,
                enforce_eager=self.enforce_eager,
                cuda_graph_mode=self.cuda_graph_mode,
                attention_backend=self.attention_backend,
                cache_dir=self.cache_dir,
                checkpoint_cache=self.checkpoint_cache,
                quantization=self.quantization,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_gpu_blocks=self.num_gpu_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_cache_scales=self.kv_cache_scales,
                kv_layout=self.kv_layout,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=seqs,
                max_num_batched_tokens=budget,
                max_model_len=_placeholder_model_len(budget),
                enable_chunked_prefill=self.enable_chunked_prefill,
                memory_centric_admission=self.memory_centric_admission,
                async_scheduling=self.async_scheduling,
                online_prefix_grouping=self.online_prefix_grouping,
                max_prefill_tokens_per_step=self._prefill_cap(usage_context),
            ),
            seed=self.seed,
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            structured_outputs=self._structured_outputs_config(),
            speculative=SpeculativeConfig.from_dict(self.speculative_config),
        )
        config.validate()
        return config


def step_limit_defaults(usage_context: str, device: str) -> tuple[int, int]:
    """Default (max_num_seqs, max_num_batched_tokens [tokens]) for `usage_context` on `device`
    ("auto", "cuda" or "cpu"): when the engine will run on a CUDA GPU (device 0) with >=
    `LARGE_GPU_GIB` GiB, `OFFLINE_LARGE_GPU_LIMITS` for offline jobs and `SERVE_LARGE_GPU_LIMITS`
    for the server; else `SchedulerConfig`'s (sized for CPUs and small GPUs). Logs what it picked
    and why.

    Raises:
        ValueError: naming `usage_context` when it is not one of `USAGE_CONTEXTS`.
    """
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {usage_context!r}")
    limits = (SchedulerConfig.max_num_seqs, SchedulerConfig.max_num_batched_tokens)
    why = f"{usage_context} on a CPU or a small GPU"
    gib = _cuda_memory_gib(device)
    if gib is not None and gib >= LARGE_GPU_GIB:
        large = OFFLINE_LARGE_GPU_LIMITS if usage_context == "offline" else SERVE_LARGE_GPU_LIMITS
        limits, why = large, f"{usage_context} on a GPU with {gib:.0f} GiB"
    logger.info("max_num_seqs=%d, max_num_batched_tokens=%d (defaults: %s)", *limits, why)
    return limits


def _cuda_memory_gib(device: str) -> float | None:
    """Total memory of CUDA device 0 [GiB] when `device` will run on CUDA, else None."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def _placeholder_model_len(budget: Any) -> Any:
    """The scheduler's context length until the engine resolves the model's: the step budget
    (so that validating a config with chunked prefill off passes); `budget` itself when it is
    not a positive integer, so that validation names `max_num_batched_tokens`."""
    return budget if isinstance(budget, int) and budget >= 1 else 1


def cli_flags(f: dataclasses.Field) -> tuple[str, str | None]:
    """(flag, the flag that turns it off or None) of an `EngineArgs` field: `--max-num-seqs`
    for `max_num_seqs`; a boolean's off flag is its `no_flag`, default `--no-<name>`."""
    flag = "--" + f.name.replace("_", "-")
    if not isinstance(f.default, bool):
        return flag, None
    return flag, f.metadata["no_flag"] or "--no-" + f.name.replace("_", "-")
