"""The `phloem` command. Each subcommand lives in its own module with a `register(subparsers)`
function; `SUBCOMMANDS` lists those modules. Shared engine and sampling flags live here."""

from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF checkpoint dir or .gguf (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--cache-dir",
        default=None,
        help="converted-checkpoint cache: a .gguf model is converted to an HF directory here on "
        "first use (default: $PHLOEM_CACHE_DIR, else $XDG_CACHE_HOME/phloem or ~/.cache/phloem)",
    )
    g.add_argument(
        "--no-checkpoint-cache",
        action="store_true",
        help="parse a .gguf model at every start instead of using the converted-checkpoint cache",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-model-len", type=int, default=None, help="context length [tokens]")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="exact KV pool size [blocks]")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded requests")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    g.add_argument(
        "--no-prefix-sharing",
        action="store_true",
        help="turn off the global prefix planner and the radix prefix cache (for comparison)",
    )
    g.add_argument(
        "--no-memory-centric-admission",
        action="store_true",
        help="admit requests whenever their next chunk fits, relying on preemption",
    )
    g.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="wait for each step's tokens before scheduling the next (no host/device overlap)",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "reference", "flashinfer", "shared_prefix"],
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="fp8: KV cache in float8 e4m3 (scale 1): twice the tokens, half the reads; lossy",
    )
    g.add_argument(
        "--kv-layout",
        default="NHD",
        choices=["NHD", "HND"],
        help="KV block layout: NHD token-major, HND head-major (contiguous per head and block)",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling defaults (a line's own fields override them)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--n", type=int, default=None)
    g.add_argument("--min-tokens", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None)


_SAMPLING_ARGS = [
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "min_tokens", "stop",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
]  # fmt: skip


def sampling_defaults(args: argparse.Namespace) -> dict:
    values = {k: getattr(args, k) for k in _SAMPLING_ARGS if getattr(args, k) is not None}
    if args.sampling_seed is not None:
        values["seed"] = args.sampling_seed
    return values


def build_llm(args: argparse.Namespace):
    from phloem.engine.llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks=args.num_gpu_blocks,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_sharing,
        memory_centric_admission=not args.no_memory_centric_admission,
        async_scheduling=not args.no_async_scheduling,
        load_format=args.load_format,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_layout=args.kv_layout,
        cache_dir=args.cache_dir,
        checkpoint_cache=not args.no_checkpoint_cache,
    )


SUBCOMMANDS = [
    "phloem.entrypoints.generate",
    "phloem.entrypoints.serve",
    "phloem.entrypoints.run_batch",
    "phloem.entrypoints.bench",
]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="phloem", description="phloem LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
