"""Trace of the drafter's pre-check on the GPU-like paced model (README section 2): per step the
answer, the global rate, the rate after an accepted draft, the offer rate, the learned t_host and
t_verify [ms], the steps off and the verify steps so far.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/results/2026-11-26h-cpu-spec-gpu-gaps/trace_suffix.py suffix
"""

import sys

sys.path.insert(0, "benchmarks")  # run from the repository root
import spec_overhead_paced as sp

from phloem.spec_decode import drafter as D

log = []
orig = D.Drafter.may_draft


def may(self, running):
    r = orig(self, running)
    m = self.time_model
    log.append(
        (
            r,
            round(self.tracker.global_rate, 2),
            round(self.tracker.global_after_accept, 2),
            round(self.offer_rate, 2),
            round(m.t_host_s * 1e3, 2),
            round(m.t_verify_s * 1e3, 2),
            self._steps_off,
            self.stats.num_spec_steps,
        )
    )
    return r


D.Drafter.may_draft = may
method = sys.argv[1]
sp.main(
    [
        "--scale",
        "smol",
        "--workload",
        "copy",
        "--batch",
        "32",
        "--max-tokens",
        "192",
        "--repeats",
        "1",
        "--engines",
        "off",
        method,
        "--host-ms",
        "1.5",
        "--verify-ms",
        "1.0",
    ]
)
for i, row in enumerate(log):
    if i < 40 or i % 10 == 0:
        print(i, row)
