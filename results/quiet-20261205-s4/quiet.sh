#!/usr/bin/env bash
# The quiet-window measurements of session 4 (run with nothing else on the machine).
cd /work/main
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
O=/work/main/build/quiet-$(date -u +%H%M); mkdir -p "$O"; echo "$O"
{ date -u; uptime; git log --oneline | head -1; lscpu | sed -n 's/^Model name: *//p'; } > "$O/machine.txt"
what=${1:-all}
if [[ $what == all || $what == alloc ]]; then
  for i in 1 2 3; do
    build/bench/bench_torch --model gpt --variants local --batch 16 --steps 20 --warmup 3 | grep "^| local" >> "$O/alloc-default.txt"
    MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912 build/bench/bench_torch --model gpt --variants local \
      --batch 16 --steps 20 --warmup 3 | grep "^| local" >> "$O/alloc-keep.txt"
  done
  echo "== allocator (default, then keep): step ms, fwd, backward"; cat "$O/alloc-default.txt" "$O/alloc-keep.txt"
fi
if [[ $what == all || $what == torch ]]; then
  BUILD_DIR=build RESULTS_DIR="$O/torch" PY_TIMEOUT=300 bench/torch/run.sh --no-resnet > "$O/torch-run.log" 2>&1
  echo "== run.sh rc $?"; sed -n '/^| model | variant/,$p' "$O/torch-run.log" | head -40
fi
if [[ $what == all || $what == gpt2x2 ]]; then
  LOCKSTEP_CLUSTER=lsq LOCKSTEP_CLUSTER_SUBNET=10.237.0 bench/torch/multihost.sh --out "$O/gpt-2x2" > "$O/gpt-2x2.log" 2>&1
  echo "== gpt 2x2 rc $?"; tail -12 "$O/gpt-2x2.log"
fi
if [[ $what == all || $what == gradsync ]]; then
  mpiexec -n 2 --bind-to none build/bench/bench_gradsync --lists resnet50,gpt2_small --sweep-list none \
    --json "$O/gradsync.json" > "$O/gradsync.log" 2>&1
  echo "== gradsync rc $?"; grep -E "^\||^#" "$O/gradsync.log" | head -60
fi
if [[ $what == all || $what == flat2x1 ]]; then
  export LOCKSTEP_CLUSTER=lsf LOCKSTEP_CLUSTER_SUBNET=10.236.0 OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl_tcp_links=2
  scripts/cluster.sh up 2 >/dev/null
  timeout 600 scripts/cluster.sh run -n 2 --map-by ppr:1:node -- build/bench/bench_gradsync --lists resnet50 \
    --sweep-list resnet50 --json "$O/flat2x1.json" > "$O/flat2x1.log" 2>&1
  echo "== flat 2x1 rc $?"; grep -E "^\||^#" "$O/flat2x1.log" | head -80
  scripts/cluster.sh down
fi
uptime >> "$O/machine.txt"
