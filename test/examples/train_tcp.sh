#!/usr/bin/env bash
# The train example over Open MPI's TCP transport on the loopback interface (the path a
# multi-node job takes, see docs/multi-node.md) gives the same final loss as shared memory.
source "$(dirname "$0")/common.sh"
common=(--samples 1024 --epochs 10)
run 2 "${common[@]}" || fail "shared-memory run exited with $?"
sm=$(final_loss)
timeout 120 "$MPIEXEC" -n 2 --oversubscribe --bind-to none --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo \
  "$EXE" "${common[@]}" >out.txt 2>err.txt || fail "TCP run exited with $?"
tcp=$(final_loss)
if [ -n "$sm" ] && [ "$sm" = "$tcp" ]; then pass "TCP final loss $tcp equals shared memory's"; else fail "TCP loss '$tcp' vs shared memory '$sm'"; fi
finish
