#!/usr/bin/env bash
# The MAML example in TorchOpt's driver/worker form (--driver: rank 0 runs the outer loop, the
# tasks go to every rank by remote calls) gives the SPMD form's result on the same seed, at 3
# ranks (7 tasks spread unevenly) and at 1 rank (every call to the driver itself).
source "$(dirname "$0")/common.sh"
flags=(--iterations 200 --tasks 7 --eval-every 100)
after() { awk '/^held-out post-adaptation loss/ {print $'"$1"'}' out.txt; }
run 3 "${flags[@]}" || fail "SPMD -n 3 exited with $?"
spmd=$(after 6)
run 3 "${flags[@]}" --driver || fail "driver -n 3 exited with $?"
drv3=$(after 6)
grep -q "driver form" out.txt || fail "-n 3 --driver did not run the driver form"
if rel_close "$spmd" "$drv3" 1e-4; then pass "driver -n 3 equals SPMD -n 3: $drv3 vs $spmd"; else fail "driver -n 3 '$drv3' vs SPMD '$spmd'"; fi
run 1 "${flags[@]}" --driver || fail "driver -n 1 exited with $?"
drv1=$(after 6)
if rel_close "$spmd" "$drv1" 1e-4; then pass "driver -n 1 equals SPMD -n 3: $drv1 vs $spmd"; else fail "driver -n 1 '$drv1' vs SPMD '$spmd'"; fi
finish
