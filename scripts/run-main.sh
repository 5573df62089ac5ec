#!/usr/bin/env bash
# The main job, from a fresh Debian machine: installs what is missing, configures (Release),
# builds, and runs the main program under mpiexec with 4 ranks.
#
# Usage: bash scripts/run-main.sh
# Environment: LOCKSTEP_BUILD_DIR (default build), LOCKSTEP_JOBS (default nproc).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD_DIR=${LOCKSTEP_BUILD_DIR:-build}
JOBS=${LOCKSTEP_JOBS:-$(nproc)}

# Open MPI refuses to run as root without these, and 4 ranks may exceed the machine's cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

bash scripts/install-deps.sh
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" --parallel "$JOBS"

# The main program: each rank prints its world info and an allreduce result.
main_job() {
  mpiexec -n 4 --oversubscribe "$BUILD_DIR/examples/hello_world"
}
main_job
