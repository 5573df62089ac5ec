#!/usr/bin/env bash
# Runs every variant of the LibTorch comparison in one go and prints the tables, with the CPU
# model and the date. Builds nothing: build bench_torch first (LibTorch found, e.g.
#   cmake -S . -B build-bench -DLOCKSTEP_WITH_TORCH=ON && cmake --build build-bench -j2 --target bench_torch).
#   - C++ at NP ranks (mpiexec): lockstep::torch DistributedOptimizer (replicated, sharded
#     optimizer state, the bf16 wire), a per-parameter MPI_Allreduce loop,
#     c10d::ProcessGroupGloo (where built), and no communication; the MLP again with Adam (state
#     twice the parameters: what sharding divides) for the replicated, sharded and bf16 forms;
#   - C++ at 1 rank: no communication (backward alone, nothing else on the cores);
#   - Python (/usr/bin/python3): torch DistributedDataParallel with gloo at NP processes, and
#     the same model without DDP;
#   for the MLP (50 x Linear(512,512)+ReLU, 13.1 M parameters, batch 64 per rank), the byte-level
#   GPT of examples/torch/gpt (its small preset: 4 layers, width 128, context 64, 0.83 M
#   parameters, without dropout, GPT_BATCH sequences per rank) and, unless
#   --no-resnet, ResNet-50 at 64x64 (torchvision: Debian's python3-torchvision; traced to TorchScript by export_resnet50.py,
#   loaded by both sides; batch RESNET_BATCH per rank); and lt::SyncBatchNorm2d against
#   torch::nn::BatchNorm2d, forward+backward at NP ranks (input [BN_BATCH, 64, 16, 16] per rank).
# One thread per rank: torch::set_num_threads(1) / torch.set_num_threads(1), and
# OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 (Debian's LibTorch calls OpenBLAS, whose own thread
# pool set_num_threads does not limit: without them each rank runs 2 spinning BLAS threads).
# glibc's allocator keeps freed memory, for every variant, C++ and Python alike
# (MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_, as examples/common/allocator.hpp sets them
# in the examples): otherwise each step's temporaries are unmapped and faulted in again, which
# slowed the C++ GPT step about 1.35x. ALLOCATOR=default leaves glibc's defaults.
#
# Usage: bench/torch/run.sh [--quick] [--no-resnet]
# Environment: BUILD_DIR (default build-bench), NP (2), RESULTS_DIR (results/torch),
#   MPIEXEC (mpiexec), PYTHON (/usr/bin/python3), STEPS (20), WARMUP (3), BATCH (64),
#   RESNET_BATCH (16), RESNET_STEPS (6), BN_BATCH (32), GPT_BATCH (16), PY_TIMEOUT (900: seconds a
#   Python DDP run may take before it is ended and left out of the tables; ddp_gloo.py itself
#   bounds every wait by 120 s and ends its group when one process fails or dies, saying which).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/../.." && pwd)
build=${BUILD_DIR:-$top/build-bench}
np=${NP:-2}
results=${RESULTS_DIR:-$top/results/torch}
mpiexec=${MPIEXEC:-mpiexec}
python=${PYTHON:-/usr/bin/python3}
steps=${STEPS:-20}
warmup=${WARMUP:-3}
batch=${BATCH:-64}
rbatch=${RESNET_BATCH:-16}
rsteps=${RESNET_STEPS:-6}
bnbatch=${BN_BATCH:-32}
gbatch=${GPT_BATCH:-16}
pytimeout=${PY_TIMEOUT:-900}
resnet=1
for a in "$@"; do
  case $a in
    --quick) steps=5; warmup=1; rsteps=2 ;;
    --no-resnet) resnet=0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "run.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done

exe=$build/bench/bench_torch
if [ ! -x "$exe" ]; then
  echo "run.sh: $exe not found; build it first (see the top of this script)" >&2
  exit 1
fi
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# The core count before OMP_NUM_THREADS is set: GNU nproc honours OMP_NUM_THREADS.
ncores=$(nproc)
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
mpiflags=(--bind-to none -x OPENBLAS_NUM_THREADS -x OMP_NUM_THREADS)
allocator=${ALLOCATOR:-keep}
case $allocator in
  keep) export MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912
        mpiflags+=(-x MALLOC_MMAP_THRESHOLD_ -x MALLOC_TRIM_THRESHOLD_) ;;
  default) ;;
  *) echo "run.sh: ALLOCATOR must be keep or default, not '$allocator'" >&2; exit 2 ;;
esac
if [ "$np" -gt "$ncores" ]; then mpiflags+=(--oversubscribe); fi
mkdir -p "$results"

{
  echo "- CPU: $(lscpu | sed -n 's/^Model name: *//p') ($ncores cores visible, $(lscpu | sed -n 's/^Thread(s) per core: *//p') thread(s) per core); hypervisor: $(lscpu | sed -n 's/^Hypervisor vendor: *//p')"
  echo "- LibTorch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null) (Debian, CPU); $("$mpiexec" --version 2>&1 | head -n 1)"
  echo "- Threads: 1 per rank (set_num_threads(1), OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1); $np ranks, mpiexec ${mpiflags[*]}"
  echo "- Allocator: $allocator (glibc; keep: MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-unset} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-unset}, for C++ and Python alike)"
  echo "- Run: $(date -u '+%Y-%m-%d %H:%M UTC'); load at the start: $(uptime | sed 's/.*load average: //')"
} | tee "$results/machine.md"
echo

run_models() {  # run_models TAG ARGS...: the C++ (NP ranks, 1 rank) and Python runs of one model
  local tag=$1
  shift
  echo "== $tag: C++, $np ranks" >&2
  "$mpiexec" -n "$np" "${mpiflags[@]}" "$exe" --json "$results/${tag}_cpp.json" "$@" | tee "$results/${tag}_cpp.md"
  echo "== $tag: C++, 1 rank, no communication" >&2
  "$mpiexec" -n 1 "${mpiflags[@]}" "$exe" --variants local --json "$results/${tag}_cpp_1rank.json" "$@" \
    | tee "$results/${tag}_cpp_1rank.md"
  echo "== $tag: Python DDP (gloo), $np processes" >&2
  # Bounded: Python DDP once hung here for 30 minutes (gloo; not ours to debug). A run that
  # does not finish within PY_TIMEOUT s is reported, and the tables go on without its rows.
  rm -f "$results/${tag}_ddp.json"
  local rc=0
  timeout -k 10 "$pytimeout" "$python" "$here/ddp_gloo.py" --world-size "$np" --json "$results/${tag}_ddp.json" \
    --deadline "$pytimeout" "$@" \
    | tee "$results/${tag}_ddp.md" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "run.sh: Python DDP ($tag) $([ "$rc" -eq 124 ] && echo "did not finish within ${pytimeout}s" || echo "exited with $rc"); no DDP figures for $tag" >&2
    rm -f "$results/${tag}_ddp.json"
  fi
}

run_models mlp --model mlp --batch "$batch" --steps "$steps" --warmup "$warmup"
run_models gpt --model gpt --batch "$gbatch" --steps "$steps" --warmup "$warmup"
echo "== mlp with Adam: C++, $np ranks (replicated, sharded, bf16 wire)" >&2
"$mpiexec" -n "$np" "${mpiflags[@]}" "$exe" --json "$results/mlp_adam_cpp.json" --model mlp --optimizer adam \
  --variants lockstep,lockstep-sharded,lockstep-bf16,local --batch "$batch" --steps "$steps" --warmup "$warmup" \
  | tee "$results/mlp_adam_cpp.md"
echo "== SyncBatchNorm2d against BatchNorm2d: C++, $np ranks" >&2
# glibc's allocator thresholds fixed for this one: otherwise the interleaved modules' 2 MiB
# temporaries are mapped and unmapped, page fault by page fault, and which of the two pays for
# it depends on the other's allocations (docs/performance/where-the-time-goes.md, "SyncBatchNorm: the allocator").
MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=268435456 \
  "$mpiexec" -n "$np" "${mpiflags[@]}" -x MALLOC_MMAP_THRESHOLD_ -x MALLOC_TRIM_THRESHOLD_ "$exe" \
  --json "$results/bn_cpp.json" --model bn --batch "$bnbatch" \
  --channels 64 --image-size 16 --steps "$steps" --warmup "$warmup" | tee "$results/bn_cpp.md"
if [ "$resnet" = 1 ]; then
  pt=$build/bench/resnet50_64.pt  # 100 MB: kept out of the results
  [ -f "$pt" ] || "$python" "$here/export_resnet50.py" "$pt" 64
  run_models resnet50 --model script --script "$pt" --image-size 64 --batch "$rbatch" --steps "$rsteps" --warmup 1
fi

# The summary: every variant's step and backward+comm, the ratio to the no-communication
# backward of the same run, and the step against Python DDP's.
"$python" - "$results" "$resnet" "$np" "$gbatch" <<'PY' | tee "$results/summary.md"
import json, sys, os
d, resnet, np_, gbatch = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
print("| model | variant | step ms | backward+comm ms | (backward+comm)/local backward | (backward+comm)/1-rank backward | DDP step / step |")
print("|---|---|--:|--:|--:|--:|--:|")
for tag in ["mlp", "gpt"] + (["resnet50"] if resnet else []):
    cpp = json.load(open(os.path.join(d, f"{tag}_cpp.json")))
    one = json.load(open(os.path.join(d, f"{tag}_cpp_1rank.json")))["variants"][0]
    ddp_file = os.path.join(d, f"{tag}_ddp.json")
    ddp = json.load(open(ddp_file)) if os.path.exists(ddp_file) else {"variants": []}
    ddp_step = next((v["step_s"] for v in ddp["variants"] if v["variant"] == "ddp"), None)
    rows = [(v["variant"], v, v.get("ratio_to_local_backward")) for v in cpp["variants"]]
    rows += [("python-" + v["variant"], v, v.get("ratio_to_local_backward")) for v in ddp["variants"]]
    rows += [("local, 1 rank", one, None)]
    for name, v, r in rows:
        vs_ddp = f"{ddp_step / v['step_s']:.2f}" if ddp_step else "- (no DDP run)"
        ratio = f"{r:.2f}" if r is not None else "-"
        print(f"| {tag} | {name} | {v['step_s'] * 1e3:.1f} | {v['backward_comm_s'] * 1e3:.1f} | {ratio} | "
              f"{v['backward_comm_s'] / one['backward_comm_s']:.2f} | {vs_ddp} |")
print()
# The GPT in tokens per second (context 64): every rank's batch per step, and the step against
# the same run's no-communication step (the target: at most 1.15 on one machine).
cpp = json.load(open(os.path.join(d, "gpt_cpp.json")))["variants"]
ddp_file = os.path.join(d, "gpt_ddp.json")
ddp = json.load(open(ddp_file))["variants"] if os.path.exists(ddp_file) else []
local = next(v["step_s"] for v in cpp if v["variant"] == "local")
py_local = next((v["step_s"] for v in ddp if v["variant"] == "local"), None)
print(f"| GPT, {np_} ranks x {gbatch} x 64 tokens | tokens/s | step / no-communication step |")
print("|---|--:|--:|")
for v in cpp:
    print(f"| {v['variant']} | {np_ * gbatch * 64 / v['step_s']:.0f} | {v['step_s'] / local:.2f} |")
for v in ddp:
    r = f"{v['step_s'] / py_local:.2f}" if py_local else "-"
    print(f"| python-{v['variant']} | {np_ * gbatch * 64 / v['step_s']:.0f} | {r} |")
print()
adam = json.load(open(os.path.join(d, "mlp_adam_cpp.json")))["variants"]
rep = next(v for v in adam if v["variant"] == "lockstep")
print("| MLP, Adam | step ms | optimizer (inner step + sharded broadcasts) ms | step / replicated step |")
print("|---|--:|--:|--:|")
for v in adam:
    print(f"| {v['variant']} | {v['step_s'] * 1e3:.1f} | {v['optimizer_s'] * 1e3:.1f} | {v['step_s'] / rep['step_s']:.2f} |")
print()
bn = json.load(open(os.path.join(d, "bn_cpp.json")))["variants"]
print("| module | forward+backward ms | / BatchNorm2d |")
print("|---|--:|--:|")
for v in bn:
    print(f"| {v['variant']} | {v['step_s'] * 1e3:.2f} | {v['ratio_to_batchnorm2d']:.2f} |")
PY
echo "- Load at the end: $(uptime | sed 's/.*load average: //')" | tee -a "$results/machine.md"
