"""One worker: a device, the model's weights on it, a KV pool sized for it, and a model runner.

Memory sizing on CUDA (vLLM's method): load the weights, run one dummy step as large as the
scheduler allows and record its activation peak, then give the KV pool
`total * gpu_memory_utilization - in use - peak`. CUDA graphs are captured after that (their
replays include the tensor-parallel all-reduces; with speculative decoding the verify graphs
too); if they leave less than the peak free, the pool gives back the difference and they are
captured again (`graph_memory`).

Under tensor parallelism every rank runs one of these (`phloem.engine.tp_executor`): its model
holds its shards and its KV pool its KV heads; the ranks agree on the smallest block count.
"""

from __future__ import annotations

import logging

import torch

from phloem.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from phloem.distributed.communication import tp_min
from phloem.distributed.parallel_state import init_fused_norm_all_reduce, tp_size
from phloem.layers.attention import Attention
from phloem.ops.attention import get_attention_backend
from phloem.ops.attention.interface import AttentionBackend
from phloem.ops.kv_store import FP8_KV_DTYPE
from phloem.worker.fusion import compile_elementwise_layers
from phloem.worker.graph_memory import available_bytes, kv_blocks_to_release, runtime_need
from phloem.worker.kernel_prebuild import KernelPrebuild
from phloem.worker.model_runner import ModelRunner
from phloem.worker.piecewise_graph import piecewise_token_sizes
from phloem.worker.startup_phases import StartupPhases
from phloem.worker.triton_prebuild import prebuild_for_engine
from phloem.worker.verify_graph import verify_batch_sizes

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda if available, else cpu. Raises ValueError for cuda without a GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA GPU is available")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products natively (x86 `avx512_bf16` or
    `amx_bf16` in /proc/cpuinfo's flags): there, oneDNN's bf16 GEMMs run 2-4x the float32 ones.
    False where the flags cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" -> bfloat16 on GPU; on CPU, bfloat16 where the CPU has native bfloat16 dot
    products (`cpu_has_native_bf16`), else float32 (emulated bfloat16 is slower than float32).
    Peers run CPU models in bfloat16 by default too (vLLM's CPU backend)."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens over all layers [bytes]."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


class Worker:
    """Loads the model, sizes the KV pool, builds its runner and (on CUDA) captures decode graphs.

    Args:
        model_config, cache_config: this worker's parts of the engine config.
        source, hf_config: the resolved checkpoint and its transformers config.
        seed: the sampler's seed; eos_token_id: banned below `min_tokens`.
        scheduler_config: the step limits (largest step for memory profiling, largest decode
            batch for CUDA graphs); None assumes `SchedulerConfig`'s defaults.
        speculative_config: speculative decoding's settings (the verify graphs' k and batch
            limit); None: no verify graphs.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        source,
        hf_config,
        seed: int = 0,
        eos_token_id: int | None = None,
        scheduler_config: SchedulerConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        from phloem.models.loader import load_model

        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        torch.manual_seed(seed)
        self.speculative = speculative_config
        # [bytes]: the largest step's activations (CUDA profile); what the CUDA graphs took
        self.activation_peak = self.graph_memory_taken = 0
        phases = StartupPhases()  # kernels build while the weights load:
        settings = (model_config, cache_config, hf_config, self.device, self.dtype, tp_size())
        prebuild = KernelPrebuild.for_engine(*settings)  # FlashInfer's modules
        triton_prebuild = prebuild_for_engine(*settings)  # phloem's Triton kernels
        self.model = load_model(source, hf_config, self.dtype, self.device,
                                load_format=model_config.load_format,
                                quantization=model_config.quantization)  # fmt: skip
        phases.mark("weights")
        init_fused_norm_all_reduce(hf_config.hidden_size, self.dtype)  # PHLOEM_TP_ALLREDUCE
        self.compiled_layers = 0
        if self.device.type == "cuda":
            self.compiled_layers = compile_elementwise_layers(self.model)
        sched = scheduler_config or SchedulerConfig()
        self.kv_dtype = FP8_KV_DTYPE if cache_config.kv_cache_dtype == "fp8" else self.dtype
        backend = self._attention_backend(model_config, cache_config, sched)
        backend.defer_prefill_backend(prebuild.deferred_ready)  # fa3 once its module is built
        logger.info("attention backend: %s", backend.name)
        profile_tokens = min(sched.max_num_batched_tokens, sched.max_model_len)
        self.model_runner = ModelRunner(
            self.model,
            num_blocks=-(-profile_tokens // cache_config.block_size),
            block_size=cache_config.block_size,
            kv_dtype=self.kv_dtype,
            device=self.device,
            backend=backend,
            seed=seed,
            eos_token_id=eos_token_id,
            kv_layout=cache_config.kv_layout,
        )
        prebuild_s = prebuild.wait()  # before anything plans attention
        phases.mark("setup_and_flashinfer_wait")
        triton_s = triton_prebuild.wait()  # before the first launch of a Triton kernel
        phases.mark("triton_wait")
        if self.kv_dtype == FP8_KV_DTYPE:  # scales are graph constants: fixed before capture
            _set_kv_scales(self.model, cache_config, source, hf_config.vocab_size)
        self.num_blocks = self._allocate_kv_cache(cache_config, sched, profile_tokens)
        phases.mark("memory_profile_and_kv")
        self._warm_up(model_config, sched, phases, cache_config)
        phases.finish("cuda_graphs", flashinfer_prebuild=prebuild_s, triton_prebuild=triton_s)

    def _warm_up(
        self,
        model_config: ModelConfig,
        sched: SchedulerConfig,
        phases: StartupPhases,
        cache_config: CacheConfig,
    ) -> None:
        """On CUDA, before the first request: compile the attention kernels (phase
        "attention_warmup"), then capture the decode CUDA graphs and, in "piecewise" mode, the
        piecewise ones (sets `cuda_graphs`; `enforce_eager` captures none); if they left too
        little memory for eager steps, shrink the KV pool and capture again (`graph_memory`)."""
        if self.device.type == "cuda":
            self.model_runner.warmup_attention(_num_heads(self.model))
        phases.mark("attention_warmup")
        self.cuda_graphs = False
        if self.device.type == "cuda" and not model_config.enforce_eager:
            self._capture_all(model_config, sched)
            sized = (
                cache_config.num_gpu_blocks is None and cache_config.kv_cache_memory_bytes is None
            )
            if self.cuda_graphs and sized:
                self._fit_graphs(model_config, sched)

    def _capture_all(self, model_config: ModelConfig, sched: SchedulerConfig) -> None:
        """Capture the decode graphs, the verify graphs (speculative decoding) and, in
        "piecewise" mode, the piecewise ones; log the memory they took (`graph_memory_taken`)."""
        before, _ = available_bytes(self.device)
        self.cuda_graphs = self._capture(sched.max_num_seqs)
        if self.cuda_graphs:
            self._capture_verify(sched)
        if model_config.cuda_graph_mode == "piecewise":
            self._capture_piecewise(sched.max_num_batched_tokens)
        after, _ = available_bytes(self.device)
        self.graph_memory_taken = before - after
        logger.info("CUDA graphs took %.2f GiB; %.2f GiB available after the capture",
                    self.graph_memory_taken / 2**30, after / 2**30)  # fmt: skip

    def _fit_graphs(self, model_config: ModelConfig, sched: SchedulerConfig) -> None:
        """If the graphs left less memory than the largest eager step needs (`runtime_need`),
        give the KV pool back the difference (the ranks agree on the smallest pool) and
        capture the graphs again into the freed memory.

        Raises:
            ValueError: if no KV block would be left.
        """
        available, total = available_bytes(self.device)
        need = runtime_need(self.activation_peak, total)
        per_block = kv_bytes_per_block(self.model, self.model_runner.block_size, self.kv_dtype)
        release = kv_blocks_to_release(available, need, per_block)
        num_blocks = tp_min(self.num_blocks - release, self.device)
        if num_blocks == self.num_blocks:
            return
        if num_blocks < 1:
            raise ValueError(
                f"the CUDA graphs leave no memory for the KV cache ({available / 2**30:.2f} GiB "
                "available after the capture); lower max_num_seqs or set enforce_eager"
            )
        logger.warning(
            "CUDA graphs left %.2f GiB, eager steps need %.2f GiB: the KV cache gives back %d "
            "of %d blocks (%.2f GiB) and the graphs are captured again (a lower "
            "gpu_memory_utilization or max_num_seqs avoids the second capture)",
            available / 2**30, need / 2**30, self.num_blocks - num_blocks, self.num_blocks,
            (self.num_blocks - num_blocks) * per_block / 2**30,
        )  # fmt: skip
        self.release_cuda_graphs()
        self.model_runner.allocate_kv_cache(num_blocks)
        torch.cuda.empty_cache()
        self.num_blocks = num_blocks
        self._capture_all(model_config, sched)

    def _attention_backend(
        self, model_config: ModelConfig, cache_config: CacheConfig, sched: SchedulerConfig
    ) -> AttentionBackend:
        """The configured backend, sized for this model and these step limits (no sequence
        outgrows `sched.max_model_len`: the engine caps it at the model's positions)."""
        return get_attention_backend(
            model_config.attention_backend,
            num_heads=_num_heads(self.model),
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            device=self.device,
            max_num_blocks_per_seq=-(-sched.max_model_len // cache_config.block_size),
            max_num_seqs=sched.max_num_seqs,
            kv_layout=cache_config.kv_layout,
        )

    def _allocate_kv_cache(
        self, cache_config: CacheConfig, sched: SchedulerConfig, profile_tokens: int
    ) -> int:
        """Size the KV pool (after a memory profile of the largest step, on CUDA without an
        explicit block count), allocate it in the runner, log it; returns its blocks."""
        block_size = cache_config.block_size
        if self.device.type == "cuda" and cache_config.num_gpu_blocks is None:
            self.activation_peak = self._profile_activations(profile_tokens, sched.max_num_seqs)
        num_blocks = tp_min(self._num_kv_blocks(cache_config, self.activation_peak), self.device)
        self.model_runner.allocate_kv_cache(num_blocks)
        tokens = num_blocks * block_size
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); max concurrency %.1f "
            "requests of %d tokens",
            num_blocks,
            block_size,
            tokens,
            num_blocks * kv_bytes_per_block(self.model, block_size, self.kv_dtype) / 2**30,
            tokens / sched.max_model_len,
            sched.max_model_len,
        )
        return num_blocks

    def _profile_activations(self, num_tokens: int, num_seqs: int) -> int:
        """Peak bytes allocated above the weights by the largest step (CUDA)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.model_runner.profile_run(num_tokens, num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.model_runner.kv_caches = []
        torch.cuda.empty_cache()
        logger.info(
            "memory profile: %d-token step peaks at %.2f GiB of activations; weights %.2f GiB",
            num_tokens,
            peak / 2**30,
            before / 2**30,
        )
        return peak

    def release_cuda_graphs(self) -> None:
        """Free the captured decode, verify and piecewise graphs and their memory pools (idempotent;
        later steps run eagerly). A tensor-parallel member calls it before leaving its NCCL
        group, whose teardown hangs while graphs that captured its collectives are alive."""
        runner = self.model_runner
        graphs, runner.graph_runner = runner.graph_runner, None
        pieces, runner.piecewise_runner = runner.piecewise_runner, None
        verify, runner.verify_runner = runner.verify_runner, None
        self.cuda_graphs = False
        for captured in (graphs, pieces, verify):
            if captured is not None:
                captured.release()

    def _capture_piecewise(self, max_num_batched_tokens: int) -> None:
        """Capture the piecewise graphs of the steps decode graphs do not take, for every token
        bucket up to max_num_batched_tokens (`piecewise_token_sizes`); if that fails on one GPU,
        those steps run eagerly (under tensor parallelism it raises: all ranks or none)."""
        try:
            self.model_runner.capture_piecewise_graphs(
                piecewise_token_sizes(max_num_batched_tokens)
            )
        except Exception:  # an eager step is slower, not wrong
            if tp_size() > 1:
                raise
            logger.exception("piecewise CUDA graph capture failed; those steps run eagerly")
            self.model_runner.piecewise_runner = None

    def _capture_verify(self, sched: SchedulerConfig) -> None:
        """With speculative decoding, capture the verify graphs (`verify_graph`: q = 1 + w
        tokens a sequence for each width w of `verify_widths`, buckets by `verify_batch_sizes`)
        when the backend plans them; if that fails on one GPU, verify steps keep their
        piecewise or eager path."""
        spec, backend = self.speculative, self.model_runner.backend
        if spec is None or not backend.supports_verify_graphs:
            return
        shapes = {}
        for width in spec.verify_widths():
            sizes = verify_batch_sizes(spec.verify_graph_max_batch, sched.max_num_seqs,
                                       1 + width, sched.max_num_batched_tokens)  # fmt: skip
            if sizes:
                shapes[1 + width] = sizes
        if not shapes:
            return
        try:
            self.model_runner.capture_verify_graphs(shapes)
        except Exception:  # a verify step off the graph is slower, not wrong
            if tp_size() > 1:
                raise
            logger.exception("verify CUDA graph capture failed; verify steps run as before")
            self.model_runner.verify_runner = None

    def _capture(self, max_num_seqs: int) -> bool:
        if not self.model_runner.backend.supports_cuda_graphs:
            logger.warning(
                "CUDA graphs off: backend %r cannot plan graph steps",
                self.model_runner.backend.name,
            )
            return False
        try:
            self.model_runner.capture_cuda_graphs(max_num_seqs)
        except Exception:  # an eager engine is slower, not wrong
            if tp_size() > 1:  # the ranks must all replay or all run eagerly (collectives)
                raise
            logger.exception("CUDA graph capture failed; running eagerly")
            self.model_runner.graph_runner = None
            return False
        return True

    def _num_kv_blocks(self, cache: CacheConfig, activation_peak: int = 0) -> int:
        """KV blocks per layer: the explicit count, the byte budget, or on CUDA
        total * gpu_memory_utilization - (memory in use now + the profiled activation peak)."""
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        per_block = kv_bytes_per_block(self.model, cache.block_size, self.kv_dtype)
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cache.gpu_memory_utilization) - used - activation_peak
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // per_block - 1  # one scratch block for CUDA-graph padding
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
                "raise kv_cache_memory_bytes or gpu_memory_utilization"
            )
        return num_blocks


def _set_kv_scales(model, cache_config: CacheConfig, source, vocab_size: int) -> None:
    """An FP8 cache's scales: with `kv_cache_scales="calibrate"` calibrate the layers without
    checkpoint scales (`phloem.worker.kv_calibration`; mutates the model), then log them."""
    if cache_config.kv_cache_scales == "calibrate":
        from phloem.worker.kv_calibration import calibrate_at_load

        calibrate_at_load(model, source, vocab_size)
    _log_kv_scales(model)


def _log_kv_scales(model) -> None:
    """Log where an FP8 KV cache's per-layer scales come from (`Attention.k_scale` / `v_scale`:
    the checkpoint's, calibrated ones, or 1.0 for every layer)."""
    from phloem.layers.attention import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for source in ("checkpoint", "calibrated"):
        given = [(m.k_scale, m.v_scale) for m in layers if m.kv_scale_source == source]
        if given:
            k, v = [s[0] for s in given], [s[1] for s in given]
            logger.info(
                "FP8 KV cache: %s scales on %d of %d layers (k_scale %.3g-%.3g, v_scale "
                "%.3g-%.3g)", source, len(given), len(layers), min(k), max(k), min(v), max(v),
            )  # fmt: skip
    if all(m.kv_scale_source == "default" for m in layers):
        logger.info("FP8 KV cache: no KV scales in the checkpoint, 1.0 for K and V (values "
                    "beyond +-448 clamp; kv_cache_scales='calibrate' sets them at load)")  # fmt: skip


def _num_heads(model) -> int:
    """Query heads per layer of this rank (from the first attention layer)."""
    for module in model.modules():
        if isinstance(module, Attention):
            return module.num_heads
    raise ValueError("model has no attention layer")
