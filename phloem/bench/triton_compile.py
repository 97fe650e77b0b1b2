"""Compiling a GPU benchmark's Triton variants ahead of its timings, for benchmarks/.

A benchmark that times many kernel configs compiles them first, in parallel, in a child process
of its own script (`--compile-only`, the request as JSON on stdin): recording the launches
takes over that process's Triton driver (`phloem.worker.triton_variants`), so it cannot be the
timing process. `compile_in_child` is the parent's side, `compile_recorded` the child's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def compile_in_child(script: str, request: dict[str, Any]) -> dict[str, Any]:
    """Run `python script --compile-only` with `request` (JSON; its "arch" [major, minor] and
    "jobs" read by `compile_recorded`) on stdin; print and return the child's summary
    ({"variants", "errors"}: counts).

    Raises:
        RuntimeError: the child exited non-zero (the end of its stderr in the message).
    """
    start = time.perf_counter()
    done = subprocess.run([sys.executable, script, "--compile-only"], text=True,
                          input=json.dumps(request), capture_output=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"compiling the variants failed:\n{done.stderr[-4000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"compiled {summary['variants']} variants ({summary['errors']} errors) with "
          f"{request['jobs']} processes in {time.perf_counter() - start:.1f} s")  # fmt: skip
    return summary


def compile_recorded(launch: Callable[[], None], request: dict[str, Any]) -> dict[str, Any]:
    """The child's side: record the Triton launches `launch` makes (CPU tensors laid out as the
    GPU run's), for the GPU of request["arch"], and compile them request["jobs"] at a time;
    the first 5 failures go to stderr. Returns {"variants", "errors"} (counts)."""
    from phloem.worker.triton_variants import compile_all, cuda_target, record_variants

    variants = record_variants(launch, cuda_target(tuple(request["arch"])))
    reports = compile_all(variants, request["jobs"])
    errors = [r for r in reports if "error" in r]
    for r in errors[:5]:
        print(r, file=sys.stderr)
    return {"variants": len(variants), "errors": len(errors)}
