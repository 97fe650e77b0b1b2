"""Roofline ratio of `phloem bench throughput` results, per workload and engine setting, as bars.

    python benchmarks/plot_batchllm.py OUT.png RESULT.json [RESULT.json ...]

Each JSON is grouped by its workload and shape (e.g. "batchllm 400x16") and labeled by its
attention backend, prefix sharing and scheduling. The peer bars are vLLM 0.26.0 (prefix caching
on, H200, Llama-3.1-8B shapes) as *reported in issue 5*, not measured by this script; the dashed
line is the issue's goal for phloem. Ratios are comparable across runs and GPUs (each run measures
its own ceilings); requests/s are printed on the bars.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (workload, groups, degree) -> (requests/s, roofline ratio) of vLLM 0.26.0 on an H200 (issue 5)
VLLM_REPORTED = {
    ("batchllm", 400, 16): (38.8, 0.31),
    ("batchllm", 100, 64): (61.0, 0.39),
    ("batchllm", 100, 16): (54.8, 0.44),
    ("shared-prefix", 64, 16): (32.2, 0.32),
}
GOALS = {"batchllm": 0.70, "shared-prefix": 0.60}


def label(result: dict) -> str:
    engine = result["engine"]
    if result["prefix_tokens_reused"] == 0:
        return "phloem, no prefix sharing"
    name = (
        "phloem, shared-prefix attn"
        if engine["attention_backend"] == "shared_prefix"
        else (f"phloem, {engine['attention_backend']} attn")
    )
    if not engine.get("async_scheduling", False):
        name += ", sync"
    return name


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, paths = argv[0], argv[1:]
    groups: dict[tuple, dict[str, dict]] = {}
    for path in paths:
        r = json.loads(Path(path).read_text())
        shape = r["shape"]
        key = (r["workload"], shape.get("num_groups"), shape.get("degree"))
        groups.setdefault(key, {})[label(r)] = r
    labels = sorted({name for g in groups.values() for name in g}) + ["vLLM 0.26.0 (reported)"]
    colors = dict(zip(labels, plt.cm.tab10.colors))
    fig, ax = plt.subplots(figsize=(3 + 2.2 * len(groups), 4.5))
    width = 0.8 / len(labels)
    keys = sorted(groups)
    shown: set[str] = set()
    for gi, key in enumerate(keys):
        bars = {name: (r["requests_per_s"], r["roofline_ratio"], r["device"])
                for name, r in groups[key].items()}  # fmt: skip
        if key in VLLM_REPORTED:
            bars["vLLM 0.26.0 (reported)"] = (*VLLM_REPORTED[key], "H200")
        for li, name in enumerate(labels):
            if name not in bars:
                continue
            rps, ratio, device = bars[name]
            x = gi + (li - (len(labels) - 1) / 2) * width
            ax.bar(x, ratio, width, color=colors[name], label=None if name in shown else name)
            shown.add(name)
            ax.text(x, ratio + 0.01, f"{rps:.0f}/s", ha="center", fontsize=7, rotation=90)
        goal = GOALS.get(key[0])
        if goal:
            ax.hlines(goal, gi - 0.45, gi + 0.45, colors="red", linestyles="dashed")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{w}\n{g} groups x {d}" for w, g, d in keys])
    ax.set_ylabel("roofline ratio (1.0 = physical limit)")
    devices = sorted({r["device"] for g in groups.values() for r in g.values()})
    ax.set_title(f"Llama-3.1-8B shapes on {', '.join(devices)}; red dashes: goal (issue 5)")
    ax.set_ylim(0, 1)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles, names, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
