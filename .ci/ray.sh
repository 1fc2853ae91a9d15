#!/usr/bin/env bash
# Start or stop a real Ray cluster on this one host for the Ray backend tests: a head + 2 worker nodes.
#   .ci/ray.sh start   # ray from the venv (the `ray` extra); state and logs under .ci/state/ray
#   .ci/ray.sh heal    # restart a worker node a test killed (the node-loss test does)
#   .ci/ray.sh stop    # SIGTERM this cluster's processes (found by its temp dir / GCS port), SIGKILL after 5 s
# `start` waits until the two worker nodes are alive; then `source .ci/state/ray.env` exports
# GPUFLEET_TEST_RAY_ADDRESS for pytest. The head runs no tasks (0 CPUs, no `gpufleet` resource); each
# worker node offers 2 CPUs and 4 units of the `gpufleet` resource, which gpufleet's placement groups ask
# for (a quarantined node has them held, see docs/backends/ray.md). Every node gets its own ports.
set -euo pipefail
# The daemons started here must not inherit the caller's descriptors: run under `flock LOCK ...`,
# munged kept the lock open and every later `flock` on it waited forever.
for _fd in /proc/$$/fd/*; do _fd=${_fd##*/}; case $_fd in 0|1|2|255) ;; *) eval "exec $_fd>&-" 2>/dev/null || true ;; esac; done
cd "$(dirname "$0")/.."
ROOT=$PWD
S=$ROOT/.ci/state/ray
RAY=${RAY:-$ROOT/.venv/bin/ray}
# Ports derive from the checkout path (two checkouts run side by side); GPUFLEET_RAY_PORT_BASE overrides.
BASE=${GPUFLEET_RAY_PORT_BASE:-$((30000 + $(printf '%s' "$ROOT" | cksum | cut -d' ' -f1) % 10000 / 20 * 20))}
# Ray's sockets live under the temp dir: keep its path short (AF_UNIX paths are limited to 107 bytes).
TMP=/tmp/gfray-$BASE
# A lost node is noticed in ~2 s instead of Ray's default ~30 s (the node-loss test kills one).
export RAY_health_check_period_ms=500 RAY_health_check_failure_threshold=4 RAY_health_check_initial_delay_ms=1000
export RAY_USAGE_STATS_ENABLED=0

ports() {  # ports N: the per-node port flags of node N (0 = head)
  local b=$((BASE + 40 + $1 * 20))
  echo "--node-manager-port=$b --object-manager-port=$((b + 1)) --runtime-env-agent-port=$((b + 2))" \
    "--dashboard-agent-grpc-port=$((b + 3)) --dashboard-agent-listen-port=$((b + 4))" \
    "--metrics-export-port=$((b + 5)) --min-worker-port=$((b + 6)) --max-worker-port=$((b + 19))"
}

pids() {  # every process of this cluster: those whose command line names its temp dir or GCS port,
  # and everything below them (Ray's workers and agents rename themselves `ray::...`)
  local roots
  roots=$(pgrep -f -- "$TMP|gcs-address=127.0.0.1:$BASE|--gcs_server_port=$BASE" 2>/dev/null | tr '\n' ' ')
  [ -n "$roots" ] || return 0
  ps -eo pid=,ppid= | awk -v roots="$roots" '
    { parent[$1] = $2 }
    END {
      n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1
      do { added = 0; for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; added = 1 } } while (added)
      for (p in keep) print p
    }'
}

# No log monitor on any node: gpufleet's drivers call ray.init(log_to_driver=False), and each node's monitor
# polls the log directory at about 3% of a core for the whole CI run.
start_worker() {  # start_worker N: worker node N (1 or 2) joins the head
  # shellcheck disable=SC2046
  "$RAY" start --address="127.0.0.1:$BASE" --node-ip-address=127.0.0.1 --num-cpus=2 \
    --resources='{"gpufleet": 4}' --disable-usage-stats --include-log-monitor=false $(ports "$1") >"$S/worker-$1.log" 2>&1
}

case "${1:-}" in
  heal)  # restart the worker nodes a test killed (found by their node-manager port), then wait for them
    for n in 1 2; do
      pgrep -f -- "--node_manager_port=$((BASE + 40 + n * 20))( |$)" >/dev/null || start_worker "$n"
    done
    ;&
  wait)
    for _ in $(seq 60); do
      alive=$("$ROOT/.venv/bin/python" - "$BASE" <<'PY' 2>/dev/null || echo 0
import sys, ray
ray.init(address=f"127.0.0.1:{sys.argv[1]}", logging_level="ERROR", log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("gpufleet")))
PY
)
      [ "$alive" -ge 2 ] && { echo "ray: head + 2 worker nodes at 127.0.0.1:$BASE"; exit 0; }
      sleep 1
    done
    echo "ray: worker nodes not up after 60 s" >&2; tail -n 5 "$S"/*.log >&2; exit 1
    ;;
  start)
    mkdir -p "$S"
    [ -x "$RAY" ] || { echo "ray: $RAY missing (pip install 'gpufleet[ray]')" >&2; exit 1; }
    # shellcheck disable=SC2046
    "$RAY" start --head --node-ip-address=127.0.0.1 --port="$BASE" --num-cpus=0 --temp-dir="$TMP" \
      --include-dashboard=false --include-log-monitor=false --dashboard-port=$((BASE + 2)) --disable-usage-stats $(ports 0) >"$S/head.log" 2>&1
    for n in 1 2; do start_worker "$n"; done
    cat > "$ROOT/.ci/state/ray.env" <<ENV
export GPUFLEET_TEST_RAY_ADDRESS=127.0.0.1:$BASE
export GPUFLEET_TEST_RAY_DIR=$S
ENV
    exec "$0" wait
    ;;
  stop)
    rm -f "$ROOT/.ci/state/ray.env"
    mapfile -t left < <(pids)
    [ "${#left[@]}" -eq 0 ] && exit 0
    kill -TERM "${left[@]}" 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(pids)" ] && break; sleep 0.1; done
    mapfile -t left < <(pids)
    [ "${#left[@]}" -gt 0 ] && kill -KILL "${left[@]}" 2>/dev/null || true
    rm -rf "$TMP"
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
