#!/bin/bash
# bench_collectives before (8840ed2) and after (HEAD), alternating, np 2, quiet machine
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
O=/work/main/results/quiet-20261205-s5/ab-collectives${SUFFIX:-}; mkdir -p $O
{ date -u; uptime; lscpu | sed -n 's/^Model name: *//p'; } > $O/machine.txt
for i in 1 2 3; do
  for w in before after; do
    mpiexec -n 2 /work/wt-$w/build/bench/bench_collectives --reps 15 --target-ms 5 --max-bytes 33554432 > $O/$w-$i.md 2>&1
    LOCKSTEP_SHM=0 mpiexec -n 2 /work/wt-$w/build/bench/bench_collectives --reps 15 --target-ms 5 --max-bytes 33554432 > $O/$w-noshm-$i.md 2>&1
  done
done
uptime >> $O/machine.txt
