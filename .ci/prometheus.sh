#!/usr/bin/env bash
# Prometheus (with promtool) for the observability tests.
#   .ci/prometheus.sh install   # apt-get install prometheus when `prometheus`/`promtool` are missing
#   .ci/prometheus.sh check     # print the versions; exit 1 when missing
# The tests start their own `prometheus` per test module on a loopback port, with their own config
# and storage under pytest's tmp_path, and stop it by PID (tests/integration/test_observe_prometheus.py).
# The Debian package enables a systemd unit; CI containers have no systemd, so nothing else starts.
set -euo pipefail
case "${1:-}" in
  install)
    if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
      prometheus --version 2>&1 | head -1
      exit 0
    fi
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends prometheus
    prometheus --version 2>&1 | head -1
    ;;
  check)
    command -v prometheus >/dev/null && command -v promtool >/dev/null || { echo "prometheus/promtool missing" >&2; exit 1; }
    prometheus --version 2>&1 | head -1
    promtool --version 2>&1 | head -1
    ;;
  *)
    echo "usage: $0 install|check" >&2
    exit 2
    ;;
esac
