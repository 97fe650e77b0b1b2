"""Scheduler-only simulation of a `phloem bench` workload: the real prefix planner, admission and
chunked-prefill scheduler over a KV pool of a given size, no model (every sampled token is a
dummy), so step counts, decode-only phases and KV waves show in seconds on a CPU; plus a step-time
model of one H200 running Llama-3.1-8B in bf16 (`StepModel`) that turns the steps into seconds.

    python benchmarks/schedule_sim.py --num-groups 100 --degree 64 --num-blocks 54300 \
        --max-num-seqs 2048 --max-num-batched-tokens 8192
    python benchmarks/schedule_sim.py --workload decode-heavy --num-requests 500 \
        --num-blocks 53535 --admission finish,balanced --quiet

Prints per admission rule the number of steps, how many are decode-only, the modelled seconds
(decode-only and mixed steps), preemptions and recomputed prompt tokens, and (without `--quiet`)
the run-length phases (kind, steps, and at the phase's first step: sequences, tokens, waiting,
running, free blocks). 53,535 blocks of 16 tokens is the pool phloem sized for Llama-3.1-8B on
an H200 at 0.9 memory and max_model_len 4096 (benchmarks/results/2026-11-27h-h200/).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from phloem.bench.workloads import make_workload
from phloem.config import SchedulerConfig
from phloem.core.admission import Admission
from phloem.core.kv_manager import KVManager
from phloem.core.prefix_groups import PrefixGroups
from phloem.core.prefix_planner import plan_prefix_groups
from phloem.core.request import Request, SharedPrefix
from phloem.core.scheduler import Scheduler
from phloem.sampling_params import SamplingParams

# the rule `--admission` picks -> (memory-centric admission, balanced waves)
ADMISSION_RULES = {
    "finish": (True, False),  # finishing sizes fit the pool (BatchLLM §4.3)
    "balanced": (True, True),  # and the last two waves of equal size (the default)
    "off": (False, False),  # the next chunk fits, preemption makes room: vLLM's
}


@dataclass(frozen=True)
class StepModel:
    """Seconds of one step on an H200, Llama-3.1-8B (32 layers, 32 q / 8 KV heads of 128, MLP
    14,336, vocabulary 128,256), bf16, kernels run one after another (no overlap):

        step = overhead + max(weight bytes / bandwidth, linear FLOPs / flops)
               + per_token x tokens + KV bytes read / attention bandwidth + attention FLOPs / flops

    Sources (benchmarks/results/): weights 16.06 GB at the sustained 4.24 TB/s = 3.79 ms and a
    batch-1 decode step of 5.12 ms (2026-11-26d-h200-serving: `overhead` 1.33 ms); decode GEMMs at
    M ~430 at the 660 TFLOP/s sustained matmul ceiling and FlashInfer decode attention reading
    KV at ~4.2 TB/s (2026-11-26h-h200); `per_token` (elementwise, sampling, the prompt chunks'
    lower GEMM rate) fitted so that decode-heavy 500 x 1000/1000 under the finish rule gives that
    run's 64 mixed steps of ~8,056 tokens in 13.4 s (210 ms each).
    """

    overhead: float = 1.33e-3  # [s] per step: ~400 small kernels and graph gaps
    weight_bytes: float = 16.06e9  # [B] 2 x (P_lin + 2 x 128256 x 4096)
    bandwidth: float = 4.24e12  # [B/s] sustained copy
    flops: float = 6.6e14  # [FLOP/s] sustained bf16 matmul
    linear_flops: float = 13.96e9  # [FLOP/token] 2 x P_lin, P_lin = 6.98e9
    head_flops: float = 1.05e9  # [FLOP/sampled row] 2 x 4096 x 128256
    per_token: float = 3.0e-6  # [s/token] fitted (see the class docstring)
    kv_bytes: float = 131072.0  # [B/token] 2 x 32 layers x 8 heads x 128 x 2 bytes
    attention_bandwidth: float = 4.2e12  # [B/s] decode attention's achieved rate
    attention_flops: float = 524288.0  # [FLOP per query token per context token] 4 x 32 x 4096

    def seconds(self, tokens: int, sampled: int, kv_tokens: int, attention_pairs: int) -> float:
        """One step: `tokens` computed, `sampled` rows with logits, `kv_tokens` [tokens] of KV read
        (a shared prefix once per group), `attention_pairs` [query x context tokens] of prompt
        chunks' attention."""
        linear = max(self.weight_bytes / self.bandwidth,
                     (tokens * self.linear_flops + sampled * self.head_flops) / self.flops)  # fmt: skip
        return (self.overhead + linear + self.per_token * tokens
                + kv_tokens * self.kv_bytes / self.attention_bandwidth
                + attention_pairs * self.attention_flops / self.flops)  # fmt: skip


def step_record(out, model: StepModel) -> tuple[str, int, int, float]:
    """(kind "D"/"M", sequences, tokens, modelled seconds) of one scheduled step."""
    tokens = sampled = kv = pairs = 0
    prefixes: dict[int, int] = {}  # group id -> its shared prefix, read once a step
    for s in out.scheduled:
        n, start = s.num_tokens, s.num_computed_tokens
        tokens += n
        sampled += s.sample
        if n == 1:
            kv += start + 1 - s.prefix_len
            if s.prefix_len:
                prefixes[s.group_id] = s.prefix_len
        else:
            kv += start + n
            pairs += n * start + n * (n + 1) // 2
    kind = "D" if tokens == len(out.scheduled) else "M"
    seconds = model.seconds(tokens, sampled, kv + sum(prefixes.values()), pairs)
    return kind, len(out.scheduled), tokens, seconds


def build_scheduler(args: argparse.Namespace, rule: str) -> Scheduler:
    """The real planner and scheduler over `args.num_blocks`, every request of the workload
    queued (`ignore_eos`, exact output lengths) in the planner's order."""
    w = make_workload(args.workload, 128256, num_requests=args.num_requests,
                      num_groups=args.num_groups, degree=args.degree,
                      input_len=args.input_len, output_len=args.output_len)  # fmt: skip
    plan = plan_prefix_groups(w.prompts, w.output_lens, args.block_size)
    shared = {}
    for group in plan.shared_groups:
        prefix = SharedPrefix(group.prefix_len, num_unfinished=len(group.request_indices))
        shared.update((i, prefix) for i in group.request_indices)
    kv = KVManager(args.num_blocks, args.block_size, enable_prefix_cache=True)
    memory_centric, balanced = ADMISSION_RULES[rule]
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, async_scheduling=False,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=4096, memory_centric_admission=memory_centric)  # fmt: skip
    admission = Admission(config, kv, balanced_waves=balanced)
    scheduler = Scheduler(config, kv, PrefixGroups(kv, admission))
    for i in plan.order:
        params = SamplingParams(max_tokens=w.output_lens[i], ignore_eos=True)
        scheduler.add_request(Request(str(i), w.prompts[i], params, shared_prefix=shared.get(i)))
    return scheduler


def simulate(args: argparse.Namespace, rule: str = "balanced") -> tuple[list[tuple], Scheduler]:
    """Run to the end under admission `rule` (a key of `ADMISSION_RULES`): one tuple per step,
    (kind "D"/"M", sequences, tokens, waiting, running, free blocks, modelled seconds), and the
    scheduler (its counters)."""
    scheduler = build_scheduler(args, rule)
    kv, model = scheduler.kv, StepModel()
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        kind, seqs, tokens, seconds = step_record(out, model)
        steps.append((kind, seqs, tokens, len(scheduler.waiting), len(scheduler.running),
                      kv.num_free_blocks, seconds))  # fmt: skip
        scheduler.update_from_output(out, {s.seq_id: 5 for s in out.scheduled if s.sample})
    return steps, scheduler


def summary(steps: list[tuple], scheduler: Scheduler) -> dict:
    """Step counts and modelled seconds of one simulated run."""
    decode = [s for s in steps if s[0] == "D"]
    return dict(
        steps=len(steps),
        decode_steps=len(decode),
        seconds=sum(s[6] for s in steps),
        decode_seconds=sum(s[6] for s in decode),
        small_steps=sum(s[1] < 150 for s in decode),  # below the GEMMs' ridge (~150 tokens)
        preemptions=scheduler.num_preemptions,
        prompt_tokens=scheduler.num_computed_prompt_tokens,
    )


def print_phases(steps: list[tuple]) -> None:
    phases: list[list] = []
    for step in steps:
        if phases and phases[-1][0] == step[0]:
            phases[-1][1] += 1
        else:
            phases.append([step[0], 1, step[1:6]])
    for kind, n, (seqs, tokens, waiting, running, free) in phases:
        print(f"  {kind} x {n:4d}: {seqs} seqs, {tokens} tokens, {waiting} waiting, "
              f"{running} running, {free} free blocks")  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="batchllm",
                   choices=["batchllm", "shared-prefix", "decode-heavy", "prefill-heavy", "random"])  # fmt: skip
    p.add_argument("--num-groups", type=int, default=None)
    p.add_argument("--degree", type=int, default=None)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=53535)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--admission", default="balanced",
                   help=f"comma-separated rules: {', '.join(ADMISSION_RULES)}")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no phase listing")
    args = p.parse_args(argv)
    for rule in args.admission.split(","):
        steps, scheduler = simulate(args, rule)
        s = summary(steps, scheduler)
        print(f"{rule}: {s['steps']} steps, {s['decode_steps']} decode-only "
              f"({s['small_steps']} of < 150 sequences), modelled {s['seconds']:.2f} s "
              f"(decode-only {s['decode_seconds']:.2f} s), {s['preemptions']} preemptions, "
              f"{s['prompt_tokens']} prompt tokens computed")  # fmt: skip
        if not args.quiet:
            print_phases(steps)


if __name__ == "__main__":
    main()
