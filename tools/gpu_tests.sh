#!/usr/bin/env bash
# One GPU-host call: stage check, the GPU test suite (kernels, backend, graphs, golden gate) in
# parallel processes (a sticky CUDA error or a hang stays in its own group), then a short decode
# benchmark beside the PyTorch peer. Logs and JSON go to $OUT when set (else ./gpu_out); the
# device tool returns at most 8 files, so the group logs are concatenated into tests.log.
#   bash tools/gpu_tests.sh
#   TEST_GROUPS="gemm attention" BENCH=0 bash tools/gpu_tests.sh
#   BENCH_PRESETS="qwen3-0.6b qwen3-8b" BENCH_BATCHES=1,8,64 bash tools/gpu_tests.sh
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"; export OUT
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1
stage_dsl || exit 3
[ -n "$DSL_PATH" ] && export PYTHONPATH=$DSL_PATH$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried along (gguf for the default model)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
if [ "$(ls /tmp/smol.part.* 2>/dev/null | wc -l)" = "${SMOL_PARTS:-4}" ]; then  # all parts arrived
  cat /tmp/smol.part.* > /tmp/smol.gguf
fi
[ -f /tmp/smol.gguf ] && export CUTEINFER_SMOLLM2_GGUF=/tmp/smol.gguf
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv \
  > "$OUT/gpu.txt"; date -u +%FT%TZ >> "$OUT/gpu.txt"
declare -A G=(
  [gemm]="tests/gpu/test_kernels_gemm.py"
  [attention]="tests/gpu/test_kernels_attention.py"
  [embedding]="tests/gpu/test_kernels_pointwise.py -k embedding"
  [place]="tests/gpu/test_kernels_pointwise.py -k place_tokens"
  [rmsnorm]="tests/gpu/test_kernels_pointwise.py -k rmsnorm"
  [rope]="tests/gpu/test_kernels_pointwise.py -k rope"
  [silu]="tests/gpu/test_kernels_pointwise.py -k silu"
  [sampler]="tests/gpu/test_kernels_pointwise.py -k sampler"
  [logprobs]="tests/gpu/test_kernels_pointwise.py -k logprob"
  [backend]="tests/gpu/test_cuda_backend.py tests/gpu/test_smoke.py"
  [graphs]="tests/gpu/test_graphs.py"
  [gate]="tests/gpu/test_golden_gate.py"
  [odd]="tests/gpu/test_odd_shapes.py"
  [upload]="tests/gpu/test_weight_upload.py tests/gpu/test_staged_inputs.py"
  [logits]="tests/gpu/test_logits_process.py"
  [spec]="tests/gpu/test_speculative.py"
  [dflash]="tests/gpu/test_dflash_cuda.py"
  [mixed]="tests/gpu/test_mixed_steps.py"
  [async]="tests/gpu/test_async.py"
  [read]="tests/gpu/test_read_stream.py"
  [fold]="tests/gpu/test_kernels_pointwise.py -k scale_cols"
)
TEST_GROUPS=${TEST_GROUPS:-"gemm attention embedding place rmsnorm rope silu sampler logprobs backend graphs gate odd upload logits spec dflash mixed async read fold"}
for g in $TEST_GROUPS; do
  args=${G[$g]}
  ( timeout "${GROUP_TIMEOUT:-400}" python3 -m pytest -v -p no:cacheprovider --maxfail=20 \
      --timeout="${TEST_TIMEOUT:-150}" --timeout-method=thread -rs $args > "$LOGS/$g.log" 2>&1
    echo "$g rc=$?" >> "$LOGS/rc.txt" ) &
done
wait
{ for g in $TEST_GROUPS; do echo "=================== $g"; cat "$LOGS/$g.log"; done; } > "$OUT/tests.log"
echo "--- groups"; cat "$LOGS/rc.txt"
echo "--- summaries"; for g in $TEST_GROUPS; do printf "%-11s " "$g"; grep -E "^(=+ )?[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$LOGS/$g.log" | tail -1; done
echo "--- failures"; grep -hE "^(FAILED|ERROR) " "$LOGS"/*.log | cut -c1-220 | head -40
if [ "${BENCH:-1}" = "1" ]; then
  for p in ${BENCH_PRESETS:-qwen3-0.6b}; do
    timeout "${BENCH_TIMEOUT:-300}" python3 -m tools.bench_decode --preset "$p" \
      --batch "${BENCH_BATCHES:-1,8,64}" --ctx "${BENCH_CTX:-1024}" \
      --out "$OUT/bench_$p.json" 2>&1 | grep -v Warning | tail -6
    if [ -f .gpu/peer/peer_torch_decode.py ]; then
      BSS=${BENCH_BATCHES:-1,8,64} CTXS=${BENCH_CTX:-1024} timeout 300 \
        python3 .gpu/peer/peer_torch_decode.py "$p" 2>&1 | tail -4
    fi
  done
fi
for p in ${PROFILE_PRESETS:-}; do
  timeout "${PROFILE_TIMEOUT:-240}" python3 -m engine.cli profile-graphs --preset "$p" \
    --max-num-seqs "${PROFILE_MAX_SEQS:-256}" --max-model-len 2048 --ctx 512 \
    --iters "${PROFILE_ITERS:-50}" ${PROFILE_BUCKETS:+--buckets $PROFILE_BUCKETS} \
    --out "$OUT/graph_profile_$p" 2>&1 | grep -v Warning | tail -14
done
if [ "${SERVE_BENCH:-0}" = "1" ]; then  # the OpenAI server on a qwen3-8b-shaped checkpoint
  python3 -m tools.make_checkpoint --preset "${SERVE_PRESET:-qwen3-8b}" --out /tmp/serve_ckpt \
    --max-shard-size 8
  python3 -m engine.cli serve --model /tmp/serve_ckpt --backend cuda --max-num-seqs 64 \
    --max-model-len 1024 --port 8321 > "$OUT/serve.log" 2>&1 &
  spid=$!
  wait_health 8321 150
  timeout "${SERVE_BENCH_TIMEOUT:-200}" python3 -m tools.bench_serving \
    --base-url http://127.0.0.1:8321 --random-input-len 128 --random-output-len 256 \
    --num-prompts "${SERVE_PROMPTS:-320}" --max-concurrency 64 --ignore-eos \
    --vocab-range 0 150000 --out "$OUT/serve_bench.json" 2>&1 | tail -22
  kill -INT $spid; wait $spid
  tail -5 "$OUT/serve.log"
fi
# at most 8 files come back: pack the JSON and PNG results into one archive
( cd "$OUT" && ls *.json *.png *.jsonl 2>/dev/null | xargs -r tar czf results.tgz \
  && ls *.json *.png *.jsonl 2>/dev/null | xargs -r rm -f )
