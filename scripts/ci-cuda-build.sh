#!/usr/bin/env bash
# CI stage: compile Lockstep with CUDA and NCCL on a machine that has the CUDA toolkit but no
# GPU, then run the GPU tests to show they report themselves skipped (never passed).
#
#   scripts/ci-cuda-build.sh [BUILD_DIR]      (default: build-ci-cuda in the repository)
#
# Configures into its own build directory with -DLOCKSTEP_WITH_CUDA=ON -DLOCKSTEP_WITH_NCCL=ON
# (CMAKE_CUDA_ARCHITECTURES=90 unless set, to keep nvcc's time small), builds the libraries, the
# programs with CUDA code and the executables of the tests below (not the CPU-only ones), and
# runs ctest -L nccl twice: without DIST_TEST_NCCL (skipped by the gate) and with
# DIST_TEST_NCCL=true (the programs start, find no GPU and exit 77 = skipped), then runs the
# tests labelled nogpu (registration, argument checks and clean errors without a device, which
# do run here), and the package test (the install used from a machine without CUDA). Fails if
# any GPU test reports "passed" or "failed" on a machine without a GPU: a pass there would be a
# lie.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# Absolute: the executables of the tests are picked below by matching the (absolute) paths in
# the commands CTest lists.
build=$(realpath -m "${1:-$root/build-ci-cuda}")
jobs=${LOCKSTEP_JOBS:-2}
export PATH=$PATH:/usr/local/cuda/bin
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if ! command -v nvcc >/dev/null; then
  echo "ci-cuda-build: nvcc not found (looked in PATH and /usr/local/cuda/bin): skipping" >&2
  exit 77
fi

timeout 300 cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON \
  -DLOCKSTEP_WITH_CUDA=ON -DLOCKSTEP_WITH_NCCL=ON -DLOCKSTEP_WITH_TORCH=OFF -DLOCKSTEP_BUILD_TOOLS=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES:-90}" \
  -DCMAKE_CXX_FLAGS_RELEASE="${LOCKSTEP_CUDA_STAGE_CXX_FLAGS:--O0 -DNDEBUG}"
# lockstep-run is left out (the core stage builds, installs and tests it): this stage's package
# test installs only what it built.
# Only what this stage runs or what only it compiles: the libraries, the programs with CUDA code
# (train has a CUDA path), and the executables of the tests it runs (labels nccl and nogpu,
# read from CTest). The CPU tests, examples and benchmarks are the core stage's (same code, built
# there without CUDA).
mapfile -t test_targets < <(cd "$build" && ctest -N -L 'nccl|nogpu' --show-only=json-v1 |
  python3 -c 'import json, os, sys
b = sys.argv[1]
names = {os.path.basename(a) for t in json.load(sys.stdin)["tests"] for a in t.get("command", [])
         if a.startswith(b + "/")}
print("\n".join(sorted(names)))' "$build")
mapfile -t known < <(cmake --build "$build" --target help | sed -n 's/^\.\.\. \([A-Za-z0-9_]*\).*/\1/p')
targets=(lockstep_core lockstep_cuda lockstep_nccl train)
for t in "${test_targets[@]}"; do
  if printf '%s\n' "${known[@]}" | grep -qxF "$t"; then targets+=("$t"); fi
done
echo "== building: ${targets[*]}"
timeout 1500 cmake --build "$build" -j "$jobs" --target "${targets[@]}"

echo "== ctest -L nccl (gate closed)"
(cd "$build" && timeout 300 ctest -L nccl --output-on-failure) | tee "$build/ci-cuda-ctest-gated.log"
echo "== ctest -L nccl with DIST_TEST_NCCL=true"
(cd "$build" && DIST_TEST_NCCL=true timeout 600 ctest -L nccl --output-on-failure) |
  tee "$build/ci-cuda-ctest-run.log"

echo "== ctest -L nogpu (the extensions' behaviour without a GPU, really run)"
(cd "$build" && DIST_TEST_MPI=true timeout 300 ctest -L nogpu --output-on-failure)

# The package of this CUDA + NCCL build: installed, then a core-only user configured, built and
# run with CUDA and NCCL hidden (neither may even be looked for), a missing component refused
# with its reason, and lockstep::nccl linked where CUDA is visible (test/package/).
echo "== package.install: find_package(lockstep) of a CUDA + NCCL install, with and without CUDA"
(cd "$build" && timeout 600 ctest -R '^package\.install$' --output-on-failure)

if ! nvidia-smi -L >/dev/null 2>&1; then
  # Without a GPU every GPU test must be skipped, none passed.
  for log in "$build/ci-cuda-ctest-gated.log" "$build/ci-cuda-ctest-run.log"; do
    if grep -E 'Test +#[0-9]+: .* (Passed|Failed)' "$log"; then
      echo "ci-cuda-build: a GPU test passed or failed on a machine without a GPU (see above)" >&2
      exit 1
    fi
  done
  echo "ci-cuda-build: built with CUDA and NCCL; all GPU tests skipped (no GPU here)"
fi
