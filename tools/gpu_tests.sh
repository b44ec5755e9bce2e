#!/usr/bin/env bash
# One GPU-host call: stage check, the GPU test suite (kernels, backend, golden gate), and a short
# decode benchmark beside the PyTorch peer. Logs and JSON go to $OUT when set (else ./gpu_out).
#   bash tools/gpu_tests.sh                  # everything
#   TESTS="tests/gpu/test_kernels_gemm.py" BENCH=0 bash tools/gpu_tests.sh
#   BENCH_PRESETS="qwen3-0.6b qwen3-8b" BENCH_BATCHES=1,8,64 bash tools/gpu_tests.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1
if [ -f .gpu/stage.sh ] || [ -f /tmp/site/.ok ]; then
  bash .gpu/stage.sh 2>/dev/null || bash -c '[ -f /tmp/site/.ok ]' || { echo "stage failed"; exit 3; }
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# wheels carried in .whl (e.g. gguf) and the SmolLM2 GGUF reassembled from parts in /tmp
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
if ls /tmp/smol.part.* >/dev/null 2>&1 && [ ! -f /tmp/smol.gguf ]; then
  cat /tmp/smol.part.* > /tmp/smol.gguf
fi
[ -f /tmp/smol.gguf ] && export CUTEINFER_SMOLLM2_GGUF=/tmp/smol.gguf
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv \
  | tee "$OUT/gpu.txt"
date -u +%FT%TZ >> "$OUT/gpu.txt"
rc=0
TESTS=${TESTS:-tests/gpu}
if [ "$TESTS" != "none" ]; then
  python3 -m pytest -q -x -p no:cacheprovider $TESTS -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [ "${BENCH:-1}" = "1" ]; then
  for p in ${BENCH_PRESETS:-qwen3-0.6b}; do
    python3 -m tools.bench_decode --preset "$p" --batch "${BENCH_BATCHES:-1,8,64}" \
      --ctx "${BENCH_CTX:-1024}" --out "$OUT/bench_$p.json" 2>&1 | tail -8
    if [ -f .gpu/peer/peer_torch_decode.py ]; then
      BSS=${BENCH_BATCHES:-1,8,64} CTXS=${BENCH_CTX:-1024} \
        python3 .gpu/peer/peer_torch_decode.py "$p" 2>&1 | tail -5
    fi
  done
fi
exit $rc
