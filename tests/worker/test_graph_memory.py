"""phloem/worker/graph_memory.py: the CUDA-graph memory probe's measurement and extrapolation,
on a simulated device (the real probe runs in tests/gpu/test_engine_gpu.py)."""

import pytest

from phloem.worker.graph_memory import extrapolate, probe


class FakeDevice:
    """Graphs of one kind: a shared pool as large as the largest bucket's activations
    (`per_token` bytes a row) plus `per_graph` bytes of executable per graph; `kept` bytes
    per bucket stay allocated after a release (per-bucket buffers)."""

    def __init__(self, per_token: int, per_graph: int, kept: int = 0) -> None:
        self.free, self.per_token, self.per_graph, self.kept = 10**12, per_token, per_graph, kept
        self.captures = []

    def capture(self, buckets):
        self.captures.append(list(buckets))
        taken = max(buckets) * self.per_token + len(buckets) * self.per_graph
        self.free -= taken + self.kept * len(buckets)

        def release():
            self.free += taken

        return release


def test_extrapolate():
    assert extrapolate(100, 130, 1) == 100
    assert extrapolate(100, 130, 10) == 100 + 30 * 9
    assert extrapolate(100, 90, 10) == 100  # a negative increment counts as nothing


@pytest.mark.parametrize("kept", [0, 7])
def test_probe_covers_the_full_capture(kept):
    sizes = [1, 2, 4, 8] + list(range(16, 513, 16))
    device = FakeDevice(per_token=1000, per_graph=50_000, kept=kept)
    estimate = probe(device.capture, sizes, lambda: device.free)
    assert device.captures == [[512], [496, 512]]  # the largest, then the largest two
    assert device.free == 10**12 - 3 * kept  # released (the kept buffers stay)
    actual = 512 * 1000 + len(sizes) * 50_000
    assert actual <= estimate <= actual + kept * (1 + 2 * (len(sizes) - 1))


def test_probe_edge_cases():
    device = FakeDevice(per_token=10, per_graph=5)
    assert probe(device.capture, [], lambda: device.free) == 0
    assert probe(device.capture, [64], lambda: device.free) == 64 * 10 + 5
    assert device.captures == [[64]]
