#!/usr/bin/env bash
# bash tools/gpu_server_startup.sh CKPT_DIR: the OpenAI server's time to /health 200 from process
# start, with the kernel cache emptied (cold) and then filled (warm, twice); weights in the page cache.
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"
CK=$1; PORT=${PORT:-8323}; export PYTHONUNBUFFERED=1
# byte-compile the staged DSL once, as pip does at install (the host's copy has no .pyc files)
[ -d /tmp/site ] && python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
K=$(python3 -c 'from engine import envs; print(envs.kernel_cache_dir())')
cat $CK/*.safetensors > /dev/null  # into the page cache
for mode in cold warm warm; do
  [ $mode = cold ] && rm -rf "$K"
  t0=$(date +%s.%N)
  python3 -m engine.cli serve --model $CK --backend cuda --max-num-seqs 64 --max-model-len 1024 \
    --port $PORT > "$OUT/startup_$mode.log" 2>&1 &
  spid=$!
  wait_health $PORT 90
  t1=$(date +%s.%N); echo "$(basename $CK) server ready ($mode kernel cache) in $(python3 -c "print(round($t1-$t0,2))") s"
  grep -E "compiled|captured|ready|weights" "$OUT/startup_$mode.log" | head -4
  kill -INT $spid; wait $spid
done
