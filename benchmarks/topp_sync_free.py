"""Cost of `apply_top_k_top_p` (phloem/layers/logits_processors.py): the tree's version against
an older one's (`--old-ref`, default the commit before the sync-free top-p), same process, over
rows x vocab, peaked (real-model-like, N(0, 5^2)) and flat (random-weight-like, N(0, 1))
float32 logits, pure top-p and top-k 50 + top-p rows.

Columns: the old call (reads the device to choose its path), the new call as the CPU runs it
(`host_reads` None: the free read skips the search when no row needs it), the new device path
(`host_reads=False`: what a GPU runs, never reading), and that path with a full sort in place
of the binary search (`sort fallback`, for a GPU to compare), best of `--repeats` in ms; the
aten operators of old and device path; where old and new keep different tokens, each one's
differences from a float64 full-sort reference. On a GPU (`--device cuda`) each time ends
with a synchronize, and `enqueue ms` is the host time of one call queued behind ~25 ms of
device work (`torch.cuda._sleep`): about 25 for a call that waits for the device.

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python benchmarks/topp_sync_free.py
    python benchmarks/topp_sync_free.py --device cuda --repeats 20
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from phloem.layers import logits_processors as new

PATH = "phloem/layers/logits_processors.py"


def load_old(ref: str):
    """The module at git `ref` (or in the file `ref`, for a machine without the repository's
    history), loaded from a temporary file."""
    if Path(ref).is_file():
        source = Path(ref).read_bytes()
    else:
        source = subprocess.run(
            ["git", "show", f"{ref}:{PATH}"], capture_output=True, check=True
        ).stdout
    with tempfile.NamedTemporaryFile("wb", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_logits_processors", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_keep(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The kept mask of one row [V] by a float64 full sort (the docstring's definition)."""
    x = logits.double()
    s = x.sort(descending=True).values[:top_k]
    probs = (s - s.logsumexp(0)).exp()
    num_keep = int(((probs.cumsum(0) - probs) < top_p).sum().clamp_min(1))
    return x >= s[num_keep - 1]


def differences(logits, a, b, top_k: int, top_p: float) -> tuple[int, int, int]:
    """(tokens where a and b differ, a's and b's differences from the float64 reference)."""
    rows = (a != b).any(dim=1).nonzero().flatten().tolist()
    want = [reference_keep(logits[i], top_k, top_p) for i in rows]
    return (
        int((a != b).sum()),
        sum(int((a[i] != w).sum()) for i, w in zip(rows, want)),
        sum(int((b[i] != w).sum()) for i, w in zip(rows, want)),
    )


def sort_fallback(logits, top_k, top_p) -> torch.Tensor:
    """The device path with a full sort of every row in place of the binary search (the
    candidates' cut where they hold the nucleus, else the sorted one's), never reading."""
    lp = new
    cand = logits.topk(lp._TOP_P_CANDIDATES, dim=-1).values
    lse = logits.logsumexp(dim=-1)
    threshold = lp._sorted_threshold(cand, top_k, top_p, lse)
    fits = ((cand - lse[:, None]).exp().sum(dim=-1) >= top_p) & (top_p < 1.0)
    full = lp._sorted_threshold(logits.sort(dim=-1, descending=True).values, top_k, top_p)
    return lp._masked(logits, torch.where(fits[:, None], threshold, full))


class OpCount(TorchDispatchMode):
    """Counts the aten operators run under it (kernel launches, on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def num_ops(fn) -> int:
    with OpCount() as counter:
        fn()
    return counter.count


def best_ms(fn, repeats: int, device: torch.device) -> float:
    """The fastest of `repeats` calls, in milliseconds (to the device's end on a GPU)."""
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def enqueue_ms(fn, device: torch.device) -> float:
    """Host time of one call queued behind ~25 ms of device work (GPU only)."""
    sync(device)
    torch.cuda._sleep(50_000_000)
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    sync(device)
    return elapsed * 1e3


def measure(old, logits: torch.Tensor, k: int, top_p: float, repeats: int) -> list[str]:
    """One table row's cells after the parameters."""
    rows, vocab = logits.shape
    device = logits.device
    top_k = torch.full((rows,), k, device=device)
    top_ps = torch.full((rows,), top_p, device=device)
    cand = logits.topk(min(1024, vocab), dim=-1).values
    mass = (cand - logits.logsumexp(-1, keepdim=True)).exp().sum(-1)
    host = ([k] * rows, [top_p] * rows)
    calls = {
        "old": functools.partial(old.apply_top_k_top_p, logits, top_k, top_ps),
        "cpu": functools.partial(new.apply_top_k_top_p, logits, top_k, top_ps, *host),
        "device": functools.partial(new.apply_top_k_top_p, logits, top_k, top_ps, *host, False),
        "sort": functools.partial(sort_fallback, logits, top_k, top_ps),
    }
    a, b = calls["old"]().isfinite().cpu(), calls["device"]().isfinite().cpu()
    assert torch.equal(b, calls["cpu"]().isfinite().cpu())
    reps = repeats if rows * vocab <= 8_000_000 or device.type == "cuda" else 1
    ms = {name: best_ms(call, reps, device) for name, call in calls.items()}
    cells = [f"{int((mass >= top_p).sum())}/{rows}"]
    cells += [f"{ms[name]:.2f}" for name in calls] + [f"{ms['device'] / ms['old']:.2f}"]
    cells.append(f"{num_ops(calls['old'])} / {num_ops(calls['device'])}")
    if device.type == "cuda":
        cells.append(" / ".join(f"{enqueue_ms(calls[n], device):.2f}" for n in ("old", "device")))
    return cells + [str(n) for n in differences(logits.cpu(), a, b, k, top_p)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-ref", default="5906d46", help="a git ref or a file")
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--vocab", default="32000,128256")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    old = load_old(args.old_ref)
    gpu = " | enqueue ms old / device" if device.type == "cuda" else ""
    print(
        "| rows | vocab | logits | params | candidates hold top_p | old ms | new ms (CPU) "
        "| new ms (device path) | sort fallback ms | device/old | ops old / device"
        f"{gpu} | tokens old != new | old != f64 ref | new != f64 ref |"
    )
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (3 + bool(gpu)))
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            base = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
            for shape, scale in (("peaked", 5.0), ("flat", 1.0)):
                for params, k in (("top_p", vocab), ("top_k 50 + top_p", 50)):
                    cells = measure(old, (base * scale).to(device), k, args.top_p, args.repeats)
                    row = f"| {rows} | {vocab} | {shape} | {params} | " + " | ".join(cells)
                    print(row + " |", flush=True)


if __name__ == "__main__":
    main()
