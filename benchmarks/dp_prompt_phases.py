"""The parent's serial work in `LLM.generate` before any model step, timed through the real call.

`generate` on the batchllm shape (400 groups x 16 = 6,400 prompts of 2,200 tokens, as token
ids) with the tiny model and settings of `benchmarks/dp_dispatch.py`; a subclass of `LLM`
notes the time where `generate` hands the checked batch on (`_start_batch`) and times
`LLM.plan` as `_start_batch` calls it, then stops the batch before anything is sent or run
(DP=1: after the batch is queued, then aborted). Per run it records:

    build_s   encode + check every prompt (`generate`'s loop, whatever this tree does there)
    plan_s    the global prefix plan, as `_start_batch` makes it
    start_s   `_start_batch` in all (the plan, and at DP=1 queueing the batch)

It measures whichever `phloem` is imported (run it with PYTHONPATH pointing at an older
tree's checkout for the before numbers):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/dp_prompt_phases.py --dp 1 8 --repeat 3

Results: benchmarks/results/2026-11-26-cpu-dp-dispatch/README.md ("The parent's prompt check
and plan").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dp_dispatch import SETTINGS, TINY  # noqa: E402


class _Stop(Exception):
    """Raised out of `_start_batch` once it has returned: the batch is not run."""


def measure(model_dir: str, num_replicas: int, prompts: list, repeat: int) -> list[dict]:
    """`repeat` timed `generate` calls (stopped before the model) on one LLM."""
    from phloem import LLM, SamplingParams

    class PhaseTimedLLM(LLM):
        def plan(self, *args, **kwargs):
            start = time.perf_counter()
            plan = super().plan(*args, **kwargs)
            self.marks["plan_s"] = time.perf_counter() - start
            return plan

        def _start_batch(self, encoded, params, use_tqdm):
            self.marks["built"] = time.perf_counter()
            outputs = super()._start_batch(encoded, params, use_tqdm)
            self.marks["started"] = time.perf_counter()
            outputs.close()  # not iterated: nothing was sent to a replica
            raise _Stop

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    rows = []
    with PhaseTimedLLM(model_dir, data_parallel_size=num_replicas, **SETTINGS) as llm:
        llm.marks = {}
        for _ in range(repeat):
            llm.marks = {}
            start = time.perf_counter()
            try:
                llm.generate(inputs, params, use_tqdm=False)
            except _Stop:
                pass
            m = llm.marks
            rows.append({"num_replicas": num_replicas, "build_s": m["built"] - start,
                         "plan_s": m["plan_s"], "start_s": m["started"] - m["built"]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            if num_replicas == 1:
                engine = llm.llm_engine
                engine.abort_request(list(engine._prompts))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-groups", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    import phloem
    from phloem.bench.workloads import make_workload
    from phloem.model_configs import materialize

    print("phloem from", os.path.dirname(phloem.__file__), flush=True)
    tmp = tempfile.mkdtemp(prefix="phloem-dp-phases-")
    model_dir = str(materialize("llama-3.1-8b", tmp, **TINY))
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    workload = make_workload("batchllm", vocab, seed=0, num_groups=args.num_groups)
    rows = [r for n in args.dp for r in measure(model_dir, n, workload.prompts, args.repeat)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"phloem": os.path.dirname(phloem.__file__), "runs": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
