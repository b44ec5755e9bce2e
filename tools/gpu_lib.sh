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
