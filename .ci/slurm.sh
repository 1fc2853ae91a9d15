#!/usr/bin/env bash
# Start or stop a real Slurm cluster on this one host for the Slurm tests: slurmctld + slurmd n1..n3.
#   .ci/slurm.sh start   # installs slurm-wlm/munge if missing; state under .ci/state/slurm
#   .ci/slurm.sh stop    # SIGTERM each daemon by PID, SIGKILL after a grace period
# `start` waits until `sinfo` shows the three nodes idle; then `source .ci/state/slurm.env` exports
# SLURM_CONF (and GPUFLEET_TEST_SLURM_DIR) for pytest. Timings: ../shared/notes/ci-services.md.
set -euo pipefail
# The daemons started here must not inherit the caller's descriptors: run under `flock LOCK ...`,
# munged kept the lock open and every later `flock` on it waited forever.
for _fd in /proc/$$/fd/*; do _fd=${_fd##*/}; case $_fd in 0|1|2|255) ;; *) eval "exec $_fd>&-" 2>/dev/null || true ;; esac; done
cd "$(dirname "$0")/.."
ROOT=$PWD
S=$ROOT/.ci/state/slurm
CONF=$S/slurm.conf
# Ports derive from the checkout path, so two checkouts on one host (a developer's and a CI clone)
# run separate clusters side by side; GPUFLEET_SLURM_PORT_BASE overrides.
BASE=${GPUFLEET_SLURM_PORT_BASE:-$((20000 + $(printf '%s' "$ROOT" | cksum | cut -d' ' -f1) % 10000 / 10 * 10))}
CTLD_PORT=$BASE
NODE_PORT=$((BASE + 1))
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3

stop_pid() {  # stop_pid PIDFILE: TERM, wait, KILL (only the daemon we started, by its PID)
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

case "${1:-}" in
  start)
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
    fi
    mkdir -p "$S/spool" "$S/state" /run/munge
    chown munge:munge /run/munge
    if ! pgrep -u munge -x munged >/dev/null; then
      runuser -u munge -- /usr/sbin/munged
    fi
    # A fake health check at the process boundary: fails while $S/fail-NODE exists (test 4).
    cat > "$S/fake-check.sh" <<'CHK'
#!/bin/sh
d=$(dirname "$0")
if [ -e "$d/fail-$SLURMD_NODENAME" ]; then echo "fake-check: $(cat "$d/fail-$SLURMD_NODENAME")"; exit 1; fi
echo "fake-check: ok"; exit 0
CHK
    chmod +x "$S/fake-check.sh"
    cat > "$CONF" <<CONF
ClusterName=gpufleet-ci
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerParameters=sched_interval=5,bf_interval=5
SlurmdTimeout=10
KillWait=5
StateSaveLocation=$S/state
SlurmctldPidFile=$S/slurmctld.pid
SlurmctldLogFile=$S/slurmctld.log
SlurmdSpoolDir=$S/spool/%n
SlurmdPidFile=$S/slurmd-%n.pid
SlurmdLogFile=$S/slurmd-%n.log
NodeName=n[1-3] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((NODE_PORT))-$((NODE_PORT + 2))] CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    # HealthCheckProgram / HealthCheckInterval, written by the code under test.
    PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m gpufleet.cli.main health slurm-config \
      --install --slurm-conf "$CONF" --interval 10 --check-command "$S/fake-check.sh" \
      --gpufleet "$PY -m gpufleet.cli.main" --fleet-dir "$S/fleet" >/dev/null
    export SLURM_CONF=$CONF
    [ -f "$S/slurmctld.pid" ] && kill -0 "$(cat "$S/slurmctld.pid")" 2>/dev/null || slurmctld -f "$CONF"
    for n in n1 n2 n3; do
      [ -f "$S/slurmd-$n.pid" ] && kill -0 "$(cat "$S/slurmd-$n.pid")" 2>/dev/null || slurmd -f "$CONF" -N "$n"
    done
    cat > "$ROOT/.ci/state/slurm.env" <<ENV
export SLURM_CONF=$CONF
export GPUFLEET_TEST_SLURM_DIR=$S
export GPUFLEET_TEST_SLURM_FLEET=$S/fleet
ENV
    for _ in $(seq 60); do
      idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2=="idle"' | wc -l)
      [ "$idle" -ge 3 ] && { echo "slurm: n[1-3] idle"; exit 0; }
      sleep 1
    done
    echo "slurm: nodes not idle after 60 s:" >&2; sinfo -N >&2 || true; exit 1
    ;;
  stop)
    rm -f "$ROOT/.ci/state/slurm.env"
    for n in n1 n2 n3; do stop_pid "$S/slurmd-$n.pid"; done
    stop_pid "$S/slurmctld.pid"
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
