#!/usr/bin/env bash
# bash tools/gpu_shared_prefix.sh CKPT_DIR: 256 concurrent requests over two shared 3,000-token
# prompts (+32-token questions, 64 out) against the OpenAI server, then one fresh request.
set -uo pipefail
source "$(dirname "$0")/gpu_lib.sh"
CK=$1; PORT=${PORT:-8324}; export PYTHONUNBUFFERED=1
python3 -m engine.cli serve --model $CK --backend cuda --max-num-seqs 256 --max-model-len 4096 \
  --port $PORT > "$OUT/shared_prefix_server.log" 2>&1 &
spid=$!
wait_health $PORT 90
timeout 200 python3 -m tools.bench_shared_prefix --base-url http://127.0.0.1:$PORT --clients 256 \
  --prefixes 2 --prefix-len 3000 --question-len 32 --output-len 64 --out "$OUT/shared_prefix.json"
kill -INT $spid; wait $spid; tail -2 "$OUT/shared_prefix_server.log"
