#!/usr/bin/env bash
# Benchmarks across hosts on the simulated cluster (scripts/cluster.sh, issue 26 item 5), side by
# side in one run, with the machine and the link in the output:
#   - the link: what raw MPI gets through it (bench_link: one way, both ways, a 2-rank
#     MPI_Allreduce), unshaped and under each tbf setting tried, so the shaped figures can be
#     read against a rate TCP actually fills;
#   - gradient averaging (bench_gradsync, ResNet-50 and GPT-2 small): Lockstep's
#     DistributedOptimizer against raw MPI (one allreduce per tensor, pack everything, 25 MiB
#     buckets) with Open MPI's default collectives (tuned) and with its hierarchical ones
#     (coll_han, --mca coll_han_priority 100, under a timeout: it crashed at 2x2 with 4.1.4),
#     and the link bound (the bytes each host must send over the link / the rate);
#   - the bf16 wire against f32 (bench_scale's gradient sync rows);
#   - synchronize against raw MPI_Bcast (bench_synchronize);
# at 2 hosts x 1 rank and 2 hosts x 2 ranks, on the unshaped link and on the shaped one.
# Prints the tables of every program, then a summary; keeps every program's JSON and log in OUT.
#
# Usage (root; build the benchmarks first: cmake --build build --target bench_gradsync
#        bench_synchronize bench_scale bench_link):
#   bench/multihost.sh [--build DIR] [--out DIR] [--rate 2gbit] [--burst SIZE] [--latency TIME]
#                      [--lists resnet50,gpt2_small] [--sweep-list resnet50|none] [--bursts "64kb 256kb 2mb"]
#                      [--timeout S] [--han-timeout S] [--skip-unshaped] [--skip-shaped] [--no-yield]
# --rate/--burst/--latency: the shaped link (cluster.sh up's options; burst and latency default
# to cluster.sh's: 8 ms of the rate, at least 256 kB; 20 ms). --bursts: the tbf buckets whose
# fill is measured with bench_link before the shaped runs (the issue's first try, burst 4mb
# latency 50ms, is always among them). --timeout: the limit of each bench_gradsync run (s; the
# others have 300 s), --han-timeout that of the coll_han runs. Exit status: 0, 1 if a run failed other than HAN's (its failure is recorded),
# 77 if the cluster cannot be made here (not root, no namespaces).
#
# Every run has Open MPI's mpi_yield_when_idle=1 (--no-yield: Open MPI's default, 0): the
# simulated hosts share this machine's cores, with whatever else runs on it, and a rank that
# busy-polls for its peer's answer holds a core the peer may need to send that answer; each
# message exchange of a collective then waits for a scheduler time slice (docs/performance/across-hosts.md,
# "Across hosts"). bench_link's per-call table is taken both ways on the unshaped link, so the
# run shows what the setting changes. A real cluster gives each rank a core of its own.
#
# The cluster is LOCKSTEP_CLUSTER (default lockstep-bench) on LOCKSTEP_CLUSTER_SUBNET (default
# 10.231.0); it is taken down at the end, also when the script is interrupted.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build
OUT=""
RATE=2gbit BURST="" LATENCY=""
LISTS=resnet50,gpt2_small SWEEP=resnet50
BURSTS="64kb 256kb 2mb"
TIMEOUT=900 HAN_TIMEOUT=300 SHORT_TIMEOUT=300
DO_UNSHAPED=1 DO_SHAPED=1 YIELD=1
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=$(cd "$2" && pwd); shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --burst) BURST=$2; shift 2 ;;
    --latency) LATENCY=$2; shift 2 ;;
    --lists) LISTS=$2; shift 2 ;;
    --sweep-list) SWEEP=$2; shift 2 ;;
    --bursts) BURSTS=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --han-timeout) HAN_TIMEOUT=$2; shift 2 ;;
    --skip-unshaped) DO_UNSHAPED=0; shift ;;
    --skip-shaped) DO_SHAPED=0; shift ;;
    --no-yield) YIELD=0; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "multihost.sh: unknown option '$1' (--help)" >&2; exit 2 ;;
  esac
done
export LOCKSTEP_CLUSTER=${LOCKSTEP_CLUSTER:-lockstep-bench}
[ "$YIELD" = 1 ] && export OMPI_MCA_mpi_yield_when_idle=1
# Two TCP connections per pair of processes, as MPIBackend sets by default (mpi_backend_global.cpp):
# with one, a rendezvous acknowledgement queues behind the bulk data going the other way in the
# same connection, and traffic both ways at once (an allreduce's) gets about half the rate per
# direction. Set here too because bench_link is plain MPI.
export OMPI_MCA_btl_tcp_links=${OMPI_MCA_btl_tcp_links:-2}
CLUSTER=$ROOT/scripts/cluster.sh
B=$BUILD/bench
for p in bench_gradsync bench_synchronize bench_scale bench_link; do
  [ -x "$B/$p" ] || { echo "multihost.sh: $B/$p is missing; build it (cmake --build $BUILD --target $p)" >&2; exit 2; }
done
[ "$(id -u)" -eq 0 ] || { echo "multihost.sh: needs root (scripts/cluster.sh makes network namespaces); skipped" >&2; exit 77; }
OUT=${OUT:-$ROOT/results/multihost-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
trap '"$CLUSTER" down; exit 130' INT TERM
FAILED=0

say() { printf '\n==== %s\n' "$*"; }
# up TAG [cluster.sh up options]: (re)makes the 2-host cluster and records its qdisc.
up() {
  local tag=$1; shift
  "$CLUSTER" up 2 "$@" || { echo "multihost.sh: cluster.sh up failed" >&2; exit 77; }
  "$CLUSTER" status | tee "$OUT/link-$tag.status"
}
# run NAME LIMIT [mpiexec args] -- program args: one run under a time limit, its output kept
# (and shown), its exit status in NAME.rc.
run() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS rc
  timeout -k 10 "$limit" "$CLUSTER" run "$@" > >(tee "$OUT/$name.log") 2>&1
  rc=$?
  echo "$rc" >"$OUT/$name.rc"
  echo "[$name: exit $rc, $((SECONDS - start)) s]"
  return "$rc"
}
# gradsync TAG: bench_gradsync, bench_synchronize and bench_scale at 2x1 and 2x2, and
# bench_gradsync with coll_han at 2x2.
suite() {
  local tag=$1 p
  for p in 1 2; do
    local n=$((2 * p)) pl="2x$p" map="--map-by ppr:$p:node"
    say "$tag, $pl: bench_gradsync"
    # shellcheck disable=SC2086
    run "gradsync-$tag-$pl" "$TIMEOUT" -n $n $map -- "$B/bench_gradsync" --quick --lists "$LISTS" \
      --sweep-list "$SWEEP" --json "$OUT/gradsync-$tag-$pl.json" || FAILED=1
    if [ "$p" -gt 1 ]; then
      say "$tag, $pl: bench_gradsync with Open MPI's coll_han (--mca coll_han_priority 100)"
      # shellcheck disable=SC2086
      run "gradsync-han-$tag-$pl" "$HAN_TIMEOUT" -n $n $map --mca coll_han_priority 100 -- "$B/bench_gradsync" \
        --quick --lists "$LISTS" --sweep-list none --json "$OUT/gradsync-han-$tag-$pl.json" ||
        echo "multihost.sh: coll_han run failed (exit $(cat "$OUT/gradsync-han-$tag-$pl.rc")); recorded"
    fi
    say "$tag, $pl: bench_synchronize"
    # shellcheck disable=SC2086
    run "sync-$tag-$pl" "$SHORT_TIMEOUT" -n $n $map -- "$B/bench_synchronize" --quick \
      --json "$OUT/sync-$tag-$pl.json" || FAILED=1
    say "$tag, $pl: bench_scale (bf16 wire against f32)"
    # shellcheck disable=SC2086
    run "scale-$tag-$pl" "$SHORT_TIMEOUT" -n $n $map -- "$B/bench_scale" --quick --lists resnet50 \
      --json "$OUT/scale-$tag-$pl.json" || FAILED=1
  done
}
link() {  # link TAG [mpiexec args] [-- bench_link args]: bench_link at 2x1
  local tag=$1 margs=() largs=()
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do margs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  largs=("$@")
  run "link-$tag" 300 -n 2 --map-by ppr:1:node "${margs[@]}" -- "$B/bench_link" --json "$OUT/link-$tag.json" \
    "${largs[@]}" || FAILED=1
}

{
  echo "multihost.sh: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
  echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $(free -g | awk '/^Mem:/{print $2}') GiB"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); other processes: $(ps -e --no-headers | wc -l)"
  echo "kernel $(uname -r); $(mpiexec --version 2>&1 | head -1)"
  echo "shaped link: rate $RATE${BURST:+ burst $BURST}${LATENCY:+ latency $LATENCY}; lists $LISTS"
  echo "Open MPI mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-0 (default)}, btl_tcp_links=$OMPI_MCA_btl_tcp_links"
} | tee "$OUT/machine.txt"

if [ "$DO_UNSHAPED" = 1 ]; then
  say "unshaped link"
  up unshaped
  link unshaped
  link unshaped-noyield --mca mpi_yield_when_idle 0
  suite unshaped
fi
if [ "$DO_SHAPED" = 1 ]; then
  say "shaped link: which tbf bucket lets TCP fill $RATE"
  for b in $BURSTS; do
    up "tbf-$b" --rate "$RATE" --burst "$b" --latency "${LATENCY:-20ms}"
    link "tbf-$b" -- --per-call-total 0
  done
  up "tbf-4mb-50ms" --rate "$RATE" --burst 4mb --latency 50ms
  link "tbf-4mb-50ms" -- --per-call-total 0
  say "shaped link: the runs"
  shaped_opts=(--rate "$RATE")
  [ -n "$BURST" ] && shaped_opts+=(--burst "$BURST")
  [ -n "$LATENCY" ] && shaped_opts+=(--latency "$LATENCY")
  up shaped "${shaped_opts[@]}"
  link shaped
  suite shaped
fi
"$CLUSTER" down
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"

say "summary"
python3 "$ROOT/bench/multihost_summary.py" "$OUT" "$RATE" | tee "$OUT/summary.md"
echo "results in $OUT"
exit "$FAILED"
