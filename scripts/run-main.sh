#!/usr/bin/env bash
# The main job, from a fresh Debian machine: installs what is missing, configures (Release),
# builds the train example (and hello_world, for docs/multi-node.md), and runs train under
# mpiexec with 4 ranks: data-parallel training of Flux's DistributedUtils example
# (Dense(1=>256, tanh), Dense(256=>1) on y = x^3, Adam, 100 epochs), ending with where the loss
# CSV and its plot (a PNG, drawn by gnuplot) went. Extra arguments go to train (see
# docs/examples.md), e.g. `bash scripts/run-main.sh --epochs 20`.
#
# Usage: bash scripts/run-main.sh [train flags...]
# Environment: LOCKSTEP_BUILD_DIR (default build), LOCKSTEP_JOBS (default nproc).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD_DIR=${LOCKSTEP_BUILD_DIR:-build}
JOBS=${LOCKSTEP_JOBS:-$(nproc)}

# Open MPI refuses to run as root without these, and 4 ranks may exceed the machine's cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# gnuplot-nox: train --log CSV draws the loss curve into CSV.png with it.
bash scripts/install-deps.sh gnuplot-nox
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
# Only what the main job runs (the library and the example), and hello_world, the first program
# docs/multi-node.md runs across (simulated) machines; scripts/test.sh builds the rest.
cmake --build "$BUILD_DIR" --parallel "$JOBS" --target train hello_world

# The main program: 4 ranks (more than CI's 2 cores, hence --oversubscribe), each printing
# nothing but rank 0, which prints one line per epoch and a summary.
main_job() {
  local log="$BUILD_DIR/train_loss.csv"
  mpiexec -n 4 --oversubscribe --bind-to none "$BUILD_DIR/examples/train/train" --log "$log" "$@"
  log="$(cd "$(dirname "$log")" && pwd)/$(basename "$log")"
  # train removes an earlier run's picture before plotting: a PNG there is this run's.
  if [ -f "$log.png" ]; then
    echo "main job done: per-epoch loss in $log, its plot in $log.png"
  else
    echo "main job done: per-epoch loss in $log (no plot: see the 'loss plot' line above)"
  fi
}
main_job "$@"
