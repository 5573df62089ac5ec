#!/bin/bash
# Open MPI's allreduce algorithm at 2 hosts x 2 on the 500 Mbit cluster: default decision vs forced ring / Rabenseifner.
cd /work/main
export LOCKSTEP_CLUSTER=lsalg OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl_tcp_links=2 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
trap 'bash scripts/cluster.sh down >/dev/null 2>&1' EXIT
bash scripts/cluster.sh up 2 --rate 500mbit || exit 1
for alg in default 4 6 default 4 6; do
  extra=()
  [ "$alg" != default ] && extra=(--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm $alg)
  echo "=== algorithm $alg  $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  timeout 300 bash scripts/cluster.sh run -n 4 --map-by ppr:2:node "${extra[@]}" -- /work/bt/bench/bench_gradsync --quick --lists resnet50 --sweep-list none 2>&1
done
