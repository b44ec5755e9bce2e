#!/usr/bin/env bash
# One GPU-host call (carry .gpu): goldens, the whole GPU suite (+odd shapes), decode bench + peer, warm-cache rerun
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
( time timeout 200 python3 -m tools.make_goldens --out /tmp/goldens_new ) > "$OUT/goldens.log" 2>&1 \
  && cp /tmp/goldens_new/* tests/goldens/ && tar czf "$OUT/goldens.tgz" tests/goldens
tail -3 "$OUT/goldens.log"
BENCH_PRESETS="qwen3-0.6b qwen3-8b" BENCH_BATCHES=1,64 bash tools/gpu_tests.sh
K=$(python3 -c 'from engine import envs; print(envs.kernel_cache_dir())')
echo "kernel cache entries: $(ls $K/*.json | wc -l)"
mkdir -p "$OUT/warm"
OUT=$OUT/warm TEST_GROUPS="backend graphs gate odd" BENCH=0 bash tools/gpu_tests.sh 2>&1 | tail -12
echo "kernel cache entries after the warm run: $(ls $K/*.json | wc -l)"
( time python3 -m engine.cli warmup --preset qwen3-8b ) 2>&1 | tail -4
