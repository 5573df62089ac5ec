#!/usr/bin/env bash
# The GPU check: run once on a machine with a CUDA GPU, in about 5 minutes including the build.
#
#   scripts/gpu-check.sh OUT
#
# Made for the bare GPU image this project is lent (CUDA 13 with nvcc, CMake and ninja,
# Python 3.12 with the nvidia-nccl-cu13 wheel, no MPI, no Catch2, no internet): everything else
# comes from the GPU kit (scripts/gpu-kit.sh, carried as the ignored folder gpu-kit/).
#
# 1. Preflight (about 10 s): nvidia-smi and a GPU, nvcc >= 12, g++ >= 11, cmake >= 3.25, the kit (mpiexec,
#    mpi.h, Catch2, CLI11, nlohmann-json, glibc new enough for it), nccl.h and libnccl.so from
#    NCCL_ROOT or from the nvidia-nccl-cu* wheel (found with python3). One line per missing
#    piece, then exit 2 with nothing built.
# 2. Configure (Release, CUDA and NCCL, the GPU's architecture) and build the GPU tests,
#    gpu_bench and the train example.
# 3. Checks, each with its own timeout taken from one budget (LOCKSTEP_GPU_CHECK_BUDGET seconds,
#    default 420): the kernel tests; MPIBackend with cuda tensors at 1 and 2 ranks (sharing the
#    GPU); NCCLBackend and the NCCL training test at 1 rank (NCCL refuses two ranks on one GPU,
#    so with one GPU NCCL is reported "single rank only" and the check is that 2 ranks fail with
#    a clear message on every rank rather than hang; with 2 GPUs the NCCL tests run at 2 ranks);
#    the train example with --device cuda against --device cpu (same seed, 20 epochs, losses
#    within 1e-4 relative, for the MPI backend at 2 ranks and NCCL at 1); gpu_bench (copy kernel
#    against cudaMemcpyAsync, the Adam and SGD kernels against the copy, allreduce call
#    overhead at 1 rank); the kernel tests once more under compute-sanitizer memcheck.
#
# OUT receives preflight.txt, system.txt, one log per step, allreduce.csv, kernels.csv,
# train_*.csv, figures (with gnuplot) and summary.txt (a verdict per step and the tables).
# Exit status: 0 every step passed; 1 a step failed or timed out; 2 the preflight found a
# missing piece (see preflight.txt).
# Environment: LOCKSTEP_KIT (default gpu-kit in the repository), NCCL_ROOT,
# CMAKE_CUDA_ARCHITECTURES (default: the GPU's compute capability), LOCKSTEP_GPU_BUILD_DIR
# (default build-gpu-check in the repository), LOCKSTEP_GPU_CHECK_BUDGET,
# LOCKSTEP_GPU_CHECK_BUILD_LIMIT (seconds for the build step, default 240),
# LOCKSTEP_GPU_CHECK_PREFLIGHT_ONLY=1 (stop after the preflight), LOCKSTEP_GPU_CHECK_NO_GPU=1
# (a dry run on a machine without a GPU: configure and build only, then stop) or =2 (the
# same, then every step anyway: they report skipped or fail, which exercises this script).
set -uo pipefail

out=${1:?usage: scripts/gpu-check.sh OUT}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
kit=${LOCKSTEP_KIT:-$root/gpu-kit}
build=${LOCKSTEP_GPU_BUILD_DIR:-$root/build-gpu-check}
budget=${LOCKSTEP_GPU_CHECK_BUDGET:-420}
dry=${LOCKSTEP_GPU_CHECK_NO_GPU:-0}
start=$(date +%s)
failed=0
# nvcc and nvidia-smi where CUDA images keep them, in case PATH lacks them.
export PATH=$PATH:/usr/local/cuda/bin:/usr/local/nvidia/bin
# CMake 4 (pip's cmake) refuses package files that ask for policies older than 3.5; the kit's
# Debian files ask for ranges ending at 3.19-3.22, which it accepts, but be safe. Ignored by
# older CMake.
export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}

summary() { echo "$*" | tee -a "$out/summary.txt"; }
: >"$out/summary.txt"
summary "Lockstep GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"

# ---------------------------------------------------------------------------------------------
# 1. Preflight
# ---------------------------------------------------------------------------------------------
missing=0
pre() { echo "$*" | tee -a "$out/preflight.txt"; }
miss() { pre "MISSING: $*"; missing=$((missing + 1)); }
: >"$out/preflight.txt"
# version_ge A B: A >= B for dotted versions
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }

gpus=0
if [ "$dry" = 1 ] || [ "$dry" = 2 ]; then
  pre "dry run (LOCKSTEP_GPU_CHECK_NO_GPU=$dry): no GPU required; $([ "$dry" = 1 ] && echo 'nothing runs after the build' || echo 'the steps run anyway, to exercise this script: without a GPU they skip or fail')"
elif ! command -v nvidia-smi >/dev/null; then
  miss "nvidia-smi (not on PATH): no NVIDIA driver tools, so no GPU can be used"
else
  gpus=$(timeout 10 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -c . || true)
  if [ "${gpus:-0}" -eq 0 ]; then
    miss "a GPU: nvidia-smi lists none ($(timeout 5 nvidia-smi -L 2>&1 | head -1))"
  else
    pre "ok: $gpus GPU(s): $(nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | head -1)"
  fi
fi

nvcc=${CUDACXX:-$(command -v nvcc || true)}
if [ -z "$nvcc" ] || [ ! -x "$nvcc" ]; then
  miss "nvcc (not on PATH, not in /usr/local/cuda/bin, CUDACXX unset): the CUDA toolkit"
else
  nvcc_v=$("$nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p')
  if version_ge "${nvcc_v:-0}" 12.0; then pre "ok: nvcc $nvcc_v ($nvcc)"; else miss "nvcc >= 12.0 (C++20), found ${nvcc_v:-unknown}"; fi
  cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)
  if [ -f "$cuda_home/include/cublas_v2.h" ] || ls "$cuda_home"/targets/*/include/cublas_v2.h >/dev/null 2>&1; then
    have_cublas=1
  else
    have_cublas=0
    pre "note: cuBLAS headers not found under $cuda_home: the train example (cuBLAS) will not be built"
  fi
fi

cxx=${CXX:-$(command -v g++ || command -v c++ || true)}
if [ -z "$cxx" ]; then
  miss "a C++ compiler (g++ or c++ on PATH, or CXX): nvcc needs one as its host compiler"
else
  cxx_v=$("$cxx" -dumpfullversion 2>/dev/null || "$cxx" -dumpversion 2>/dev/null)
  if "$cxx" --version 2>/dev/null | grep -qi gcc && ! version_ge "${cxx_v:-0}" 11; then
    miss "g++ >= 11 (C++20, <source_location>), found $cxx_v ($cxx)"
  else
    pre "ok: C++ compiler $cxx $cxx_v"
  fi
fi

if ! command -v cmake >/dev/null; then
  miss "cmake (not on PATH)"
else
  cmake_v=$(cmake --version | sed -n 's/cmake version \([0-9.]*\).*/\1/p')
  if version_ge "$cmake_v" 3.25; then pre "ok: cmake $cmake_v"; else miss "cmake >= 3.25, found $cmake_v"; fi
fi
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); pre "ok: ninja $(ninja --version)"; else pre "note: no ninja, using make"; fi

if [ ! -f "$kit/env.sh" ]; then
  miss "the GPU kit at $kit (build it with scripts/gpu-kit.sh and carry the folder gpu-kit; or set LOCKSTEP_KIT)"
else
  # shellcheck source=/dev/null
  . "$kit/env.sh"
  [ -x "$kit/usr/bin/orterun" ] || miss "the kit's mpiexec ($kit/usr/bin/orterun)"
  [ -f "$LOCKSTEP_KIT_MPI_H" ] || miss "the kit's mpi.h ($LOCKSTEP_KIT_MPI_H)"
  [ -f "$LOCKSTEP_KIT_CATCH2_DIR/Catch2Config.cmake" ] || miss "the kit's Catch2 ($LOCKSTEP_KIT_CATCH2_DIR)"
  [ -f "$kit/usr/share/cmake/CLI11/CLI11Config.cmake" ] || miss "the kit's CLI11"
  [ -f "$kit/usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake" ] || miss "the kit's nlohmann-json"
  need=$(cat "$kit/GLIBC_NEEDED" 2>/dev/null | sed 's/GLIBC_//')
  have=$(ldd --version 2>/dev/null | head -1 | grep -o '[0-9]\+\.[0-9]\+$')
  if [ -n "$need" ] && [ -n "$have" ] && ! version_ge "$have" "$need"; then
    miss "glibc >= $need for the kit (built on Debian 12); this machine has $have"
  fi
  if mv=$(timeout 10 "$kit/usr/bin/mpiexec" --version 2>&1 | head -1) && [ -n "$mv" ]; then
    pre "ok: kit mpiexec: $mv; mpi.h: $LOCKSTEP_KIT_MPI_H"
  else
    miss "a working kit mpiexec: '$kit/usr/bin/mpiexec --version' failed: $mv"
  fi
fi

# NCCL: NCCL_ROOT, else the folder of the nvidia-nccl-cu* wheel (include/nccl.h, lib/libnccl.so.2).
nccl_root=${NCCL_ROOT:-}
if [ -z "$nccl_root" ] && command -v python3 >/dev/null; then
  nccl_root=$(timeout 10 python3 - <<'EOF' 2>/dev/null
import glob, os, sys
for p in sys.path:
    if not os.path.isdir(os.path.join(p, "nvidia")):
        continue
    # The wheel's usual folders first, then any folder under nvidia/ (a slower walk).
    for pattern in ("nvidia/nccl/include/nccl.h", "nvidia/cu*/include/nccl.h", "nvidia/**/include/nccl.h"):
        for h in sorted(glob.glob(os.path.join(p, pattern), recursive=True)):
            print(os.path.dirname(os.path.dirname(h)))
            sys.exit(0)
sys.exit(1)
EOF
  ) || nccl_root=""
fi
if [ -z "$nccl_root" ]; then
  miss "nccl.h: NCCL_ROOT is unset and python3 found no nvidia-nccl-cu* wheel (nvidia/**/include/nccl.h on sys.path)"
else
  nccl_h=$nccl_root/include/nccl.h
  nccl_so=$(ls "$nccl_root"/lib/libnccl.so* "$nccl_root"/lib64/libnccl.so* 2>/dev/null | head -1)
  if [ ! -f "$nccl_h" ]; then miss "nccl.h in $nccl_root/include"; fi
  if [ -z "$nccl_so" ]; then miss "libnccl.so in $nccl_root/lib"; fi
  if [ -f "$nccl_h" ] && [ -n "$nccl_so" ]; then
    nccl_v=$(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) /{printf "%s%s", sep, $3; sep="."}' "$nccl_h")
    if version_ge "$nccl_v" 2.12; then pre "ok: NCCL $nccl_v ($nccl_h, $nccl_so)"; else miss "NCCL >= 2.12, found $nccl_v"; fi
    export NCCL_ROOT=$nccl_root
    nccl_lib=$(dirname "$nccl_so")
    export LD_LIBRARY_PATH=$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
fi
sanitizer=$(command -v compute-sanitizer || true)
[ -n "$sanitizer" ] || pre "note: compute-sanitizer not found: the memcheck step will be reported NOT RUN"

pre "preflight: $missing missing piece(s), $(($(date +%s) - start)) s"
if [ "$missing" -gt 0 ]; then
  summary "preflight FAILED: $missing missing piece(s):"
  grep '^MISSING' "$out/preflight.txt" | tee -a "$out/summary.txt" >/dev/null
  exit 2
fi
[ "${LOCKSTEP_GPU_CHECK_PREFLIGHT_ONLY:-0}" = 1 ] && { summary "preflight passed (stopping: LOCKSTEP_GPU_CHECK_PREFLIGHT_ONLY=1)"; exit 0; }

{
  echo "== nvidia-smi"; timeout 10 nvidia-smi 2>&1 || true
  echo "== nvcc"; "$nvcc" --version
  echo "== NCCL"; echo "$nccl_root (version $nccl_v)"
  echo "== MPI (kit)"; mpiexec --version 2>&1 | head -1; cat "$kit/MANIFEST.txt"
  echo "== cmake"; cmake --version | head -1
  echo "== compiler"; c++ --version | head -1
  echo "== host"; uname -a; nproc; ldd --version | head -1
} >"$out/system.txt" 2>&1

# ---------------------------------------------------------------------------------------------
# 2. Steps
# ---------------------------------------------------------------------------------------------
# step NAME LIMIT command...: runs with a timeout of min(LIMIT, what is left of the budget),
# logs to OUT/NAME.log, records PASS / FAIL / SKIPPED (exit 77) / TIMEOUT.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -le 5 ]; then
    summary "$(printf '%-28s %s' "$name" "NOT RUN (budget spent)")"
    failed=1
    return 1
  fi
  local t0 rc=0
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  local verdict
  case $rc in
    0) verdict=PASS ;;
    77) verdict=SKIPPED ;;
    124 | 137) verdict="TIMEOUT after ${limit}s"; failed=1 ;;
    *) verdict="FAIL (exit $rc)"; failed=1 ;;
  esac
  summary "$(printf '%-28s %-22s %4ss' "$name" "$verdict" "$(($(date +%s) - t0))")"
  return "$rc"
}
note() { summary "$(printf '%-28s %s' "$1" "$2")"; }

arch=${CMAKE_CUDA_ARCHITECTURES:-}
if [ -z "$arch" ]; then
  arch=$(timeout 10 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
  arch=${arch:-90}
fi
examples=OFF
[ "${have_cublas:-0}" = 1 ] && examples=ON
# shellcheck disable=SC2086  # LOCKSTEP_KIT_CMAKE_ARGS is a list of -D arguments
step configure 90 cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DLOCKSTEP_WITH_CUDA=ON -DLOCKSTEP_WITH_NCCL=ON -DLOCKSTEP_WITH_TORCH=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DNCCL_ROOT="$NCCL_ROOT" -DMPIEXEC_EXECUTABLE="$LOCKSTEP_KIT_MPIEXEC" \
  $LOCKSTEP_KIT_CMAKE_ARGS \
  -DLOCKSTEP_BUILD_TESTS=ON -DLOCKSTEP_BUILD_BENCH=ON -DLOCKSTEP_BUILD_EXAMPLES="$examples"
targets=(test_cuda_kernels test_mpi_device test_nccl_backend test_nccl_training gpu_bench)
[ "$examples" = ON ] && targets+=(train)
step build "${LOCKSTEP_GPU_CHECK_BUILD_LIMIT:-240}" cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"

exe() { find "$build" -name "$1" -type f -perm -u+x 2>/dev/null | head -1; }
if [ -n "$(exe test_nccl_backend)" ]; then
  ldd "$(exe test_nccl_backend)" >"$out/ldd_test_nccl_backend.txt" 2>&1 || true
  grep -E 'libcudart|libnccl|libmpi' "$out/ldd_test_nccl_backend.txt" | sed 's/^/  /' >>"$out/system.txt"
fi
if [ "$dry" = 1 ]; then
  summary "dry run: configured and built; no GPU step was run"
  summary "total $(($(date +%s) - start))s"
  [ "$failed" -eq 0 ] && exit 0 || exit 1
fi

# A command, not a shell function: `timeout` runs it.
run=(mpiexec --bind-to none)
export DIST_TEST_NCCL=true DIST_TEST_MPI=true
if [ -z "$(exe test_cuda_kernels)" ]; then
  summary "the test programs were not built: see build.log"
  failed=1
else
  step cuda_kernels.np1 60 "${run[@]}" -n 1 "$(exe test_cuda_kernels)"
  step mpi_device.np1 60 "${run[@]}" -n 1 "$(exe test_mpi_device)"
  step mpi_device.np2 60 "${run[@]}" -n 2 "$(exe test_mpi_device)"
  step nccl_backend.np1 60 "${run[@]}" -n 1 "$(exe test_nccl_backend)"
  step nccl_training.np1 45 "${run[@]}" -n 1 "$(exe test_nccl_training)"
  if [ "$gpus" -ge 2 ]; then
    step nccl_backend.np2 60 "${run[@]}" -n 2 "$(exe test_nccl_backend)"
    step nccl_training.np2 45 "${run[@]}" -n 2 "$(exe test_nccl_training)"
  else
    note "NCCL" "single rank only (1 GPU: NCCL refuses two ranks on one GPU)"
    # Two ranks on the one GPU: NCCLBackend must fail with a clear message, never hang (every
    # rank throws NcclError; the ranks agree over MPI that ncclCommInitRank failed). gpu_bench
    # creates an NCCLBackend first and prints any error with the rank ("gpu_bench: ...
    # [rank 1/2]"). An error here is the expected outcome.
    log=$out/nccl_np2_one_gpu.log
    rc=0
    t0=$(date +%s)
    LOCKSTEP_TIMEOUT=30 timeout --kill-after=10 60 mpiexec --bind-to none -n 2 "$(exe gpu_bench)" --quick \
      --out "$out/nccl_np2" >"$log" 2>&1 || rc=$?
    took=$(($(date +%s) - t0))
    ranks_reporting=$(grep -o -E '\[rank [01]/2\]' "$log" | sort -u | wc -l)
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      note nccl_np2_one_gpu "FAIL: hung until the 60 s timeout (see nccl_np2_one_gpu.log)"
      failed=1
    elif [ "$rc" -eq 0 ]; then
      note nccl_np2_one_gpu "NCCL accepted 2 ranks on one GPU, ${took}s (nothing to check)"
    elif [ "$ranks_reporting" -ge 1 ] && grep -q -E 'gpu_bench: .*(NCCL|nccl)' "$log"; then
      # gpu_bench calls MPI_Abort after printing its error, which may end the other rank before
      # it prints its own: one rank's message and no hang is what can be required here.
      note nccl_np2_one_gpu "PASS: failed cleanly in ${took}s ($ranks_reporting of 2 ranks printed the error before the abort): $(grep -m1 -o 'gpu_bench: .*' "$log" | cut -c1-150)"
    else
      note nccl_np2_one_gpu "FAIL: exit $rc in ${took}s without an error naming each rank (see nccl_np2_one_gpu.log)"
      failed=1
    fi
  fi

  # train: --device cuda against --device cpu, same seed: the per-epoch losses within 1e-4.
  if [ -n "$(exe train)" ]; then
    train_pair() {  # NAME RANKS BACKEND
      local name=$1 n=$2 backend=$3
      step "train_${name}_cpu" 60 "${run[@]}" -n "$n" "$(exe train)" --epochs 20 --seed 7 --device cpu \
        --backend mpi --log "$out/train_${name}_cpu.csv" || return 0
      step "train_${name}_cuda" 60 "${run[@]}" -n "$n" "$(exe train)" --epochs 20 --seed 7 --device cuda \
        --backend "$backend" --log "$out/train_${name}_cuda.csv" || return 0
      if awk -F, 'NR==FNR { if (FNR > 1) cpu[$1] = $2; next }
                  FNR > 1 { n++; if (!($1 in cpu)) { bad = 1; next }
                            d = $2 - cpu[$1]; if (d < 0) d = -d; s = cpu[$1] < 0 ? -cpu[$1] : cpu[$1];
                            r = s > 0 ? d / s : d; if (r > worst) worst = r }
                  END { printf "%d epochs, worst relative difference %.3g\n", n, worst;
                        exit (bad || n != 20 || worst > 1e-4) ? 1 : 0 }' \
        "$out/train_${name}_cpu.csv" "$out/train_${name}_cuda.csv" >"$out/train_${name}_compare.txt"; then
        note "train_${name}_compare" "PASS: $(cat "$out/train_${name}_compare.txt")"
      else
        note "train_${name}_compare" "FAIL: $(cat "$out/train_${name}_compare.txt")"
        failed=1
      fi
    }
    train_pair mpi_np2 2 mpi
    train_pair nccl_np1 1 nccl
  else
    note "train" "NOT RUN (not built: no cuBLAS, see preflight.txt)"
    failed=1
  fi

  step gpu_bench 90 "${run[@]}" -n 1 "$(exe gpu_bench)" --out "$out" || true

  if [ -n "$sanitizer" ]; then
    # On a gVisor machine compute-sanitizer has refused the device ("Device not supported",
    # docs of the lent machines): that is the sandbox, not a finding about the kernels.
    if ! step cuda_kernels.memcheck 120 "${run[@]}" -n 1 "$sanitizer" --tool memcheck --error-exitcode 99 \
      "$(exe test_cuda_kernels)" && grep -q 'Device not supported' "$out/cuda_kernels.memcheck.log"; then
      sed -i 's/^\(cuda_kernels.memcheck *\)FAIL (exit [0-9]*)/\1NOT SUPPORTED HERE/' "$out/summary.txt"
      note "  -> memcheck" "compute-sanitizer refused the device (gVisor?); not counted as a failure"
      failed=$(grep -q -E '^[^ ]+ +(FAIL|TIMEOUT|NOT RUN)' "$out/summary.txt" && echo 1 || echo 0)
    fi
  else
    note "cuda_kernels.memcheck" "NOT RUN (compute-sanitizer not found)"
    failed=1
  fi
fi

# ---------------------------------------------------------------------------------------------
# 3. Tables and figures
# ---------------------------------------------------------------------------------------------
if [ -f "$out/allreduce.csv" ]; then
  summary ""
  summary "allreduce at 1 rank = CALL OVERHEAD (no data moves): bytes, NCCLBackend us/call, raw ncclAllReduce us/call"
  tail -n +2 "$out/allreduce.csv" | awk -F, '{printf "  %12s %10.1f %10.1f\n", $1, $2, $3}' | tee -a "$out/summary.txt" >/dev/null
fi
if [ -f "$out/kernels.csv" ]; then
  summary ""
  summary "kernels: name, elements, bytes moved, ms, GB/s, fraction of the copy kernel"
  awk -F, 'NR == 1 { next } $1 == "copy_kernel" { copy = $5 } { rows[NR] = $0 }
           END { for (i = 2; i <= NR; i++) { split(rows[i], f, ",");
                 printf "  %-30s %10s %12s %9.3f %9.1f %6.2f\n", f[1], f[2], f[3], f[4], f[5], copy > 0 ? f[5] / copy : 0 } }' \
    "$out/kernels.csv" | tee -a "$out/summary.txt" >/dev/null
fi

if command -v gnuplot >/dev/null && [ -f "$out/allreduce.csv" ] && [ -f "$out/kernels.csv" ]; then
  gnuplot >"$out/gnuplot.log" 2>&1 <<EOF || summary "gnuplot failed: see gnuplot.log"
set datafile separator ','
set terminal pngcairo size 900,560
set output '$out/allreduce.png'
set title 'allreduce call overhead on one GPU: NCCLBackend vs raw NCCL (host waits for completion)'
set logscale xy
set xlabel 'message size (bytes)'
set ylabel 'time per call (us)'
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
[ "$failed" -eq 0 ] && exit 0 || exit 1
