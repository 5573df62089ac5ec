#!/usr/bin/env bash
# The GPU check: run once on a machine with a CUDA GPU (one is enough), in under 8 minutes.
#
#   scripts/gpu-check.sh OUTDIR
#
# Configures Release with CUDA and NCCL, builds the GPU tests and the GPU benchmark, runs
#   - the kernel tests and the NCCLBackend tests under mpiexec -n 1 (one GPU),
#   - MPIBackend with cuda tensors under mpiexec -n 1 and -n 2 (two ranks may share a GPU),
#   - gpu_bench (NCCLBackend vs raw NCCL allreduce; optimizer kernels vs a copy kernel),
# and writes into OUTDIR: system.txt (nvidia-smi, nvcc, NCCL), one log per step, allreduce.csv,
# kernels.csv, figures (PNG, when gnuplot is installed) and summary.txt. Every step has a
# timeout, taken from one overall budget (LOCKSTEP_GPU_CHECK_BUDGET seconds, default 470).
# Needs: CMake >= 3.25, a CUDA toolkit with NCCL, an MPI, Catch2 v2. Environment overrides:
# CMAKE_CUDA_ARCHITECTURES (default: the GPU's compute capability from nvidia-smi, else 90),
# LOCKSTEP_GPU_BUILD_DIR (default build-gpu-check in the repository).
# Exit status: 0 when every step passed, 1 when one failed, 77 when no GPU was found.
set -euo pipefail

out=${1:?usage: scripts/gpu-check.sh OUTDIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${LOCKSTEP_GPU_BUILD_DIR:-$root/build-gpu-check}
budget=${LOCKSTEP_GPU_CHECK_BUDGET:-470}
start=$(date +%s)
failed=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PATH=$PATH:/usr/local/cuda/bin

summary() { echo "$*" | tee -a "$out/summary.txt"; }

# step NAME LIMIT_SECONDS command...: runs with a timeout of min(LIMIT, what is left of the
# budget), logs to OUTDIR/NAME.log, records PASS / FAIL / SKIPPED (exit 77) / TIMEOUT.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -le 5 ]; then
    summary "$(printf '%-28s %s' "$name" "NOT RUN (budget spent)")"
    failed=1
    return 0
  fi
  local t0 rc=0
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  local verdict=PASS
  case $rc in
    0) verdict=PASS ;;
    77) verdict=SKIPPED ;;
    124 | 137) verdict="TIMEOUT after ${limit}s"; failed=1 ;;
    *) verdict="FAIL (exit $rc)"; failed=1 ;;
  esac
  summary "$(printf '%-28s %-22s %4ss' "$name" "$verdict" "$(($(date +%s) - t0))")"
  return 0
}

: >"$out/summary.txt"
summary "Lockstep GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"

{
  echo "== nvidia-smi"; nvidia-smi || true
  echo "== nvcc"; nvcc --version || true
  echo "== NCCL header"; grep -E '^#define NCCL_(MAJOR|MINOR|PATCH)' /usr/local/cuda/include/nccl.h 2>/dev/null || true
  echo "== MPI"; mpiexec --version 2>&1 | head -2 || true
  echo "== cmake"; cmake --version | head -1
  echo "== host"; uname -a; nproc
} >"$out/system.txt" 2>&1

gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l || true)
if [ "${gpus:-0}" -eq 0 ]; then
  summary "no GPU found by nvidia-smi: nothing to check"
  exit 77
fi
summary "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"

arch=${CMAKE_CUDA_ARCHITECTURES:-}
if [ -z "$arch" ]; then
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
  arch=${arch:-90}
fi

step configure 90 cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
  -DLOCKSTEP_WITH_CUDA=ON -DLOCKSTEP_WITH_NCCL=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DLOCKSTEP_BUILD_TESTS=ON -DLOCKSTEP_BUILD_BENCH=ON -DLOCKSTEP_BUILD_EXAMPLES=OFF
step build 240 cmake --build "$build" -j "$(nproc)" --target \
  test_cuda_kernels test_mpi_device test_nccl_backend test_nccl_training gpu_bench

exe() { find "$build" -name "$1" -type f -perm -u+x | head -1; }

if [ -n "$(exe test_cuda_kernels)" ]; then
  step test_cuda_kernels.np1 60 mpiexec --bind-to none -n 1 "$(exe test_cuda_kernels)"
  step test_nccl_backend.np1 60 mpiexec --bind-to none -n 1 "$(exe test_nccl_backend)"
  step test_nccl_training.np1 45 mpiexec --bind-to none -n 1 "$(exe test_nccl_training)"
  step test_mpi_device.np1 60 mpiexec --bind-to none -n 1 "$(exe test_mpi_device)"
  step test_mpi_device.np2 60 mpiexec --bind-to none -n 2 "$(exe test_mpi_device)"
  if [ "$gpus" -ge 2 ]; then
    step test_nccl_backend.np2 60 mpiexec --bind-to none -n 2 "$(exe test_nccl_backend)"
    step test_nccl_training.np2 45 mpiexec --bind-to none -n 2 "$(exe test_nccl_training)"
  fi
  step gpu_bench 120 mpiexec --bind-to none -n 1 "$(exe gpu_bench)" --out "$out"
else
  summary "the test programs were not built: see build.log"
  failed=1
fi

if [ -f "$out/allreduce.csv" ]; then
  summary ""
  summary "allreduce (1 rank): bytes, NCCLBackend us, raw NCCL us, GB/s, GB/s"
  tail -n +2 "$out/allreduce.csv" | tr ',' ' ' | tee -a "$out/summary.txt" >/dev/null
fi
if [ -f "$out/kernels.csv" ]; then
  summary ""
  summary "kernels: name, elements, bytes moved, ms, GB/s"
  tail -n +2 "$out/kernels.csv" | tr ',' ' ' | tee -a "$out/summary.txt" >/dev/null
fi

if command -v gnuplot >/dev/null && [ -f "$out/allreduce.csv" ] && [ -f "$out/kernels.csv" ]; then
  gnuplot >"$out/gnuplot.log" 2>&1 <<EOF || summary "gnuplot failed: see gnuplot.log"
set datafile separator ','
set terminal pngcairo size 900,560
set output '$out/allreduce.png'
set title 'allreduce on one GPU: NCCLBackend vs raw NCCL (host waits for completion)'
set logscale xy
set xlabel 'message size (bytes)'
set ylabel 'time per allreduce (us)'
set key top left
plot '$out/allreduce.csv' every ::1 using 1:2 with linespoints title 'NCCLBackend::allreduce', \
     '' every ::1 using 1:3 with linespoints title 'ncclAllReduce + cudaStreamSynchronize'
set output '$out/kernels.png'
unset logscale
set title 'kernel bandwidth (GB/s, bytes read + written)'
set style data histograms
set style fill solid 0.8
set boxwidth 0.8
set xtics rotate by -30
set ylabel 'GB/s'
unset xlabel
plot '$out/kernels.csv' every ::1 using 5:xtic(1) notitle
EOF
fi

summary ""
summary "total $(($(date +%s) - start))s; $([ "$failed" -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED')"
exit "$failed"
