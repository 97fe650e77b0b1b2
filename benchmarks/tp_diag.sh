#!/usr/bin/env bash
# Where a run hangs, on the GPU machine, from the repository root (needs the carried .whl/, which
# includes py-spy):
#   LIMIT=150 bash benchmarks/tp_diag.sh OUT_DIR NAME COMMAND...
# Runs COMMAND in its own session, its output in OUT_DIR/NAME.log (each line prefixed with the
# time it was printed, so a slow phase shows). If it is still running after
# LIMIT seconds, writes `py-spy dump --native` of every process of that session (the driver, the
# tensor-parallel ranks, their helpers) plus nvidia-smi and the process tree into ONE file,
# OUT_DIR/NAME.stacks.txt (a device call returns a limited number of files), then kills it.
set -uo pipefail
OUT=$1 NAME=$2
shift 2
LIMIT=${LIMIT:-150}
mkdir -p "$OUT"
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
echo "=== $NAME $(date +%T)"
# shellcheck disable=SC2016
setsid bash -c '"$@" 2>&1 | while IFS= read -r line; do echo "$(date +%T) $line"; done' _ "$@" \
    >"$OUT/$NAME.log" 2>&1 &
pid=$!
for _ in $(seq "$LIMIT"); do
    sleep 1
    kill -0 "$pid" 2>/dev/null || break
done
if kill -0 "$pid" 2>/dev/null; then
    echo "$NAME still running after $LIMIT s: dumping stacks to $OUT/$NAME.stacks.txt"
    {
        ps -o pid,ppid,stat,etime,args --forest -g "$pid"
        nvidia-smi
        for p in $(ps -o pid= -g "$pid"); do
            echo "##### pid $p: $(tr '\0' ' ' </proc/"$p"/cmdline 2>/dev/null | cut -c1-200)"
            timeout 30 "$SPY" dump --native --pid "$p" 2>&1 | head -150
        done
    } >"$OUT/$NAME.stacks.txt" 2>&1
    kill -9 -- -"$pid"
fi
wait "$pid"
echo "$NAME rc=$? $(date +%T)"
