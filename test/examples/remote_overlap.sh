#!/usr/bin/env bash
# The remote_overlap example: async calls to 3 ranks at once give the right integral, and the
# parallelize_async form agrees with a single call.
source "$(dirname "$0")/common.sh"
run 3 || fail "-n 3 exited with $?"
line=$(grep '^integral of sin' out.txt)
total=$(awk '{print $7}' <<<"$line")
exact=$(awk '{gsub(/[);]/, "", $9); print $9}' <<<"$line")
if rel_close "$exact" "$total" 1e-6; then pass "integral $total = exact $exact"; else fail "integral '$total' vs exact '$exact'"; fi
one=$(awk '{print $13}' <<<"$line")
whole=$(awk '{print $15}' <<<"$line")
[ -n "$one" ] && [ "$one" = "$whole" ] && pass "parallelize_async agrees: $whole" || fail "'$one' vs '$whole'"
finish
