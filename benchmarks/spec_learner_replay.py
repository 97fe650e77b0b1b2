"""Replay a step trace's decode steps into `StepTimeLearner` and compare what it learns with a
least-squares fit of the same samples (issue 20: the learner ended H200 copy-batch-32 runs with
c_draft ~3 us where the fitted step period grows ~32-38 us a draft).

Per decode-only step (every row samples, no prompt chunk) the trace gives the rows
(`decode_seqs`), the drafts (`tokens - decode_seqs`) and the phases. The sample the engine feeds
the learner (`Drafter.launched` + `Drafter.step_done`, no collect-first syncs in these runs) is
schedule + launch + wait + update of the step; KV tokens are not in the trace and are
approximated as rows x `--kv-per-row`. The prior is `step_time_model(SmolLM2-135M, "cuda")`.
The traces of one engine (r0, r1) are replayed into one learner, as the engine keeps it (its
warm-up runs are not in the traces). Each replay runs twice: the default `slope_ema_weight`
and 0.1 (= `ema_weight`, the learner before this benchmark's fix).

    python benchmarks/spec_learner_replay.py TRACE.jsonl [TRACE.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

from phloem.spec_decode.step_time import (
    StepShape,
    StepTimeConfig,
    StepTimeLearner,
    step_time_model,
)

SMOLLM2_135M = SimpleNamespace(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, intermediate_size=1536, vocab_size=49152,
)  # fmt: skip


def decode_samples(path: str, kv_per_row: int) -> list[tuple[StepShape, float]]:
    """The trace's decode-only steps as (shape, sample [s])."""
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "step" not in r or r["prefill_tokens"] or r["decode_seqs"] != r["seqs"]:
                continue
            rows, tokens = r["seqs"], r["tokens"]
            shape = StepShape(rows, tokens, rows * kv_per_row, tokens - rows)
            ms = r["schedule_ms"] + r["launch_ms"] + r["wait_ms"] + r["update_ms"]
            out.append((shape, ms / 1e3))
    return out


def lstsq(samples: list[tuple[StepShape, float]]) -> tuple[float, float, float]:
    """Ordinary least squares of the sample on (1, rows, drafts): (fixed, per row, per draft)
    [s]; normal equations solved by Cramer's rule (3 x 3)."""
    xs = [(1.0, float(s.num_sampled), float(s.num_drafts)) for s, _ in samples]
    ys = [y for _, y in samples]
    a = [[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)]
    b = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(3)]

    def det(m):
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
                - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))  # fmt: skip

    d = det(a)
    if abs(d) < 1e-12:
        return (float("nan"),) * 3
    cols = []
    for k in range(3):
        m = [[b[i] if j == k else a[i][j] for j in range(3)] for i in range(3)]
        cols.append(det(m) / d)
    return cols[0], cols[1], cols[2]


def replay(
    samples: list[tuple[StepShape, float]], config: StepTimeConfig
) -> tuple[StepTimeLearner, dict[str, float]]:
    """A learner fed the samples in order (probes are not replayed: the trace's plain steps are
    the samples there were), and its online error on verify steps: the mean of (its model's
    time before the sample - the sample) [s] over steps of >= 16 rows ("wide") and fewer
    ("narrow"), and its mean c_draft [s] before the wide ones."""
    learner = StepTimeLearner(step_time_model(SMOLLM2_135M, "cuda"), config)
    sums = {"wide": [0.0, 0], "narrow": [0.0, 0], "c_draft_wide": [0.0, 0]}
    for shape, seconds in samples:
        if shape.num_drafts:
            t = learner.model.step_time_s(shape.num_tokens, shape.num_kv_tokens, shape.num_drafts)
            wide = shape.num_sampled >= 16
            for key, value in [("wide" if wide else "narrow", t - seconds),
                               ("c_draft_wide" if wide else "", learner.model.c_draft_s)]:  # fmt: skip
                if key:
                    sums[key][0] += value
                    sums[key][1] += 1
        learner.observe(shape, seconds)
    return learner, {k: (v[0] / v[1] if v[1] else float("nan")) for k, v in sums.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="JSONL step traces of one engine, in run order")
    p.add_argument("--kv-per-row", type=int, default=700, help="KV tokens a row [tokens]")
    args = p.parse_args()
    samples = [s for path in args.traces for s in decode_samples(path, args.kv_per_row)]
    verify = [s for s in samples if s[0].num_drafts]
    fixed, per_row, per_draft = lstsq(samples)
    print(f"decode steps {len(samples)}, verify {len(verify)}")
    print(f"lstsq: fixed {fixed * 1e3:.3f} ms, per row {per_row * 1e6:.1f} us, "
          f"per draft {per_draft * 1e6:.1f} us")  # fmt: skip
    for weight in (StepTimeConfig.slope_ema_weight, StepTimeConfig.ema_weight):
        learner, err = replay(samples, StepTimeConfig(slope_ema_weight=weight))
        m = learner.model
        print(f"learner (slope_ema_weight {weight}) at the end: t_host {m.t_host_s * 1e3:.3f} ms, "
              f"t_verify {m.t_verify_s * 1e3:.3f} ms, c_draft {m.c_draft_s * 1e6:.1f} us; "
              f"online model - sample on verify steps: wide {err['wide'] * 1e3:.2f} ms, "
              f"narrow {err['narrow'] * 1e3:.2f} ms; c_draft before wide ones "
              f"{err['c_draft_wide'] * 1e6:.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
