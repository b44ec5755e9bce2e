#!/usr/bin/env bash
# bash tools/gpu_structured.sh [PRESET ...] (a warm call: PYTHONPATH set, .whl installed -- llguidance --
# and .tok carried for CUTEINFER_QWEN3_TOKENIZER): issue 17's aim by model size. For each preset
# (default qwen3-0.6b qwen3-1.7b qwen3-8b): tools.bench_structured, 16 of 64 rows under $SCHEMA
# (default records_unbounded), $R runs (default 2); JSON in $OUT/structured_<preset>_<run>.json and
# one line a run: structured / plain, penalties / plain, plain ms a token, the structured phase's
# finish_wait (near 0: the host binds) and host_loop_ms of both phases (docs/perf.md v32).
set -uo pipefail
export PYTHONUNBUFFERED=1
SCHEMA=${SCHEMA:-records_unbounded}
PRESETS=("$@"); [ ${#PRESETS[@]} -eq 0 ] && PRESETS=(qwen3-0.6b qwen3-1.7b qwen3-8b)
for P in "${PRESETS[@]}"; do
  CK=/tmp/ck_$P
  [ -f $CK/config.json ] || python3 -m tools.make_checkpoint --preset $P --out $CK --max-shard-size 8 --tokenizer 2>&1 | tail -1
  for r in $(seq 1 ${R:-2}); do
    J=$OUT/structured_${P}_$r.json
    timeout 300 python3 -m tools.bench_structured --model $CK --schema $SCHEMA --out $J > /dev/null 2>&1 \
      || { echo "$P run $r failed"; continue; }
    python3 - "$J" "$P" "$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); p, s = d["plain"], d["structured"]
print(sys.argv[2], "run", sys.argv[3], "structured", round(d["structured_over_plain"], 3),
      "penalties", round(d["penalties_over_plain"], 3), "plain_ms", round(p["ms_per_token"], 3),
      "structured_finish_wait", s["timeline"]["finish_wait"],
      "host_loop_ms", p.get("host_loop_ms"), s.get("host_loop_ms"))
PY
  done
done
