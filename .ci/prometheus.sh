#!/usr/bin/env bash
# Prometheus (with promtool) and the Pushgateway for the observability tests.
#   .ci/prometheus.sh install   # apt-get install prometheus prometheus-pushgateway when missing
#   .ci/prometheus.sh check     # print the versions; exit 1 when missing
# The tests start their own `prometheus` per test module on a loopback port, with their own config
# and storage under pytest's tmp_path, and stop it by PID (tests/integration/test_observe_prometheus.py).
# The Debian package enables a systemd unit; CI containers have no systemd, so nothing else starts.
set -euo pipefail
case "${1:-}" in
  install)
    if command -v prometheus >/dev/null && command -v promtool >/dev/null \
        && command -v prometheus-pushgateway >/dev/null; then
      prometheus --version 2>&1 | head -1
      exit 0
    fi
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends prometheus prometheus-pushgateway
    prometheus --version 2>&1 | head -1
    ;;
  check)
    for b in prometheus promtool prometheus-pushgateway; do
      command -v "$b" >/dev/null || { echo "$b missing" >&2; exit 1; }
    done
    prometheus --version 2>&1 | head -1
    promtool --version 2>&1 | head -1
    ;;
  *)
    echo "usage: $0 install|check" >&2
    exit 2
    ;;
esac
