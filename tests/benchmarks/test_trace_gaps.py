"""benchmarks/trace_gaps.py finds device idle gaps and the host events spanning them."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_gaps  # noqa: E402


def test_gaps_and_the_host_event_behind_them(tmp_path, capsys):
    events = [  # kernels busy 0-100, 90-150 (overlap), 400-500, 520-600; gaps 150-400, 500-520
        {"ph": "X", "cat": "kernel", "name": "k", "ts": t, "dur": d}
        for t, d in [(0, 100), (90, 60), (400, 100), (520, 80)]
    ] + [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 140, "dur": 250},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    device, host = trace_gaps.load(str(path))
    assert trace_gaps.gaps(device, 100) == [(150.0, 400.0)]
    assert trace_gaps.gaps(device, 10) == [(150.0, 400.0), (500.0, 520.0)]
    trace_gaps.main([str(path), "--min-us", "100"])
    out = capsys.readouterr().out
    assert "1 gaps >= 100 us, 0.2 ms idle" in out
    assert "cudaStreamSynchronize 0.24" in out and "aten::mm" not in out
