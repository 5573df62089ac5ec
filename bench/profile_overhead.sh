#!/usr/bin/env bash
# Instructions Lockstep adds to one small allreduce, measured with callgrind at 2 ranks (an exact
# count, unaffected by the load on a shared machine; the MPI call itself is excluded because its
# count includes busy-waiting for the partner), beside the whole call and a raw MPI_Allreduce.
# Usage: bench/profile_overhead.sh [BUILD_DIR]   (needs valgrind; builds bench_overhead)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=${1:-${BUILD_DIR:-$(dirname "$here")/build-bench}}
command -v valgrind >/dev/null || { echo "profile_overhead.sh: valgrind not installed" >&2; exit 77; }
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
cmake --build "$build" -j2 --target bench_overhead >/dev/null
out=$(mktemp -d)
calls=2000
mpiexec -n 2 --bind-to none valgrind --tool=callgrind --callgrind-out-file="$out/cg.%p" \
  "$build/bench/bench_overhead" "$calls" >/dev/null 2>&1
f=$(ls "$out"/cg.* | head -n 1)
callgrind_annotate --inclusive=yes --threshold=100 "$f" > "$out/incl.txt" 2>/dev/null
count() { { grep -E "$1" "$out/incl.txt" || true; } | head -n 1 | awk '{gsub(",", "", $1); print $1}'; }
# The whole Lockstep call (Backend's front end, since 0.2; MPIBackend::allreduce before), the
# transfer inside it (the shared-memory path's copy and sum, or PMPI_Allreduce where a call goes
# to MPI), and the raw loop's MPI_Allreduce for comparison.
total=$(count 'lockstep::Backend::allreduce\(lockstep::TensorView, lockstep::ReduceOp, std::source_location\)')
[ -n "$total" ] || total=$(count 'MPIBackend::allreduce\(lockstep::TensorView, lockstep::ReduceOp\)')
shm=$(count 'ShmCollectives::allreduce\(')
mpi=$(callgrind_annotate --tree=calling --inclusive=yes "$f" 2>/dev/null \
  | grep -A3 '\*  .*guarded_allreduce\|\*  .*do_allreduce' | grep 'PMPI_Allreduce' | head -n 1 \
  | awk '{gsub(",", "", $1); print $1}' || true)
raw=$(count 'raw_loop\(')
scope=$(count 'CollectiveScope::CollectiveScope')
unscope=$(count 'CollectiveScope::~CollectiveScope')
awk -v t="${total:-0}" -v m="${mpi:-0}" -v h="${shm:-0}" -v r="${raw:-0}" -v s="${scope:-0}" \
    -v u="${unscope:-0}" -v c="$calls" 'BEGIN {
  printf "instructions per Lockstep allreduce call (8 B), the transfer included: %.0f\n", t / c
  printf "  outside the transfer (the shared-memory copy and sum, or PMPI_Allreduce): %.0f\n", (t - m - h) / c
  printf "  of which the reliability hook (CollectiveScope constructor + destructor): %.0f\n", (s + u) / c
  printf "instructions per raw MPI_Allreduce call (8 B): %.0f\n", r / c
}'
rm -rf "$out"
