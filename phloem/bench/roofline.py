"""The roofline bound of a workload, exactly as shared/docs/ROOFLINE.md defines it, and the two
ceilings (matmul FLOP/s, copy bandwidth) measured on the device in the same run.

For hidden d, L layers, h_q / h_kv heads of dim h_d, MLP size f, vocab V:
    P = d*h_q*h_d*2 + d*h_kv*h_d*2 + 3*d*f;  P_lin = L*P;  H = d*V
    KV bytes per token = 2*L*h_kv*h_d*elem;  weight bytes = 2*(P_lin + 2*H)  (bf16)
Per prefix group (prefix p, counted once) and per request (prompt n, output o):
    prefix FLOPs   2*P_lin*p + 2*L*h_q*h_d*p^2
    own prompt     2*P_lin*(n-p) + 4*L*h_q*h_d*(n-p)*(p + (n-p)/2)
    outputs        (2*P_lin + 2*H)*o + 4*L*h_q*h_d*o*(n + o/2)
    KV read        kv*o*((n-p) + o/2);  group prefix KV once per step: kv*p*max(o)
    weights        weight bytes * max(o) over the batch
bound time = max(FLOPs / FLOP/s, bytes / bandwidth); ratio = bound time / measured time.
A sequential workload (batch 1, requests one after another) is the sum of one-request batches.

Precision (ROOFLINE.md): the FLOP ceiling is measured in the precision of the run's GEMMs
(`precision="fp8"`: an e4m3 `torch._scaled_mm` of the same n^3 shape with row-wise scales, as
the FP8 linear layers run), and weights are counted at their dtype plus scales: an FP8 model's
linear weights at 1 byte per parameter plus one fp32 scale per output channel, its embeddings
and LM head (kept in the model dtype) at 2.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from phloem.bench.workloads import Workload

PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder-only model.

    Attributes:
        bytes_per_element: bytes of one KV-cache element (2 bf16, 1 fp8).
        linear_bytes_per_element: bytes of one linear-layer weight (2 bf16; 1 fp8, which adds
            one fp32 scale per output channel).
    """

    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    bytes_per_element: int = 2
    linear_bytes_per_element: int = 2

    @classmethod
    def from_hf(
        cls, hf_config: Any, bytes_per_element: int = 2, linear_bytes_per_element: int = 2
    ) -> ModelShape:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(
            hf_config.hidden_size,
            hf_config.num_hidden_layers,
            heads,
            getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim,
            hf_config.intermediate_size,
            hf_config.vocab_size,
            bytes_per_element,
            linear_bytes_per_element,
        )

    @property
    def p_lin(self) -> int:
        d, hd = self.hidden, self.head_dim
        per_layer = d * self.q_heads * hd * 2 + d * self.kv_heads * hd * 2 + 3 * d * self.mlp
        return self.layers * per_layer

    @property
    def lm_head(self) -> int:
        return self.hidden * self.vocab

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element

    @property
    def linear_scale_bytes(self) -> int:
        """fp32 per-output-channel scales of FP8 linear weights (0 for bf16) [bytes]: q, k, v,
        o, gate, up and down outputs of every layer."""
        if self.linear_bytes_per_element == 2:
            return 0
        d, hd = self.hidden, self.head_dim
        outputs = (self.q_heads + 2 * self.kv_heads) * hd + d + 2 * self.mlp + d
        return 4 * self.layers * outputs

    @property
    def weight_bytes(self) -> int:
        """Linear weights at their dtype plus scales; embeddings and LM head in bf16 [bytes]."""
        linear = self.linear_bytes_per_element * self.p_lin + self.linear_scale_bytes
        return linear + 2 * 2 * self.lm_head


@dataclass
class Roofline:
    """Totals and the bound for one workload on one device."""

    flops: float
    bytes: float
    flops_per_s: float
    bytes_per_s: float

    @property
    def compute_time_s(self) -> float:
        return self.flops / self.flops_per_s

    @property
    def memory_time_s(self) -> float:
        return self.bytes / self.bytes_per_s

    @property
    def bound_time_s(self) -> float:
        return max(self.compute_time_s, self.memory_time_s)

    @property
    def limiter(self) -> str:
        return "compute" if self.compute_time_s >= self.memory_time_s else "memory"

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "compute_time_s": self.compute_time_s,
            "memory_time_s": self.memory_time_s,
            "bound_time_s": self.bound_time_s,
            "limiter": self.limiter,
        }


def batch_work(
    shape: ModelShape, groups: list[tuple[int, list[tuple[int, int]]]]
) -> tuple[float, float]:
    """(FLOPs, bytes) of one batch given as groups of (prefix length, [(prompt n, output o)])."""
    s = shape
    attn = s.layers * s.q_heads * s.head_dim
    kv = s.kv_bytes_per_token
    flops = 0.0
    nbytes = 0.0
    max_out = 0
    for p, requests in groups:
        flops += 2 * s.p_lin * p + 2 * attn * p * p
        group_max_out = 0
        for n, o in requests:
            own = n - p
            flops += 2 * s.p_lin * own + 4 * attn * own * (p + own / 2)
            flops += (2 * s.p_lin + 2 * s.lm_head) * o + 4 * attn * o * (n + o / 2)
            nbytes += kv * o * (own + o / 2)
            group_max_out = max(group_max_out, o)
        nbytes += kv * p * group_max_out
        max_out = max(max_out, group_max_out)
    nbytes += s.weight_bytes * max_out
    return flops, nbytes


def workload_roofline(
    shape: ModelShape, workload: Workload, flops_per_s: float, bytes_per_s: float
) -> Roofline:
    """The bound of a workload; a sequential workload sums per-request batches."""
    lens = [(len(p), o) for p, o in zip(workload.prompts, workload.output_lens)]
    if workload.sequential:
        flops = nbytes = 0.0
        for n, o in lens:
            f, b = batch_work(shape, [(0, [(n, o)])])
            flops, nbytes = flops + f, nbytes + b
    else:
        groups = [(p, [lens[i] for i in members]) for p, members in workload.groups]
        flops, nbytes = batch_work(shape, groups)
    return Roofline(flops, nbytes, flops_per_s, bytes_per_s)


def cuda_time_s(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median [s] of `repeats` timed calls of `fn` (CUDA events around each, after `warmup`
    untimed calls; the upper median for an even count)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def measure_ceilings(
    device: Any = "cuda", matmul_n: int = 8192, copy_bytes: int = 2 << 30, precision: str = "bf16"
) -> dict:
    """The burst ceilings of shared/docs/ROOFLINE.md: matmul FLOP/s (n^3 in `precision`: "bf16"
    or "fp8" (e4m3 `torch._scaled_mm`, row-wise scales); ten timed repeats after warm-up, random
    data) and copy bandwidth (device-to-device copy of copy_bytes, counting bytes read +
    written), timed with CUDA events; medians of the repeats. The chip at full clock.
    Returns {"flops_per_s", "bytes_per_s", "matmul_n", "copy_bytes", "precision"}.

    Raises:
        ValueError: for a precision not in `PRECISIONS`.
    """
    return _ceilings(cuda_time_s, cuda_time_s, device, matmul_n, copy_bytes, precision)


def measure_sustained_ceilings(
    device: Any = "cuda",
    matmul_n: int = 8192,
    copy_bytes: int = 2 << 30,
    matmul_s: float = 8.0,
    copy_s: float = 4.0,
    precision: str = "bf16",
) -> dict:
    """The sustained ceilings of shared/docs/ROOFLINE.md: the same matmul back to back for at
    least `matmul_s` seconds and the same copy for at least `copy_s` seconds, each rate the
    median over the second half of its calls. Measured right after a workload, on the GPU the run
    heated, it is what a power-capped board holds for minutes (goals are stated against it).
    Returns the keys of `measure_ceilings` plus "matmul_s" and "copy_s" [s]."""
    ceilings = _ceilings(
        lambda fn: sustained_time_s(fn, matmul_s),
        lambda fn: sustained_time_s(fn, copy_s),
        device,
        matmul_n,
        copy_bytes,
        precision,
    )
    return {**ceilings, "matmul_s": matmul_s, "copy_s": copy_s}


def _ceilings(
    matmul_time_s,
    copy_time_s,
    device: Any,
    matmul_n: int,
    copy_bytes: int,
    precision: str = "bf16",
) -> dict:
    """FLOP/s of the n^3 matmul in `precision` timed by `matmul_time_s(fn)` and bytes/s (read +
    written) of the copy timed by `copy_time_s(fn)` (each: seconds per call of fn)."""
    import torch

    t_mm = matmul_time_s(matmul_fn(matmul_n, device, precision))
    t_copy = copy_time_s(_copy_fn(copy_bytes, device))
    torch.cuda.empty_cache()
    return {
        "flops_per_s": 2 * matmul_n**3 / t_mm,
        "bytes_per_s": 2 * copy_bytes / t_copy,
        "matmul_n": matmul_n,
        "copy_bytes": copy_bytes,
        "precision": precision,
    }


def sustained_time_s(fn, min_s: float, chunk: int = 32, time_calls=None) -> float:
    """Median [s] per call of `fn` over the second half of at least `min_s` seconds of calls
    issued back to back (the first half is the warm-up: clocks fall as the board reaches its
    power limit). `time_calls(fn, k)` runs k calls with nothing between them and returns their
    k durations [s]; by default CUDA events recorded between the calls, one sync per chunk.
    Raises ValueError if `min_s` is not positive."""
    if min_s <= 0:
        raise ValueError(f"min_s must be positive, got {min_s}")
    time_calls = time_calls or _cuda_back_to_back
    times: list[float] = []
    while sum(times) < min_s:
        times.extend(time_calls(fn, chunk))
    second_half = sorted(times[len(times) // 2 :])
    return second_half[len(second_half) // 2]


def _cuda_back_to_back(fn, k: int) -> list[float]:
    """Durations [s] of k calls of `fn` queued back to back, from k + 1 CUDA events."""
    import torch

    events = [torch.cuda.Event(enable_timing=True) for _ in range(k + 1)]
    events[0].record()
    for i in range(k):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]


def matmul_fn(n: int, device, precision: str = "bf16"):
    """A call of the n^3 ceiling matmul in `precision`: bf16 `torch.mm`, or for "fp8" the FP8
    linear layers' GEMM (e4m3 A [n, n] row-major times B = W^T column-major, row-wise fp32
    scales, bf16 out: `torch._scaled_mm`).

    Raises:
        ValueError: for a precision not in `PRECISIONS`.
    """
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    if precision == "bf16":
        out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        return lambda: torch.mm(a, b, out=out)
    a8, w8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)  # w8: [N, K] contiguous
    scale_a = torch.ones(n, 1, device=device)
    scale_b = torch.ones(1, n, device=device)
    return lambda: torch._scaled_mm(
        a8, w8.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16
    )


def _copy_fn(nbytes: int, device):
    import torch

    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)
