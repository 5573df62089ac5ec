#!/usr/bin/env bash
# Stage multihost: the gpt example (examples/torch/gpt.cpp, tiny preset) trained for a few steps
# at 2x2 (ranks 0,1 on host 0, ranks 2,3 on host 1, over the simulated link) with
# --deterministic ends with the model hash of one process on this machine; its loss lines are
# the same too. The cluster (scripts/cluster.sh, LOCKSTEP_CLUSTER) must be up with 2 hosts.
# Usage: gpt.sh GPT_BINARY WORKDIR
set -uo pipefail
exe=$1
work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
args=(--preset tiny --steps 6 --eval-every 3 --deterministic --sample 0)
timeout 120 bash "$root/scripts/cluster.sh" run -n 4 --map-by ppr:2:node -- "$exe" "${args[@]}" >two.txt 2>two.err
rc=$?
[ "$rc" -eq 0 ] || { echo "FAIL: 2x2 run exited with $rc"; tail -20 two.err; exit 1; }
timeout 120 mpiexec -n 1 "$exe" "${args[@]}" >one.txt 2>one.err || { echo "FAIL: -n 1 run exited with $?"; tail -20 one.err; exit 1; }
grep -q '4 ranks' two.txt || { echo "FAIL: the 2x2 run did not report 4 ranks"; head -3 two.txt; exit 1; }
h2=$(tail -n 1 two.txt) h1=$(tail -n 1 one.txt)
c2=$(grep '^step ' two.txt | sed 's/ (lr.*//') c1=$(grep '^step ' one.txt | sed 's/ (lr.*//')
if [[ $h1 == "model hash crc32c:"* ]] && [ "$h1" = "$h2" ] && [ -n "$c1" ] && [ "$c1" = "$c2" ]; then
  echo "ok: gpt --deterministic at 2x2 = one process: ${h1#model hash } ($(echo "$c1" | tail -n 1))"
else
  echo "FAIL: 2x2 '$h2' / '$c2'; one process '$h1' / '$c1'"
  exit 1
fi
