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
import dataclasses
import json
import math
from types import SimpleNamespace

from phloem.spec_decode.cost_rule import (
    CostRuleConfig,
    DraftCandidate,
    StepTimeModel,
    uniform_num_drafts,
)
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


def lstsq(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Ordinary least squares of `ys` on the regressors `rows` (one tuple a sample): the
    coefficients, by Gaussian elimination of the normal equations (NaN where singular)."""
    n = len(rows[0])
    a = [[sum(x[i] * x[j] for x in rows) for j in range(n)] + [sum(x[i] * y for x, y in zip(rows, ys))]
         for i in range(n)]  # fmt: skip
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return [float("nan")] * n
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [u - f * v for u, v in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit(samples: list[tuple[StepShape, float]]) -> dict[str, float]:
    """The least-squares terms [s] of the samples: (1, rows, drafts) as before this benchmark's
    second version, and (1, [drafts > 0], rows, drafts), the learner's terms, with the root
    mean square of the latter's residual ("rms", in sample: the noise floor of a prediction)."""
    ys = [y for _, y in samples]
    three = lstsq([(1.0, s.num_sampled, s.num_drafts) for s, _ in samples], ys)
    four = lstsq(
        [(1.0, float(s.num_drafts > 0), s.num_sampled, s.num_drafts) for s, _ in samples], ys
    )
    predicted = [four[0] + four[1] * (s.num_drafts > 0) + four[2] * s.num_sampled
                 + four[3] * s.num_drafts for s, _ in samples]  # fmt: skip
    rms = math.sqrt(sum((p - y) ** 2 for p, y in zip(predicted, ys)) / len(ys))
    return {"fixed3": three[0], "row3": three[1], "draft3": three[2], "fixed": four[0],
            "verify": four[1], "row": four[2], "draft": four[3], "rms": rms}  # fmt: skip


def replay(
    samples: list[tuple[StepShape, float]], config: StepTimeConfig, prior: StepTimeModel
) -> tuple[StepTimeLearner, dict[str, float]]:
    """A learner fed the samples in order (probes are not replayed: the trace's plain steps are
    the samples there were), and its online error: (its model's time before the sample - the
    sample) [s], mean ("bias") and root mean square, over plain steps and verify steps of >= 16
    rows ("wide") and fewer ("narrow"), and all of them."""
    learner = StepTimeLearner(prior, config)
    errors: dict[str, list[float]] = {"plain": [], "wide": [], "narrow": [], "all": []}
    for shape, seconds in samples:
        t = learner.model.step_time_s(shape.num_tokens, shape.num_kv_tokens, shape.num_drafts)
        kind = "plain" if not shape.num_drafts else "wide" if shape.num_sampled >= 16 else "narrow"
        errors[kind].append(t - seconds)
        errors["all"].append(t - seconds)
        learner.observe(shape, seconds)
    out = {}
    for kind, e in errors.items():
        out[kind + "_bias"] = sum(e) / len(e) if e else float("nan")
        out[kind + "_rms"] = math.sqrt(sum(x * x for x in e) / len(e)) if e else float("nan")
    return learner, out


# the copy batch's acceptance: a request's first draft and each after it (`DraftCandidate`)
CHAINS = {"hot 0.9/0.9": (0.9, 0.9), "cold 0.5/0.8": (0.5, 0.8)}


def picks(model: StepTimeModel, k: int, kv_per_row: int) -> str:
    """The rule's drafts when every row drafts (`uniform_num_drafts`: (sum, most a row)) at 32,
    8, 4 and 2 rows, per chain of `CHAINS`."""
    config = CostRuleConfig(max_draft_tokens=k)
    out = []
    for name, (a, c) in CHAINS.items():
        cells = []
        for rows in (32, 8, 4, 2):
            total, most = uniform_num_drafts(
                DraftCandidate(a, k, c), rows, rows, rows, rows * kv_per_row, model, config
            )
            cells.append(f"{rows}:{most}")
        out.append(f"{name} " + " ".join(cells))
    return "; ".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="JSONL step traces of one engine, in run order")
    p.add_argument("--kv-per-row", type=int, default=700, help="KV tokens a row [tokens]")
    p.add_argument("--k", type=int, default=16, help="num_speculative_tokens of the run")
    args = p.parse_args()
    samples = [s for path in args.traces for s in decode_samples(path, args.kv_per_row)]
    verify = [s for s in samples if s[0].num_drafts]
    f = fit(samples)
    print(f"decode steps {len(samples)}, verify {len(verify)}")
    print(f"lstsq (1, R, D): fixed {f['fixed3'] * 1e3:.3f} ms, per row {f['row3'] * 1e6:.1f} us, "
          f"per draft {f['draft3'] * 1e6:.1f} us")  # fmt: skip
    print(f"lstsq (1, [D>0], R, D): fixed {f['fixed'] * 1e3:.3f} ms, verify {f['verify'] * 1e3:.3f} "
          f"ms, per row {f['row'] * 1e6:.1f} us, per draft {f['draft'] * 1e6:.1f} us; rms "
          f"{f['rms'] * 1e3:.2f} ms (in sample)")  # fmt: skip
    fitted = StepTimeModel(t_host_s=f["fixed"], t_weights_s=0.0, c_token_s=0.0, c_kv_s=0.0,
                           c_draft_s=max(0.0, f["draft"]), t_verify_s=max(0.0, f["verify"]),
                           c_row_s=max(0.0, f["row"]))  # fmt: skip
    print(f"  rule on the fit, rows:most drafts a row: {picks(fitted, args.k, args.kv_per_row)}")
    prior = step_time_model(SMOLLM2_135M, "cuda")
    padded = dataclasses.replace(prior, verify_widths=(args.k,), verify_max_rows=64)
    for name, config, model in [
        ("before (no row term)", StepTimeConfig(row_min_var=math.inf), prior),
        ("after", StepTimeConfig(), prior),
        (f"after, widths ({args.k},)", StepTimeConfig(), padded),
    ]:
        learner, err = replay(samples, config, model)
        m = learner.model
        print(f"learner {name}: t_host {m.t_host_s * 1e3:.3f} ms, t_verify {m.t_verify_s * 1e3:.3f}"
              f" ms, c_row {m.c_row_s * 1e6:.1f} us, c_draft {m.c_draft_s * 1e6:.1f} us")  # fmt: skip
        print("  online model - sample, bias / rms ms: " + ", ".join(
            f"{kind} {err[kind + '_bias'] * 1e3:+.2f} / {err[kind + '_rms'] * 1e3:.2f}"
            for kind in ("plain", "wide", "narrow", "all")))  # fmt: skip
        print(f"  rule, rows:most drafts a row: {picks(m, args.k, args.kv_per_row)}")


if __name__ == "__main__":
    main()
