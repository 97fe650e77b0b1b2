"""Test-only launcher: `python -m tests.entrypoints.fault_server [serve flags]` runs `phloem
serve` (the same flags, app and shutdown) over an engine built with `FaultExecutor` (in the
engine core process, which imports it by name), so a test can
send requests whose prompt holds `NAN_TOKEN` or `DIE_TOKEN` (tests/entrypoints/fault_executor.py).
"""

from __future__ import annotations

import logging
import sys

from phloem.entrypoints.cli import build_parser
from phloem.entrypoints.serve import cmd_serve


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    # imported by name in the engine core process
    return cmd_serve(args, executor_factory="tests.entrypoints.fault_executor:FaultExecutor")


if __name__ == "__main__":
    sys.exit(main())
