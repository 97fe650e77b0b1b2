"""The `phloem` command. Each subcommand lives in its own module with a `register(subparsers)`
function; `SUBCOMMANDS` lists those modules. Shared engine and sampling flags live here."""

from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(parser: argparse.ArgumentParser, **defaults) -> None:
    """The engine flags, one per `EngineArgs` field (see `EngineArgs.add_cli_args`); `defaults`
    overrides a field's default for this subcommand."""
    from phloem.engine_args import EngineArgs

    EngineArgs.add_cli_args(parser, **defaults)


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
    """The `LLM` of the engine flags in `args` (a namespace parsed with `add_engine_args`).

    Raises:
        ValueError: naming the setting, for an invalid value.
    """
    from phloem.engine.llm import LLM
    from phloem.engine_args import EngineArgs

    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


SUBCOMMANDS = [
    "phloem.entrypoints.generate",
    "phloem.entrypoints.serve",
    "phloem.entrypoints.run_batch",
    "phloem.entrypoints.bench",
    "phloem.entrypoints.prebuild_kernels",
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
