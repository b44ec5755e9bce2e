#!/usr/bin/env bash
# bash tools/gpu_startup.sh (the SmolLM2 GGUF in /tmp/smol.part.*): the embedded default model (SmolLM2 GGUF): generate warm and cold; 8b cold server start
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"
export PYTHONUNBUFFERED=1
cat /tmp/smol.part.0* > /tmp/smol.gguf && ls -la /tmp/smol.gguf
export CUTEINFER_SMOLLM2_GGUF=/tmp/smol.gguf
K=$(python3 -c 'from engine import envs; print(envs.kernel_cache_dir())')
( time python3 -m engine.cli warmup ) 2>&1 | tail -4
for i in 1 2; do
  ( time python3 -m engine.cli generate "What is the capital of France?" --backend cuda ) 2>&1 | tail -8
done
rm -rf "$K"
echo "--- cold (kernel cache emptied)"
( time python3 -m engine.cli generate "What is the capital of France?" --backend cuda ) 2>&1 | tail -8
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_smoke.py 2>&1 | tail -3
if [ -f /tmp/ck_qwen3-8b/config.json ]; then
  rm -rf "$K"; t0=$(date +%s.%N)
  python3 -m engine.cli serve --model /tmp/ck_qwen3-8b --backend cuda --max-num-seqs 64 --max-model-len 1024 --port 8322 > "$OUT/serve_cold.log" 2>&1 &
  spid=$!
  wait_health 8322 90
  t1=$(date +%s.%N); echo "qwen3-8b server ready (cold kernel cache) in $(python3 -c "print(round($t1-$t0,2))") s"
  kill -INT $spid; wait $spid
fi
