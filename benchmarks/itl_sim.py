"""Inter-token latency under Poisson arrivals, by the real scheduler and a step cost MODEL (no
model runs, no GPU): what the prefill cap (`--max-prefill-tokens-per-step`) does to ITL, TTFT
and throughput. The numbers are a model's, not measurements; the GPU A/B is one flag.

    python benchmarks/itl_sim.py --out benchmarks/results/2026-11-25-cpu-itl-model/itl_model.json

Step cost model (Llama-3.1-8B, bf16, one H100; docs/DESIGN.md "Steady inter-token latency"):

    t(step) = t_host + max(t_weights, c_token * T) + c_kv * K

T = tokens of the step, K = KV tokens the step's sequences attend to; t_weights = 16.06 GB of
weights at 85 % of 3.35 TB/s, c_token = 2 * 8.03e9 FLOP at 60 % of 989 TFLOP/s, c_kv = 128 KiB
per KV token at 85 % of 3.35 TB/s, t_host = 1 ms. A request's ITL is the time between two of its
tokens; the first token comes at the end of the step that samples it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from phloem.config import SchedulerConfig
from phloem.core.kv_manager import KVManager
from phloem.core.request import Request
from phloem.core.scheduler import Scheduler
from phloem.sampling_params import SamplingParams

T_HOST_S = 1.0e-3
T_WEIGHTS_S = 16.06e9 / (0.85 * 3.35e12)
C_TOKEN_S = 2 * 8.03e9 / (0.60 * 989e12)
C_KV_S = 131072 / (0.85 * 3.35e12)


def step_cost_s(num_tokens: int, num_kv_tokens: int) -> float:
    """The model's time of one step [s] (see the module docstring)."""
    return T_HOST_S + max(T_WEIGHTS_S, C_TOKEN_S * num_tokens) + C_KV_S * num_kv_tokens


def model_cap(num_decodes: int, context: int, ratio: float, block_size: int = 16) -> int:
    """The largest prefill tokens per step (a multiple of `block_size`) keeping a step with
    `num_decodes` decodes of `context` tokens within `ratio` x the pure decode step [tokens]."""
    decode = step_cost_s(num_decodes, num_decodes * context)
    cap = 0
    while step_cost_s(num_decodes + cap + block_size, num_decodes * context) <= ratio * decode:
        cap += block_size
    return cap


def arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrival times [s] over `duration_s`; all at 0 when `rate` is 0."""
    if rate == 0:
        return [0.0] * int(duration_s)  # burst mode: duration = number of requests
    rng, t, times = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            return times
        times.append(t)


def simulate(args: argparse.Namespace, rate: float, cap: int | None) -> dict:
    """Run the scheduler over one arrival trace with the model's clock; return the summary."""
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096, memory_centric_admission=False, max_prefill_tokens_per_step=cap,
    )  # fmt: skip
    scheduler = Scheduler(config, KVManager(args.num_blocks, 16, enable_prefix_cache=True))
    rng = random.Random(args.seed)
    times = arrivals(rate, args.duration if rate else args.burst, args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    pending = [(t, Request(str(i), [rng.randrange(1, 128000) for _ in range(args.input_len)],
                           params, arrival_time=t)) for i, t in enumerate(times)]  # fmt: skip
    stamps: dict[str, list[float]] = {}
    clock, step_costs, next_arrival = 0.0, [], 0
    while next_arrival < len(pending) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock = max(clock, pending[next_arrival][0])
        while next_arrival < len(pending) and pending[next_arrival][0] <= clock:
            scheduler.add_request(pending[next_arrival][1])
            next_arrival += 1
        out = scheduler.schedule()
        kv = sum(s.num_computed_tokens + s.num_tokens for s in out.scheduled)
        cost = step_cost_s(out.total_num_scheduled_tokens, kv)
        clock += cost
        step_costs.append(cost)
        sampled = {s.seq_id: 5 for s in out.scheduled if s.sample}
        for seq_id in sampled:
            stamps.setdefault(seq_id, []).append(clock)
        scheduler.update_from_output(out, sampled)
    return summary(rate, cap, pending, stamps, step_costs, clock)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 2)


def summary(rate, cap, pending, stamps, step_costs, clock) -> dict:
    itl = [b - a for ts in stamps.values() for a, b in zip(ts, ts[1:])]
    ttft = [stamps[r.request_id][0] - t for t, r in pending]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in stamps.values() if len(ts) > 1]
    return {
        "offered_rate": rate or "burst",
        "max_prefill_tokens_per_step": cap,
        "requests": len(pending),
        "achieved_req_per_s": round(len(pending) / clock, 2),
        "itl_ms": {"p50": _pct(itl, 0.5), "p90": _pct(itl, 0.9), "p99": _pct(itl, 0.99)},
        "tpot_ms": {"p50": _pct(tpot, 0.5), "p99": _pct(tpot, 0.99)},
        "ttft_ms": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)},
        "step_ms_mean": round(1000 * statistics.fmean(step_costs), 2),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="20,30,40", help="req/s; 0 = all at once (--burst)")
    p.add_argument("--caps", default="none,256", help="max_prefill_tokens_per_step values")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--burst", type=int, default=1000, help="requests of the all-at-once run")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--num-blocks", type=int, default=26000, help="8B on an H100 at 0.9")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    caps = [None if c == "none" else int(c) for c in args.caps.split(",")]
    runs = [simulate(args, float(r), c) for r in args.rates.split(",") for c in caps]
    result = {
        "what": "MODEL, not a measurement: real scheduler, modelled step times (itl_sim.py)",
        "command": " ".join(["python benchmarks/itl_sim.py", *argv]),
        "model": {"t_host_ms": T_HOST_S * 1e3, "t_weights_ms": round(T_WEIGHTS_S * 1e3, 3),
                  "c_token_us": round(C_TOKEN_S * 1e6, 3), "c_kv_ns": round(C_KV_S * 1e9, 3)},
        "cap_for_1.5x_decode_step": {f"{d} decodes x {c} ctx": model_cap(d, c, 1.5)
                                     for d, c in ((16, 576), (48, 576), (96, 576))},
        "runs": runs,
    }  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
