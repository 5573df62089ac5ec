#!/usr/bin/env bash
# The MAML example: the held-out post-adaptation loss falls (by at least 20% in 200
# meta-iterations; measured 4.37 -> 3.05, 30%), and 7 tasks spread unevenly over 3 ranks give the
# same meta-model as one rank running all 7 (mean_reducer weights by partition size).
source "$(dirname "$0")/common.sh"
flags=(--iterations 200 --tasks 7 --eval-every 100)
after() { awk '/^held-out post-adaptation loss/ {print $'"$1"'}' out.txt; }
run 3 "${flags[@]}" || fail "-n 3 exited with $?"
first=$(after 4)
last3=$(after 6)
if [ -n "$first" ] && awk -v a="$first" -v b="$last3" 'BEGIN { exit !(b < 0.8 * a) }'; then
  pass "-n 3 held-out loss improved: $first -> $last3"
else
  fail "-n 3 held-out loss did not improve by 20%: '$first' -> '$last3'"
fi
run 1 "${flags[@]}" || fail "-n 1 exited with $?"
last1=$(after 6)
if rel_close "$last1" "$last3" 1e-3; then pass "-n 1 and -n 3 agree: $last1 vs $last3"; else fail "-n 1 '$last1' vs -n 3 '$last3'"; fi
run 2 --tasks 0
rc=$?
[ "$rc" -ne 0 ] && [ "$(grep -c 'error: --tasks' err.txt)" -eq 2 ] && pass "bad flag refused on both ranks" || fail "bad flag: exit $rc"
finish
