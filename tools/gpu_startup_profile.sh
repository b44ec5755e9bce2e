#!/usr/bin/env bash
# bash tools/gpu_startup_profile.sh: make the qwen3-8b / 0.6b checkpoints, then where start-up
# time goes (tools/profile_startup.py): LLMEngine construction with the kernel cache cold, then
# warm, then the kernel loads alone. Logs and JSON under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
# byte-compile the staged DSL once, as pip does at install (the host's copy has no .pyc files)
[ -d /tmp/site ] && python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
for P in qwen3-8b qwen3-0.6b; do
  [ -f /tmp/ck_$P/config.json ] || python3 -m tools.make_checkpoint --preset $P --out /tmp/ck_$P \
    --max-shard-size 8 --tokenizer 2>&1 | tail -1
done
cat /tmp/ck_qwen3-8b/*.safetensors > /dev/null
for mode in cold warm; do
  t0=$(date +%s.%N)
  python3 -m tools.profile_startup --model /tmp/ck_qwen3-8b --json $OUT/prof_$mode.json \
    > $OUT/prof_$mode.txt 2>&1
  echo "$mode: $(python3 -c "print(round($(date +%s.%N)-$t0,2))") s from process start"; sed -n '/^{/,/^}/p' $OUT/prof_$mode.txt
done
python3 -m tools.profile_startup --model /tmp/ck_qwen3-8b --kernels-only --json $OUT/prof_kern.json \
  > $OUT/prof_kern.txt 2>&1
sed -n '/^{/,/^}/p' $OUT/prof_kern.txt
