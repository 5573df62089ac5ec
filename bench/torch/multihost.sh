#!/usr/bin/env bash
# The LibTorch step across hosts (issue 45 item 3): bench_torch's model (default: the small GPT of
# examples/torch/gpt) at 2 hosts x 2 ranks on the simulated cluster (scripts/cluster.sh) with each
# host's link shaped to RATE, the variants interleaved in one run (lockstep from autograd hooks,
# 25 MiB buckets, one blocking allreduce per gradient after backward, no communication), and the
# link bound beside them: the bytes each host must send per step over its link / the rate (a
# two-host allreduce of S bytes sends S from each host: half as the reduce-scatter, half as the
# all-gather). Python DDP is not run here (it starts its processes on one machine).
#
# Usage (root; build bench_torch first):
#   bench/torch/multihost.sh [--build DIR] [--out DIR] [--rate 500mbit] [--model gpt|mlp] [--steps N]
#                            [--batch B]
# --out: a folder every simulated host can write (each has its own /tmp; default
# results/torch-multihost-DATE in the source tree). --batch: per rank (default 16, run.sh's GPT_BATCH).
# Exit status: that of the run; 77 if the cluster cannot be made here (not root, no namespaces).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=$ROOT/build
OUT=
RATE=500mbit
MODEL=gpt
STEPS=20
BATCH=16
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=$(cd "$2" && pwd); shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "multihost.sh: unknown option '$1' (--help)" >&2; exit 2 ;;
  esac
done
EXE=$BUILD/bench/bench_torch
[ -x "$EXE" ] || { echo "multihost.sh: $EXE is missing; build it (cmake --build $BUILD --target bench_torch)" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "multihost.sh: needs root (scripts/cluster.sh makes network namespaces); skipped" >&2; exit 77; }
export LOCKSTEP_CLUSTER=${LOCKSTEP_CLUSTER:-lockstep-torch}
CLUSTER=$ROOT/scripts/cluster.sh
OUT=${OUT:-$ROOT/results/torch-multihost-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
case $OUT in /tmp/*) echo "multihost.sh: --out $OUT is under /tmp, which each simulated host has of its own" >&2; exit 2 ;; esac
trap '"$CLUSTER" down; exit 130' INT TERM
{
  echo "bench/torch/multihost.sh: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
  echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "2 hosts x 2 ranks, each host's egress shaped to $RATE (tc tbf); model $MODEL, batch $BATCH per rank, $STEPS steps"
} | tee "$OUT/machine.txt"
"$CLUSTER" up 2 --rate "$RATE" --slots 2 >/dev/null || { echo "multihost.sh: cluster.sh up failed" >&2; exit 77; }
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912
timeout -k 10 900 "$CLUSTER" run -n 4 --map-by ppr:2:node -x OPENBLAS_NUM_THREADS -x OMP_NUM_THREADS \
  -x MALLOC_MMAP_THRESHOLD_ -x MALLOC_TRIM_THRESHOLD_ -- "$EXE" --model "$MODEL" --batch "$BATCH" \
  --variants lockstep,lockstep-25m,ls-blocking,local --steps "$STEPS" --warmup 3 --json "$OUT/run.json" \
  2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
"$CLUSTER" down
[ "$rc" -eq 0 ] || { echo "multihost.sh: the run exited $rc (log: $OUT/run.log)" >&2; exit "$rc"; }
python3 - "$OUT/run.json" "$RATE" <<'PYEOF' | tee "$OUT/summary.md"
import json, re, sys
j = json.load(open(sys.argv[1]))
m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", sys.argv[2].lower())
rate = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8  # bytes/s
v = {x["variant"]: x for x in j["variants"]}
params = j.get("parameters") or j.get("numel")
grad_bytes = 4 * params
bound = grad_bytes / rate
local = v["local"]["step_s"]
print(f"| variant | step ms | step / no-communication step | step - no-communication step (ms) |")
print("|---|--:|--:|--:|")
for name, x in v.items():
    print(f"| {name} | {x['step_s'] * 1e3:.1f} | {x['step_s'] / local:.2f} | {(x['step_s'] - local) * 1e3:.1f} |")
print(f"\nlink bound: {grad_bytes / 2**20:.2f} MiB of f32 gradients sent by each host per step at {sys.argv[2]}: "
      f"{bound * 1e3:.1f} ms; no-communication step + bound: {(local + bound) * 1e3:.1f} ms")
PYEOF
