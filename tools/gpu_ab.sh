#!/usr/bin/env bash
# A change against its baseline on the same card: one command run over two trees, alternating,
# in one GPU-host call (timings from different hosts do not compare). The baseline is a
# `git archive` of a revision, made here and carried along:
#   git archive REV engine cutlass_kernels graphs tools pyproject.toml | xz > .xtra/base.tar.xz
#   BASE=.xtra/base.tar.xz ROUNDS=2 bash tools/gpu_ab.sh \
#       python3 -m tools.bench_offline --model /tmp/ck --backend cuda --out "$OUT/off_{tag}.json"
# Each run starts in its tree's root with that tree first on PYTHONPATH (after the staged CuTe
# DSL bundle, when there is one); "{tag}" in an argument becomes new1, base1, new2, ... Prints
# the last TAIL (default 3) lines of each run under a header naming its tree and round. Run a module
# (`python3 -m ...`), not a wrapper script: `python3 /path/x.py` puts x.py's directory first on
# sys.path, so both rounds would import that tree's engine (docs/perf.md v31, call 6).
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"
cd "$(dirname "$0")/.."
[ -n "${BASE:-}" ] && [ -f "$BASE" ] || { echo "BASE=<a git archive .tar.xz> is required"; exit 2; }
[ $# -gt 0 ] || { echo "usage: BASE=archive.tar.xz bash tools/gpu_ab.sh CMD [ARGS...]"; exit 2; }
stage_dsl || exit 3
base=$(mktemp -d /tmp/ab_base.XXXX)
trap 'rm -rf "$base"' EXIT
tar xJf "$BASE" -C "$base" || { echo "cannot unpack $BASE"; exit 2; }
new=$PWD
for r in $(seq 1 "${ROUNDS:-1}"); do
  for pair in "new:$new" "base:$base"; do
    name=${pair%%:*}; tree=${pair#*:}
    args=()
    for a in "$@"; do args+=("${a//\{tag\}/$name$r}"); done
    echo "=== $name$r ($tree)"
    ( cd "$tree" && PYTHONPATH=$DSL_PATH$tree PYTHONUNBUFFERED=1 \
        timeout "${RUN_TIMEOUT:-300}" "${args[@]}" 2>&1 | grep -v Warning | tail -n "${TAIL:-3}" )
  done
done
