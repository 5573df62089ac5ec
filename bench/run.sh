#!/usr/bin/env bash
# Builds the benchmarks (if needed) and runs the whole set at NP ranks (2 by default), in a few
# minutes on a 2-core machine:
#   - tables on stdout and in $RESULTS_DIR/*.md, JSON in $RESULTS_DIR/*.json;
#   - $RESULTS_DIR/busbw.png (busbw against message size) when gnuplot is installed;
#   - the generated section of docs/performance/generated.md (between its GENERATED markers) rewritten
#     from those files, with the target table (needs python3; skipped with a note otherwise).
#
# Usage: bench/run.sh [--quick] [--no-docs]
# Environment: BUILD_DIR (default build-bench), NP (2), RESULTS_DIR (results/),
#   MPIEXEC (mpiexec), LOCKSTEP_BENCH_MPIFLAGS (extra mpiexec flags, default "--bind-to none"),
#   LOCKSTEP_SHAPES_DIR (shape lists, default bench/shapes),
#   LOCKSTEP_CHECK (passed through: measures the reliability checks' cost).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(dirname "$here")
build=${BUILD_DIR:-$top/build-bench}
np=${NP:-2}
results=${RESULTS_DIR:-$top/results}
mpiexec=${MPIEXEC:-mpiexec}
# No binding: on a 2-core machine shared with other work, pinning both ranks can only hurt.
read -r -a mpiflags <<< "${LOCKSTEP_BENCH_MPIFLAGS:---bind-to none}"
quick=()
docs=1
for a in "$@"; do
  case $a in
    --quick) quick=(--quick) ;;
    --no-docs) docs=0 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done

if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
ncores=$(nproc)
if [ "$np" -gt "$ncores" ]; then mpiflags+=(--oversubscribe); fi

# --- build -------------------------------------------------------------------------------------
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$top" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_BUILD_BENCH=ON \
    -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_WITH_CUDA=OFF -DLOCKSTEP_WITH_NCCL=OFF >/dev/null
fi
cmake --build "$build" -j2 --target lockstep_benchmarks
train_bin=""
if cmake --build "$build" -j2 --target train >/dev/null 2>&1; then
  train_bin=$(find "$build/examples" -type f -name train -perm -u+x 2>/dev/null | head -n 1)
fi

mkdir -p "$results"
bin=$build/bench
run_mpi() {  # run_mpi NAME RANKS ARGS...: runs bench_NAME (or $BENCH_EXE), table to NAME.md, JSON to NAME.json
  local name=$1 ranks=$2
  local exe=${BENCH_EXE:-bench_$name}
  shift 2
  echo "== $name ($ranks rank(s))" >&2
  "$mpiexec" -n "$ranks" "${mpiflags[@]}" "$bin/$exe" --json "$results/$name.json" "${quick[@]}" "$@" \
    | tee "$results/$name.md"
}

# --- machine -----------------------------------------------------------------------------------
{
  echo "- CPU: $(lscpu | sed -n 's/^Model name: *//p') ($(nproc) cores visible, $(lscpu | sed -n 's/^Thread(s) per core: *//p') thread(s) per core), L2 $(lscpu | sed -n 's/^L2 cache: *//p'), L3 $(lscpu | sed -n 's/^L3 cache: *//p')"
  echo "- Memory: $(free -g | awk '/^Mem:/ {print $2}') GiB; hypervisor: $(lscpu | sed -n 's/^Hypervisor vendor: *//p')"
  echo "- OS: $(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r)"
  echo "- MPI: $("$mpiexec" --version 2>&1 | head -n 1); compiler: $(c++ --version | head -n 1)"
  echo "- Load average at the start of the run: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "- Run: $(date -u '+%Y-%m-%d %H:%M UTC'), $np ranks, flags: ${mpiflags[*]}${LOCKSTEP_CHECK:+, LOCKSTEP_CHECK=$LOCKSTEP_CHECK}${quick:+ (--quick)}"
} > "$results/machine.md"
cat "$results/machine.md"

# --- benchmarks --------------------------------------------------------------------------------
# Many short timed blocks: on a loaded machine the least disturbed of them (min-of-N) is more
# likely to be undisturbed than one long block.
run_mpi collectives "$np" --dat "$results/collectives.dat" --reps 15 --target-ms 5
# The same sizes with MPIBackend's shared-memory path off: what the layer over MPI costs.
BENCH_EXE=bench_collectives LOCKSTEP_SHM=0 run_mpi collectives_mpi "$np" --max-bytes 33554432 \
  --reps 15 --target-ms 5
# The shared-memory path against MPI: slice sizes, small sizes, and cold buffers.
run_mpi shm "$np"
# One minute of one-second samples: how both paths move over time on this machine.
echo "== shm --watch 60 ($np rank(s))" >&2
"$mpiexec" -n "$np" "${mpiflags[@]}" "$bin/bench_shm" --watch 60 | tee "$results/shm_watch.md"
# Why the slots are written with streaming stores: cache-to-cache reads against reads from memory.
if [ -x "$bin/bench_phases" ]; then
  echo "== phases (2 ranks, 30 s)" >&2
  "$mpiexec" -n 2 "${mpiflags[@]}" "$bin/bench_phases" 30 | tee "$results/phases.md"
fi
run_mpi gradsync "$np"
if [ -x "$bin/bench_synchronize" ]; then run_mpi synchronize "$np"; fi
if [ -x "$bin/bench_optimizer" ]; then run_mpi optimizer 1; fi
# Save and load of a 1 GiB model against cp, in the temporary directory (a disk here).
if [ -x "$bin/bench_checkpoint" ]; then run_mpi checkpoint 1; fi

# What Lockstep adds to one small call: timed at 1 rank (where the raw in-place allreduce costs
# almost nothing) and counted in instructions with callgrind (exact, whatever the load).
{
  echo "## Per-call cost at 1 rank (small sizes), and instructions per call (callgrind, 2 ranks)"
  echo
  "$mpiexec" -n 1 "${mpiflags[@]}" "$bin/bench_collectives" --max-bytes 2048 --reps 9 \
    --json "$results/collectives_1rank.json" 2>/dev/null | sed -n '/^## allreduce/,/^## broadcast/p' | sed '1d;$d'
  if command -v valgrind >/dev/null 2>&1; then
    echo
    "$here/profile_overhead.sh" "$build" | sed 's/^/    /'
  fi
} | tee "$results/overhead.md"

# Training: the train example's samples/s at 1 and NP ranks, and the scaling efficiency.
if [ -n "$train_bin" ]; then
  echo "== training ($train_bin)" >&2
  "$here/train_scaling.sh" "$train_bin" "$np" "$results" "${mpiflags[@]}" | tee "$results/training.md"
else
  echo "(no train example built: training scaling skipped)" | tee "$results/training.md"
fi

echo "- Load average at the end of the run: $(cut -d' ' -f1-3 /proc/loadavg) ($(date -u '+%H:%M UTC'))" >> "$results/machine.md"

# --- plot --------------------------------------------------------------------------------------
if command -v gnuplot >/dev/null 2>&1; then
  gnuplot -e "datafile='$results/collectives.dat'; outfile='$results/busbw.png'" "$here/busbw.gp" \
    && echo "plot: $results/busbw.png" >&2
else
  echo "(gnuplot not found: no plot)" >&2
fi

# --- docs --------------------------------------------------------------------------------------
if [ "$docs" = 1 ]; then
  if command -v python3 >/dev/null 2>&1; then
    python3 "$here/summarize.py" "$results" "$top/docs/performance/generated.md"
  else
    echo "(python3 not found: docs/performance/generated.md not regenerated; tables are in $results)" >&2
  fi
fi
