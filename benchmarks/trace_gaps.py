"""Where the GPU sits idle in a torch.profiler Chrome trace, and what the host was doing then.

    python benchmarks/trace_gaps.py TRACE.json [--min-us 200] [--top 15]

Takes the device events (kernels, memcpy, memset), merges their busy intervals, and lists the idle
gaps of at least --min-us microseconds, longest first; for each gap, the host events (CPU ops,
CUDA runtime calls) that overlap it, longest first: a host-side sync, allocation or slow Python
step shows up as the host event that spans the gap. Totals per host event name summarize.
`phloem bench throughput --profile-window START:COUNT --profile OUT.txt` writes the trace as
OUT.trace.json.
"""

from __future__ import annotations

import argparse
import collections
import json


def load(path: str) -> tuple[list[tuple[float, float]], list[tuple[float, float, str]]]:
    """(device busy intervals, host events (start, end, name)) in microseconds."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    device, host = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start, end, cat = float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            device.append((start, end))
        elif cat in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"):
            host.append((start, end, e.get("name", "?")))
    return device, host


def gaps(device: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    """Idle intervals between merged busy intervals, at least min_us long."""
    out, busy_end = [], None
    for start, end in sorted(device):
        if busy_end is not None and start - busy_end >= min_us:
            out.append((busy_end, start))
        busy_end = end if busy_end is None else max(busy_end, end)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=200.0)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    device, host = load(args.trace)
    if not device:
        raise SystemExit("no device events in the trace (was CUDA profiled?)")
    idle = gaps(device, args.min_us)
    span = max(e for _, e in device) - min(s for s, _ in device)
    total = sum(e - s for s, e in idle)
    print(f"device span {span / 1e3:.1f} ms, {len(idle)} gaps >= {args.min_us:.0f} us, "
          f"{total / 1e3:.1f} ms idle")  # fmt: skip
    by_name: collections.Counter = collections.Counter()
    for start, end in sorted(idle, key=lambda g: g[0] - g[1])[: args.top]:
        overlap = sorted(
            ((min(e, end) - max(s, start), n) for s, e, n in host if s < end and e > start),
            reverse=True,
        )
        print(f"gap {(end - start) / 1e3:7.2f} ms at +{(start - device[0][0]) / 1e3:8.1f} ms:",
              "; ".join(f"{n} {d / 1e3:.2f}" for d, n in overlap[:6]))  # fmt: skip
    for start, end in idle:
        for s, e, n in host:
            if s < end and e > start:
                by_name[n] += min(e, end) - max(s, start)
    print("host events overlapping all gaps (ms):")
    for name, us in by_name.most_common(args.top):
        print(f"  {us / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
