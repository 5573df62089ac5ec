#!/usr/bin/env bash
# Session 5's quiet measurements of deterministic mode (run with nothing else on the machine):
# bench_gradsync at 42a530b (the session's start, with the new bench_gradsync.cpp: no copy back)
# and after, alternating twice; then bench_torch's MLP, ordinary against deterministic, twice.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
O=/work/main/results/quiet-20261205-s5/det; mkdir -p "$O"
{ date -u; uptime; git -C /work/main log --oneline | head -1; lscpu | sed -n 's/^Model name: *//p'; } > "$O/machine.txt"
for i in 1 2; do
  for w in before after; do
    bin=/work/wt-after/build/bench/bench_gradsync; [ $w = after ] && bin=/work/main/build/bench/bench_gradsync
    mpiexec -n 2 --bind-to none $bin --lists resnet50,gpt2_small --only DistributedOptimizer > "$O/gradsync-$w-$i.log" 2>&1
  done
done
export MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912
for i in 1 2; do
  mpiexec -n 2 --bind-to none -x MALLOC_MMAP_THRESHOLD_ -x MALLOC_TRIM_THRESHOLD_ -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS \
    /work/main/build/bench/bench_torch --model mlp --variants lockstep,lockstep-deterministic,local > "$O/torch-mlp-$i.log" 2>&1
done
uptime >> "$O/machine.txt"; date -u >> "$O/machine.txt"
