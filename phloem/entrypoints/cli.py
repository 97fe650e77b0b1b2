"""The `phloem` command: `phloem generate` (offline JSONL batch job)."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF checkpoint dir or .gguf (default: embedded SmolLM2-135M-Instruct)",
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
        load_format=args.load_format,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from phloem.engine.metrics import format_summary
    from phloem.entrypoints.generate import run_generate
    from phloem.sampling_params import SamplingParams

    defaults = sampling_defaults(args)
    try:
        SamplingParams.from_dict(defaults)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = build_llm(args)
    summary = run_generate(llm, args.input, args.output, defaults, use_tqdm=not args.no_progress)
    print(format_summary(summary), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phloem", description="phloem LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run an offline JSONL batch job")
    gen.add_argument(
        "--input", "-i", required=True, help="JSONL: {id?, prompt | messages, sampling fields?}"
    )
    gen.add_argument("--output", "-o", required=True, help="JSONL, one line per input line")
    gen.add_argument("--summary-json", default=None, help="write the job summary here")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
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
