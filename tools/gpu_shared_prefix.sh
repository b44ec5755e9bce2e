#!/usr/bin/env bash
# bash tools/gpu_shared_prefix.sh CKPT_DIR: 256 concurrent requests over two shared 3,000-token
# prompts (+32-token questions, 64 out) against the OpenAI server, then one fresh request.
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"
CK=$1; PORT=${PORT:-8324}; export PYTHONUNBUFFERED=1
export CUTEINFER_STEP_TRACE=$OUT/trace_shared_prefix.txt  # the engine core's steps
export CUTEINFER_ADMIT_TRACE=$OUT/admit_trace.txt  # where each request is (engine/tracepoints.py)
# PROFILE=1: the server's main thread (the event loop) under cProfile, top functions printed
PROF=""; [ "${PROFILE:-0}" = 1 ] && PROF="-m cProfile -o $OUT/frontend.prof"
python3 $PROF -m engine.cli serve --model $CK --backend ${BACKEND:-cuda} --max-num-seqs 256 --max-model-len 4096 ${SERVE_ARGS:-} \
  --port $PORT > "$OUT/shared_prefix_server.log" 2>&1 &
spid=$!
wait_health $PORT 90
timeout 200 python3 -m tools.bench_shared_prefix --base-url http://127.0.0.1:$PORT --clients ${CLIENTS:-256} \
  --prefixes 2 --prefix-len ${PREFIX_LEN:-3000} --question-len 32 --output-len 64 --out "$OUT/shared_prefix.json"
kill -INT $spid; wait $spid; tail -2 "$OUT/shared_prefix_server.log"
unset CUTEINFER_STEP_TRACE CUTEINFER_ADMIT_TRACE
python3 - "$OUT/admit_trace.txt" "$OUT/shared_prefix.json" <<'PY'
import json, sys
import numpy as np
t0 = json.load(open(sys.argv[2]))["burst_start"]
ev: dict = {}
for line in open(sys.argv[1]):
    e, t, _pid, *d = line.split()
    n = int(d[0]) if e in ("flush", "core", "admitted") and d else 1
    ev.setdefault(e, []).extend([float(t) - t0] * n)
print("admission points, seconds after the burst (requests: first / p50 / p90 / last)")
for e in ("http", "add", "drain", "flush", "core", "admitted"):
    v = [x for x in ev.get(e, []) if x > -1]
    if v:
        q = np.percentile(v, [0, 50, 90, 100])
        print(f"  {e:9s} n={len(v):4d} " + " ".join(f"{x:7.3f}" for x in q))
PY
python3 -m tools.step_trace "$OUT/trace_shared_prefix.txt" --json "$OUT/trace_shared_prefix.json" | head -40
[ "${PROFILE:-0}" = 1 ] && python3 -c "
import pstats; p = pstats.Stats('$OUT/frontend.prof'); p.sort_stats('tottime').print_stats(30)" | tail -45
