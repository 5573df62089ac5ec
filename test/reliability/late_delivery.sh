#!/usr/bin/env bash
# Runs late_delivery (see late_delivery.cpp) under mpiexec with the LOCKSTEP_* variables of the
# environment (LOCKSTEP_FAULT=rank=F,kind=freeze,...) and checks every rank's line: the frozen
# rank F came back and reported, every other rank got TimeoutError, and no rank's buffer changed
# after its collective had thrown.
# Usage: late_delivery.sh NPROCS PROGRAM FROZEN_RANK COUNT LINGER_S
set -u
nprocs=$1 program=$2 frozen=$3 count=$4 linger=$5
outdir=$(mktemp -d /tmp/lockstep-late.XXXXXX)
trap 'rm -rf "$outdir"' EXIT
"${MPIEXEC:-mpiexec}" -n "$nprocs" --oversubscribe --bind-to none "$program" "$outdir" "$count" "$linger" \
  >"$outdir/mpiexec.log" 2>&1
echo "mpiexec exit code $? (ranks leave without MPI_Finalize); LOCKSTEP_FAULT=${LOCKSTEP_FAULT:-} LOCKSTEP_TIMEOUT=${LOCKSTEP_TIMEOUT:-}"
fail=0
for ((r = 0; r < nprocs; r++)); do
  f=$outdir/rank.$r
  if [ ! -s "$f" ]; then
    echo "FAIL: rank $r wrote no report"; fail=1; continue
  fi
  cat "$f"
  grep -q "buffer changed after the failure: 0 of" "$f" || { echo "FAIL: rank $r's buffer was written after its collective had thrown"; fail=1; }
  if [ "$r" != "$frozen" ]; then
    grep -q "^rank $r: timeout" "$f" || { echo "FAIL: rank $r did not get TimeoutError"; fail=1; }
  fi
done
if [ "$fail" != 0 ]; then
  echo "--- mpiexec output:"; cat "$outdir/mpiexec.log"
  exit 1
fi
echo "OK"
