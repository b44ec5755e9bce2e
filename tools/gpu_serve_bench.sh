#!/usr/bin/env bash
# bash tools/gpu_serve_bench.sh PRESET (a warm call with .whl, and .tok for the Qwen3 tokenizer: CUTEINFER_QWEN3_TOKENIZER):
# server ready time, serving (text and ids), offline LLM.generate, replay.
# Env: SERVE_ARGS (more server options), TAG (suffix of the output names), KINDS ("words ids"),
# BENCH_ARGS (more tools.bench_serving options, e.g. --save-detailed),
# OFFLINE_ARGS (tools.bench_offline options, e.g. --mixed-step-tokens 128), OFFLINE=0 / REPLAY=0 skip
# those parts; the engine core writes its step trace to
# $OUT/trace_$P$TAG.txt (CUTEINFER_STEP_TRACE; tools/step_trace.py reads it: $OUT/steps_$P$TAG.json,
# with the ITL tail by step kind when BENCH_ARGS has --save-detailed).
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"
P=$1; PORT=8321; export PYTHONUNBUFFERED=1; TAG=${TAG:-}
export CUTEINFER_STEP_TRACE=$OUT/trace_$P$TAG.txt
# SSE_TRACE=1: the front end's delivery tracepoints too (step_trace's ``delivery``)
[ "${SSE_TRACE:-0}" = 1 ] && export CUTEINFER_ADMIT_TRACE=$OUT/admit_$P$TAG.txt
CK=/tmp/ck_$P
[ -f $CK/config.json ] || python3 -m tools.make_checkpoint --preset $P --out $CK --max-shard-size 8 --tokenizer 2>&1 | tail -1
t0=$(date +%s.%N)
python3 -m engine.cli serve --model $CK --backend cuda --max-num-seqs 64 --max-model-len 1024 \
  --port $PORT ${SERVE_ARGS:-} > "$OUT/serve_$P$TAG.log" 2>&1 &
spid=$!
wait_health $PORT 90
t1=$(date +%s.%N); echo "$P server ready in $(python3 -c "print(round($t1-$t0,2))") s"
for kind in ${KINDS:-words ids}; do
  timeout 200 python3 -m tools.bench_serving --base-url http://127.0.0.1:$PORT --random-input-len 128 \
    --random-output-len 256 --num-prompts ${PROMPTS:-320} --max-concurrency 64 --ignore-eos \
    --prompt-kind $kind --vocab-range 0 150000 ${BENCH_ARGS:-} --out "$OUT/serve_${P}${TAG}_$kind.json" 2>&1 | grep -E "tok/s|TPOT|ITL|TTFT|Successful|Failed" | head -20
done
curl -s http://127.0.0.1:$PORT/metrics 2>/dev/null | grep -E "^cuteinfer.*(steps|preempt)" | head -5
kill -INT $spid; wait $spid; echo "serve exit $?"; tail -3 "$OUT/serve_$P$TAG.log"
unset CUTEINFER_STEP_TRACE CUTEINFER_ADMIT_TRACE
REQ=""; case "${BENCH_ARGS:-}" in *--save-detailed*) REQ="--requests $OUT/serve_$P${TAG}_${KINDS%% *}.json";; esac
[ -f "$OUT/admit_$P$TAG.txt" ] && REQ="$REQ --admit-trace $OUT/admit_$P$TAG.txt"
python3 -m tools.step_trace "$OUT/trace_$P$TAG.txt" $REQ --json "$OUT/steps_$P$TAG.json" > /dev/null 2>&1
rm -f "$OUT/admit_$P$TAG.txt"  # (large: its summary is in steps_*.json)
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({k: d[k] for k in ('graph', 'eager', 'itl_tail', 'delivery') if k in d}))" "$OUT/steps_$P$TAG.json" 2>&1 | tail -3
[ "${OFFLINE:-1}" = 0 ] || timeout 240 python3 -m tools.bench_offline --model $CK --num-prompts ${PROMPTS:-320} ${OFFLINE_ARGS:-} --out "$OUT/offline_$P$TAG.json" 2>&1 | tail -1
[ "${REPLAY:-1}" = 0 ] || timeout 200 python3 -m tools.bench_decode --preset $P --batch 1,64 --ctx 256 --out "$OUT/replay_$P$TAG.json" 2>&1 | grep -v Warning | tail -3
