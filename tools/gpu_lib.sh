# Sourced by the tools/gpu_*.sh scripts.
# wait_health PORT [TIMEOUT_S]: until http://127.0.0.1:PORT/health answers 200 (one polling
# process, every 20 ms); status 1 on timeout.
wait_health() {
  python3 - "$1" "${2:-90}" <<'PY'
import sys, time, urllib.request
port, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        sys.exit(0)
    except OSError:
        time.sleep(0.02)
sys.exit(1)
PY
}
# stage_dsl: on a GPU host, unpack the carried CuTe DSL bundle (.gpu/stage.sh; once per host, a
# warm host keeps it) and set DSL_PATH to the PYTHONPATH prefix that holds it ("" where there is
# none: a dev box with the DSL installed). Status 3 when a carried bundle cannot be staged.
stage_dsl() {
  if [ -f .gpu/stage.sh ] && command -v nvidia-smi > /dev/null; then
    bash .gpu/stage.sh > /dev/null || [ -f /tmp/site/.ok ] \
      || { echo "CuTe DSL bundle not staged"; return 3; }
  fi
  DSL_PATH=""
  if [ -f /tmp/site/.ok ]; then DSL_PATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:; fi
  return 0
}
