#!/usr/bin/env bash
# Old-vs-new throughput A/B on the GPU machine in one call, interleaved old/new/old/new, from the
# repository root (the new tree) with the old tree's `phloem/` extracted beside it:
#   git archive OLD_COMMIT phloem | tar -x -C .old        # here, then carry .old
#   WORKLOADS="batchllm:100 shared-prefix" ROUNDS=2 bash benchmarks/ab_device.sh OUT_DIR
# Each run is `phloem bench throughput` on Llama-3.1-8B shapes with random weights, run from the
# tree's own directory (`python -m` puts the working directory first on sys.path, so each run
# imports its own package), one process per run. WORKLOAD is a `--workload` name, with
# `:N` giving `--num-groups N`. Prints requests/s of every run and new/old per round.
# Needs the carried .whl/ (see device_setup.sh).
set -uo pipefail
OUT=${1:-/tmp/phloem_ab}
WORKLOADS=${WORKLOADS:-"batchllm:100 shared-prefix"}
ROUNDS=${ROUNDS:-2}
OLD=${OLD:-.old}
ENGINE_ARGS=${ENGINE_ARGS:-"--max-num-seqs 2048 --max-num-batched-tokens 8192"}
LIMIT=${LIMIT:-200}
source benchmarks/device_setup.sh || exit 1
NEW=$PWD
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -d "$OLD/phloem" ] || { echo "no $OLD/phloem: extract the old tree first"; exit 1; }
OLD=$(cd "$OLD" && pwd)
for workload in $WORKLOADS; do
    IFS=: read -r name groups <<<"$workload"
    wargs="--workload $name${groups:+ --num-groups $groups}"
    for round in $(seq "$ROUNDS"); do
        for side in old new; do
            dir=$NEW && [ "$side" = old ] && dir=$OLD
            json="$OUT/$name${groups:+-g$groups}-$side-$round.json"
            echo "=== $side round $round $workload $(date +%T)"
            # shellcheck disable=SC2086
            (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$LIMIT" python3 -m \
                phloem.entrypoints.bench throughput --model llama-3.1-8b $wargs $ENGINE_ARGS \
                --json "$json" 2>&1 | grep -v -i warn | tail -3)
        done
    done
done
python3 - "$OUT" <<'EOF'
import glob, json, os, re, sys
runs = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    m = re.match(r"(.+)-(old|new)-(\d+)\.json$", os.path.basename(path))
    if m:
        with open(path) as f:
            runs.setdefault(m[1], {}).setdefault(int(m[3]), {})[m[2]] = json.load(f)["requests_per_s"]
for workload, rounds in runs.items():
    for r, sides in sorted(rounds.items()):
        old, new = sides.get("old"), sides.get("new")
        ratio = f"{new / old:.4f}" if old and new else "n/a"
        print(f"{workload} round {r}: old {old} req/s, new {new} req/s, new/old {ratio}")
EOF
echo "=== done $(date +%T)"
