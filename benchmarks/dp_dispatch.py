"""Data-parallel dispatch on the CPU: how long a batch takes until every replica has queued its share.

Runs the batchllm workload shape (`phloem.bench.workloads`, 400 groups x 16 by default: 6,400
prompts of 2,200 tokens) through `LLM(data_parallel_size=N)` replicas of a tiny random-weight
Llama (the 8B config with 2 layers of width 64; float32, CPU) and stops the batch at its first
output, so the time measured is the dispatch, not the model (each request asks for one output
token, so that first output comes after a step or two; the tokens dispatched are the workload's). Per N it prints and records:

    build_s      encode and validate the prompts (as `generate` does; the same at every N)
    plan_s       the global prefix plan (`LLM.plan`, timed on its own; the same at every N)
    deal_s       the deal of the plan's groups to the replicas (N > 1)
    sent_s       per replica, from the batch's start (before the deal) to its share sent
    received_s   ... to its share unpacked in the replica
    queued_s     ... to its share queued in its engine (N = 1: planning and queueing the batch)
    dispatch_s   build_s + plan_s + the last replica's queued_s (N = 1: build_s + queued_s):
                 the generate call's time before every replica computes
    outputs_s    the driver's side of the outputs coming back, measured apart: pickling and
                 unpickling one RequestOutput per request as a replica sends it (with its
                 prompt ids, as before; without them, as now)

    OMP_WAIT_POLICY=PASSIVE python benchmarks/dp_dispatch.py --dp 1 2 4 8 --json OUT.json

Results: benchmarks/results/2026-11-26-cpu-dp-dispatch/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)  # fmt: skip
SETTINGS = dict(load_format="dummy", dtype="float32", device="cpu", block_size=16,
                max_num_seqs=2048, max_num_batched_tokens=8192,
                kv_cache_memory_bytes=256 << 20)  # fmt: skip


def _queued_in_process(llm, encoded, params) -> float:
    """DP=1: seconds to plan and queue the batch (`LLM.add_requests`); then aborts it."""
    start = time.perf_counter()
    request_ids = llm.add_requests(encoded, params, validated=True)
    queued_s = time.perf_counter() - start
    llm.llm_engine.abort_request(request_ids)
    return queued_s


def measure(model_dir: str, num_replicas: int, prompts: list, output_lens: list) -> dict:
    """One LLM of `num_replicas` replicas; the dispatch phases of one batch (module docstring)."""
    from phloem import LLM, SamplingParams

    # one output token: the batch's first output (where it is stopped) comes after a step or two
    params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True) for _ in output_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(model_dir, data_parallel_size=num_replicas, **SETTINGS) as llm:
        warm = [{"prompt_token_ids": [5 + r, 6, 7, 8]} for r in range(2 * num_replicas)]
        llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        plan = llm.plan(prompts, params)
        plan_s = time.perf_counter() - start
        build_s = [0.0]

        def build():
            t = time.perf_counter()
            encoded = []
            for item in inputs:
                text, ids = llm.encode_prompt(item)
                llm.llm_engine.validate_prompt(ids)
                encoded.append((text, ids))
            build_s[0] = time.perf_counter() - t
            return encoded, params

        row: dict = {"num_replicas": num_replicas, "plan_s": plan_s,
                     "num_groups": len(plan.groups)}  # fmt: skip
        if num_replicas == 1:
            encoded, _ = build()
            queued = _queued_in_process(llm, encoded, params)
            row.update(build_s=build_s[0], queued_s=queued, dispatch_s=build_s[0] + queued)
            return row  # queued_s includes the plan here
        for _ in llm.run_batch(build, use_tqdm=False):
            break
        report = llm.last_replica_report
        assert report is not None
        replicas = [dataclasses.asdict(s) for s in report.replicas]
        keys = ("replica", "num_requests", "sent_s", "received_s", "queued_s")
        row.update(
            build_s=build_s[0],
            deal_s=report.deal_s,
            replicas=[{k: s[k] for k in keys} for s in replicas],
            dispatch_s=build_s[0] + plan_s + report.dispatch_s,
        )
        return row


def outputs_roundtrip(prompts: list, output_len: int) -> dict:
    """Seconds to pickle and unpickle one RequestOutput per request as a replica sends it: with
    its prompt ids and without them (the driver has them)."""
    from phloem.outputs import CompletionOutput, RequestOutput

    def output(ids: list[int]) -> RequestOutput:
        done = CompletionOutput(0, "", list(range(output_len)), None, None, "length")
        return RequestOutput("r", None, ids, [done], True)

    result = {}
    for name, keep in (("with_prompt_ids", True), ("without_prompt_ids", False)):
        messages = [("output", i, output(p if keep else [])) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        blobs = [pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages]
        dumped = time.perf_counter()
        for b in blobs:
            pickle.loads(b)
        result[name] = {"pickle_s": dumped - start, "unpickle_s": time.perf_counter() - dumped,
                        "bytes": sum(map(len, blobs))}  # fmt: skip
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--num-groups", type=int, default=400)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--label", default="", help="recorded as is (e.g. before / after)")
    args = parser.parse_args()

    from phloem.bench.workloads import make_workload
    from phloem.model_configs import materialize

    tmp = tempfile.mkdtemp(prefix="phloem-dp-dispatch-")
    model_dir = str(materialize("llama-3.1-8b", tmp, **TINY))
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    workload = make_workload("batchllm", vocab, seed=0, num_groups=args.num_groups)
    rows = []
    for n in args.dp:
        row = measure(model_dir, n, workload.prompts, workload.output_lens)
        print(json.dumps(row), flush=True)
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()  # fmt: skip
    result = {
        "label": args.label,
        "commit": commit,
        "workload": {
            "name": "batchllm",
            **workload.shape,
            "num_requests": workload.num_requests,
            "num_input_tokens": workload.num_input_tokens,
        },  # fmt: skip
        "model": {"config": "llama-3.1-8b", **TINY, **SETTINGS},
        "host": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },  # fmt: skip
        "runs": rows,
        "outputs": outputs_roundtrip(workload.prompts, 100),
        "command": "python benchmarks/dp_dispatch.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(result["outputs"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
