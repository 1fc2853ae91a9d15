#!/usr/bin/env bash
# Everything gpufleet checks on a GPU machine, in one go (CI has no GPU): the CUDA tests
# (tests/gpu: pinned staging, CUDA restore, supervised runs on the GPU resuming bit-identically, the
# launch-time GPU check, NVML), the health quick plan against the GPU's profile, a supervised run's
# MTTR phases on the GPU, a promoted standby's MTTR with its CUDA context made before promotion
# against after (GPUFLEET_STANDBY_CUDA=1/0), and benchmark P10 (checkpointing GPU state, gpufleet
# against DCP).
#
#   scripts/gpu_checks.sh OUTDIR [P10_SIZES]     # e.g. scripts/gpu_checks.sh /tmp/gpu 1,8
#
# Writes into OUTDIR: tests.log, health.json, mttr_report.json, spare_cuda.json (and each of its runs'
# report, spare_cuda_WARM_I.json), p10_gpu_ckpt.json, session.log.
# Needs python3 with a CUDA torch and gpufleet's dependencies (or PYTHONPATH=src with them).
set -uo pipefail

OUT="${1:?usage: gpu_checks.sh OUTDIR [P10_SIZES]}"
SIZES="${2:-1,8}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${GPUFLEET_PYTHON:-python3}"
mkdir -p "$OUT"
cd "$ROOT" || exit 2
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - t0 )) s: $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ls /dev | grep -c '^nvidia[0-9]' | sed 's/^/\/dev\/nvidiaN devices: /'
"$PY" -c 'import torch, gpufleet, sys; print("torch", torch.__version__, "cuda", torch.version.cuda,
 "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version(), "python", sys.version.split()[0])'
uptime; df -h /var/tmp /tmp | tail -2

stamp "tests/gpu"
timeout 300 "$PY" -m pytest tests/gpu -q -p no:cacheprovider -o addopts="-ra" --durations=10 2>&1 \
  | tee "$OUT/tests.log" | tail -30

stamp "health quick (NVML, matmul, HBM)"
n="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
timeout 90 "$PY" -m gpufleet.cli.main health check --plan quick --expect-gpus "$n" --json --no-record \
  > "$OUT/health.json"
echo "health exit $?"
"$PY" -m gpufleet.health.acceptance "$OUT/health.json"

stamp "MTTR on the GPU: one rank, kill -9 at step 50"
run="$(mktemp -d)/mttr"
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 150 "$PY" -m gpufleet.cli.main run -n 1 --run-dir "$run" \
  --checkpoint-every 20 --no-progress --inject kill:rank=0,step=50,settle=1 -- \
  "$PY" tests/integration/scripts/toy_train.py --steps 80 --width 4096 2>&1 | tail -3
"$PY" -m gpufleet.cli.main report "$run" --json --no-plot > "$OUT/mttr_report.json"
"$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps(r.get("mttr", r), indent=1)[:1500])' \
  "$OUT/mttr_report.json"

stamp "promoted standby on the GPU: CUDA context made before promotion (1) or after (0)"
# One rank, a checkpoint every 20 steps, 0.25 s per step, kill -9 at step 60: the standby starts at the
# first commit and has imported torch (and, with 1, made its GPU's context) well before the kill, so
# the two differ only in where the context is made. Interleaved 0/1, two runs of each.
for i in 1 2; do
  for warm in 0 1; do
    d="$(mktemp -d)/spare-$warm"
    GPUFLEET_STANDBY_CUDA=$warm CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 120 "$PY" -m gpufleet.cli.main run \
      -n 1 --run-dir "$d" --checkpoint-every 20 --no-progress --inject kill:rank=0,step=60,settle=1 -- \
      "$PY" tests/integration/scripts/toy_train.py --steps 90 --width 4096 --sleep 0.25 2>&1 | tail -1
    "$PY" -m gpufleet.cli.main report "$d" --json --no-plot > "$OUT/spare_cuda_${warm}_$i.json"
  done
done
"$PY" - "$OUT" <<'PYEOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {"0": [], "1": []}
for path in sorted(glob.glob(os.path.join(out, "spare_cuda_[01]_*.json"))):
    try:
        mttr = json.load(open(path))["mttr"]
        runs[os.path.basename(path).split("_")[2]].append(
            {"mttr_s": mttr["mean_s"], "spawn_init_s": mttr["phases_mean_s"]["spawn_init"],
             "first_step_s": mttr["phases_mean_s"]["first_step"]})
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{path}: no MTTR ({e})")
def med(rows, key):
    return statistics.median(r[key] for r in rows) if rows else None
summary = {"runs": {"context_after_promotion": runs["0"], "context_before_promotion": runs["1"]}}
for key in ("mttr_s", "spawn_init_s", "first_step_s"):
    after, before = med(runs["0"], key), med(runs["1"], key)
    summary[key] = {"after": after, "before": before,
                    "ratio": round(before / after, 3) if after and before is not None else None}
json.dump(summary, open(os.path.join(out, "spare_cuda.json"), "w"), indent=1)
for key in ("mttr_s", "spawn_init_s", "first_step_s"):
    s = summary[key]
    print(f"{key:13s} context after promotion {s['after']}  before {s['before']}  ratio before/after {s['ratio']}")
PYEOF

stamp "P10: checkpointing GPU state ($SIZES GB)"
timeout 270 "$PY" benchmarks/bench_gpu_ckpt.py --sizes "$SIZES" --repeats 3 --deadline 200 \
  --out "$OUT/p10_gpu_ckpt.json"
stamp "done"
