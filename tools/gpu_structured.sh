#!/usr/bin/env bash
# bash tools/gpu_structured.sh [PRESET ...] (a warm call: PYTHONPATH set, .whl installed -- llguidance --
# and .tok carried for CUTEINFER_QWEN3_TOKENIZER): issue 17's aim by model size. For each preset
# (default qwen3-0.6b qwen3-1.7b qwen3-8b): tools.bench_structured, 16 of 64 rows under $SCHEMA
# (default records_unbounded), $R runs (default 2) of each of $MODES (default "embedded core":
# the in-process engine with its output processing, and --core-only, the engine core as it runs
# behind the server), alternated; JSON in $OUT/structured_<preset>_<mode>_<run>.json and one line
# a run: structured / plain, penalties / plain, plain ms a token, the structured phase's
# finish_wait (near 0: the host binds), host_loop_ms of both phases (the vCPU's speed: ~4.7 fast,
# 8-10 slow) and the engine's grammar modes (docs/perf.md v32-v34).
set -uo pipefail
export PYTHONUNBUFFERED=1
SCHEMA=${SCHEMA:-records_unbounded}
PRESETS=("$@"); [ ${#PRESETS[@]} -eq 0 ] && PRESETS=(qwen3-0.6b qwen3-1.7b qwen3-8b)
for P in "${PRESETS[@]}"; do
  CK=/tmp/ck_$P
  [ -f $CK/config.json ] || python3 -m tools.make_checkpoint --preset $P --out $CK --max-shard-size 8 --tokenizer 2>&1 | tail -1
  for r in $(seq 1 ${R:-2}); do
    for M in ${MODES:-embedded core}; do
      J=$OUT/structured_${P}_${M}_$r.json
      X=""; [ "$M" = core ] && X=--core-only
      timeout 300 python3 -m tools.bench_structured --model $CK --schema $SCHEMA $X --out $J \
        > /dev/null 2>&1 || { echo "$P $M run $r failed"; continue; }
      python3 - "$J" "$P" "$M" "$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); p, s = d["plain"], d["structured"]
print(sys.argv[2], sys.argv[3], "run", sys.argv[4], "structured", round(d["structured_over_plain"], 3),
      "penalties", round(d["penalties_over_plain"], 3), "plain_ms", round(p["ms_per_token"], 3),
      "structured_finish_wait", s["timeline"]["finish_wait"],
      "host_loop_ms", p.get("host_loop_ms"), s.get("host_loop_ms"),
      "process", d.get("grammar_process"), "gate", d.get("grammar_gate"))
PY
    done
  done
done
