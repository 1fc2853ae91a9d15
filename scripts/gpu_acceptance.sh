#!/usr/bin/env bash
# GPU acceptance: run gpufleet's `acceptance` plan on this machine (<= 5 min) and print measured vs
# expected per check against the machine's profile (bf16 matmul, HBM copy, host<->device copy, ...).
#
#   scripts/gpu_acceptance.sh                 # on a GPU machine: profile from nvidia-smi, all its GPUs
#   scripts/gpu_acceptance.sh --profile H200  # force a profile
#   scripts/gpu_acceptance.sh --dry-run       # no GPU needed: the same pipeline with the CPU profile
#
# Options: --plan NAME|FILE (default acceptance), --profile NAME, --out FILE (JSON report, default
# ./gpu_acceptance.json), --record (write results to the fleet ledger), --timeout S (default 300).
# Needs: this repo's venv (or $GPUFLEET_PYTHON) with torch (CUDA build on GPU machines) and
# nvidia-ml-py (`pip install -e '.[gpu]'`). Exit code: the health check's (0 ok, 1 problem, 3 unknown),
# 124 on timeout, 2 on bad usage.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${GPUFLEET_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
PLAN=acceptance PROFILE="" OUT="./gpu_acceptance.json" DRY=0 RECORD=--no-record TIMEOUT=300

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --plan) PLAN="${2:?--plan needs a value}"; shift ;;
    --profile) PROFILE="${2:?--profile needs a value}"; shift ;;
    --out) OUT="${2:?--out needs a value}"; shift ;;
    --record) RECORD="" ;;
    --timeout) TIMEOUT="${2:?--timeout needs a value}"; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "gpu_acceptance: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$DRY" = 1 ]; then
  PROFILE="${PROFILE:-CPU}"
  NGPU=0
  echo "gpu_acceptance: dry run (no GPU): profile $PROFILE, plan $PLAN"
else
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_acceptance: nvidia-smi not found: no GPU here (use --dry-run to test the pipeline)" >&2
    exit 3
  fi
  NGPU="$(timeout 30 nvidia-smi -L | grep -c '^GPU ')"
  NAME="$(timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)"
  echo "gpu_acceptance: $NGPU x $NAME"
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_acceptance: torch in $PY has no CUDA: install a CUDA build of torch" >&2
    exit 3
  fi
  "$PY" -c 'import pynvml' 2>/dev/null || echo "gpu_acceptance: warning: nvidia-ml-py missing; GPU state checks will be INCOMPLETE (pip install -e '.[gpu]')" >&2
  if [ -z "$PROFILE" ]; then
    case "$NAME" in
      *H200*) PROFILE=H200 ;; *H100*) PROFILE=H100 ;; *B200*) PROFILE=B200 ;; *A100*) PROFILE=A100 ;;
      *) echo "gpu_acceptance: no profile for '$NAME'; pass --profile" >&2; exit 2 ;;
    esac
  fi
fi

start=$(date +%s)
timeout --kill-after=10 "$TIMEOUT" "$PY" -m gpufleet.cli.main health check --plan "$PLAN" \
  --profile "$PROFILE" --expect-gpus "$NGPU" --json $RECORD > "$OUT"
rc=$?
echo "gpu_acceptance: health check exit $rc after $(( $(date +%s) - start )) s; report: $OUT"
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "gpu_acceptance: timed out after ${TIMEOUT} s" >&2
  exit 124
fi
if [ "$rc" = 2 ] || [ ! -s "$OUT" ]; then
  exit "$rc"
fi
"$PY" -m gpufleet.health.acceptance "$OUT" || exit 2
exit "$rc"
