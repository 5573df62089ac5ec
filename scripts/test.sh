#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what is missing, configures
# (Release), builds, and runs every CTest test with the MPI tests enabled (DIST_TEST_MPI=true).
# Exits non-zero if any stage fails. `.ci/run` calls this script.
#
# Usage: bash scripts/test.sh [stage...]     (default: every stage in STAGES, in order)
# Environment: LOCKSTEP_BUILD_DIR (default build), LOCKSTEP_JOBS (default nproc),
#              LOCKSTEP_CTEST_ARGS (extra ctest arguments, e.g. "-LE large").
#
# Each stage is a function named stage_<name>; to add one (a CUDA/NCCL compile-only build, a
# sanitizer build, a bounded fuzz run), define stage_<name> below and append <name> to STAGES.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD_DIR=${LOCKSTEP_BUILD_DIR:-build}
JOBS=${LOCKSTEP_JOBS:-$(nproc)}

export DIST_TEST_MPI=true
# Open MPI refuses to run as root without these (CI runs as root), and the tests start more
# ranks than the CI machine has cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

# Runs "$@" with every CUDA directory removed from PATH and the CUDA hints unset, so a build
# proves that the core needs no CUDA toolkit.
without_cuda() {
  local path
  path=$(printf '%s' "$PATH" | tr ':' '\n' | grep -v -i 'cuda' | paste -sd: -)
  env -u CUDACXX -u CUDA_PATH -u CUDA_HOME -u CUDAToolkit_ROOT PATH="$path" "$@"
}

# --- stages -------------------------------------------------------------------------------

# gnuplot-nox as scripts/run-main.sh installs it: the loss-plot test (example_train_plot) and
# stage main need it, and LOCKSTEP_REQUIRE_GNUPLOT=1 makes that test fail rather than skip
# where it is missing. LibTorch (libtorch-dev) for lockstep::torch, with python3-torch (the
# checkpoint test reads a file back in Python, the torch benchmark runs Python DDP) and
# python3-sklearn (the torch example's handwritten digits).
stage_deps() {
  bash scripts/install-deps.sh gnuplot-nox libtorch-dev python3-torch python3-sklearn
}
export LOCKSTEP_REQUIRE_GNUPLOT=1

# The core (and the LibTorch adapter) with CUDA hidden: configure, build everything, run every test.
# The library, examples and benchmarks at Release's -O3; the test programs at -O1
# (LOCKSTEP_TEST_CXX_FLAGS): a Catch2 test file compiles in half the time (14 s against 7 s for
# test/train/data_test.cpp), and their time at run is in the library they call (test_shm_collectives,
# whose references loop in the test itself, keeps -O3).
stage_core() {
  without_cuda cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_TEST_CXX_FLAGS=-O1 \
    -DLOCKSTEP_WITH_CUDA=OFF -DLOCKSTEP_WITH_NCCL=OFF -DLOCKSTEP_WITH_TORCH=ON -DLOCKSTEP_FAULT_INJECTION=ON || return 1
  without_cuda cmake --build "$BUILD_DIR" --parallel "$JOBS" || return 1
  # shellcheck disable=SC2086  # LOCKSTEP_CTEST_ARGS is a list of arguments
  (cd "$BUILD_DIR" && without_cuda ctest --output-on-failure --parallel "$JOBS" ${LOCKSTEP_CTEST_ARGS:-})
}

# The README's main job as a user runs it, scripts/run-main.sh, in the core stage's build
# directory (so it only reconfigures; train is built): 100 epochs at 4 ranks, a final loss below
# 1e-3, and the loss CSV and its plot (a PNG) at the absolute paths it prints. A few seconds.
stage_main() {
  local out="$BUILD_DIR/run-main.out" csv png loss
  LOCKSTEP_BUILD_DIR=$BUILD_DIR LOCKSTEP_JOBS=$JOBS without_cuda bash scripts/run-main.sh >"$out" 2>&1
  local rc=$?
  tail -8 "$out"
  [ "$rc" -eq 0 ] || { echo "stage main: scripts/run-main.sh exited with $rc"; return 1; }
  csv=$(sed -n 's/^loss CSV: //p' "$out")
  png=$(sed -n 's/^loss plot: //p' "$out")
  loss=$(awk '/^final loss/ {print $3}' "$out")
  awk -v l="$loss" 'BEGIN { exit !(l != "" && l + 0 < 1e-3) }' || { echo "stage main: final loss '$loss' not below 1e-3"; return 1; }
  [[ $csv == /* ]] && [ "$(wc -l <"$csv")" -eq 101 ] || { echo "stage main: no 100-epoch CSV at an absolute path: '$csv'"; return 1; }
  [[ $png == /* ]] && [ "$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] ||
    { echo "stage main: no PNG plot at an absolute path: '$png'"; return 1; }
  grep -qxF "main job done: per-epoch loss in $csv, its plot in $png" "$out" ||
    { echo "stage main: the last line does not name the CSV and the plot"; return 1; }
}

# CUDA and NCCL, compile only (CI has the toolkit but no GPU): builds every target with both
# extensions in its own directory and shows the GPU tests (label nccl) reported skipped, never
# passed. Passes as skipped where there is no nvcc. See scripts/ci-cuda-build.sh.
stage_cuda() {
  local rc=0
  LOCKSTEP_JOBS=$JOBS bash scripts/ci-cuda-build.sh "${LOCKSTEP_CUDA_BUILD_DIR:-build-cuda}" || rc=$?
  [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ]
}

# AddressSanitizer + UndefinedBehaviorSanitizer build of the core and its tests, running the unit
# and MPI tests (Open MPI's own leaks suppressed, each suppression commented). About 10-15 min
# on 2 cores. See scripts/ci-sanitize.sh.
stage_sanitize() {
  BUILD_DIR="$ROOT/${LOCKSTEP_ASAN_BUILD_DIR:-build-asan}" JOBS=$JOBS bash scripts/ci-sanitize.sh
}

# libFuzzer over the checkpoint reader, for LOCKSTEP_FUZZ_SECONDS (default 60), from the corpus
# in test/fuzz/corpus. See scripts/ci-fuzz.sh.
stage_fuzz() {
  BUILD_DIR="$ROOT/${LOCKSTEP_FUZZ_BUILD_DIR:-build-fuzz}" JOBS=$JOBS bash scripts/ci-fuzz.sh
}

STAGES=(deps core main cuda sanitize fuzz)

# --- driver -------------------------------------------------------------------------------
# In a function, called on the last line: bash then reads the whole file before running any of
# it, so editing this script while it runs cannot change what the running copy does.

main() {
  if [ $# -gt 0 ]; then
    STAGES=("$@")
  fi
  local failed=() name start
  for name in "${STAGES[@]}"; do
    if ! declare -F "stage_$name" >/dev/null; then
      echo "test.sh: no stage named '$name'; stages: $(declare -F | sed -n 's/^declare -f stage_//p' | paste -sd' ' -)" >&2
      return 2
    fi
    echo "==== stage $name"
    start=$SECONDS
    if "stage_$name"; then
      echo "==== stage $name: passed ($((SECONDS - start)) s)"
    else
      echo "==== stage $name: FAILED ($((SECONDS - start)) s)"
      failed+=("$name")
      # Nothing else can run without the dependencies.
      [ "$name" = deps ] && break
    fi
  done

  if [ ${#failed[@]} -ne 0 ]; then
    echo "test.sh: failed stages: ${failed[*]}"
    return 1
  fi
  echo "test.sh: all stages passed (${STAGES[*]})"
}

main "$@"; exit $?
