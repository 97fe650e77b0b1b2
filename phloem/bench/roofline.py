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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from phloem.bench.workloads import Workload


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder-only model."""

    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    bytes_per_element: int = 2

    @classmethod
    def from_hf(cls, hf_config: Any, bytes_per_element: int = 2) -> ModelShape:
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
    def weight_bytes(self) -> int:
        return 2 * (self.p_lin + 2 * self.lm_head)


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


def measure_ceilings(device: Any = "cuda", matmul_n: int = 8192, copy_bytes: int = 2 << 30) -> dict:
    """Matmul FLOP/s (bf16 n^3, ten timed repeats after warm-up, random data) and copy bandwidth
    (device-to-device copy of copy_bytes, counting bytes read + written), timed with CUDA events;
    medians of the repeats."""
    import torch

    t_mm = _time_matmul(matmul_n, device)
    t_copy = _time_copy(copy_bytes, device)
    torch.cuda.empty_cache()
    return {
        "flops_per_s": 2 * matmul_n**3 / t_mm,
        "bytes_per_s": 2 * copy_bytes / t_copy,
        "matmul_n": matmul_n,
        "copy_bytes": copy_bytes,
    }


def _time_matmul(n: int, device) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return cuda_time_s(lambda: torch.mm(a, b))


def _time_copy(nbytes: int, device) -> float:
    import torch

    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return cuda_time_s(lambda: dst.copy_(src))
