#!/usr/bin/env bash
# Start or stop the SeaweedFS S3 server that the S3 tests use.
#   .ci/seaweedfs.sh start   # state under .ci/state/seaweedfs, env in .ci/state/s3.env
#   .ci/seaweedfs.sh stop    # SIGTERM by PID, SIGKILL after a grace period
# `start` waits until the S3 API answers and the bucket exists; then `source .ci/state/s3.env`
# exports GPUFLEET_TEST_S3_{ENDPOINT,ACCESS_KEY,SECRET_KEY,BUCKET} for pytest.
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
case "${1:-}" in
  start)
    exec "$PY" -m support.seaweed start --dir "$STATE/seaweedfs" --env-file "$STATE/s3.env"
    ;;
  stop)
    rm -f "$STATE/s3.env"
    exec "$PY" -m support.seaweed stop --dir "$STATE/seaweedfs" --grace "${GRACE:-5}"
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
