#!/usr/bin/env bash
# Deterministic training (issue 42), as a user checks it: `train --deterministic` ends with one
# model hash at -n 1, 2, 3 and 4 (global batch 240 in micro-batches of 10; 980 samples, so the
# last global batch has 2 micro-batches and some ranks none); the same flags without
# --deterministic give different hashes at -n 1 and -n 4 (the check can fail); a deterministic
# run stopped at 4 ranks and resumed at 3 ends with the uninterrupted run's hash. Every run's
# last line is `model hash crc32c:XXXXXXXX`. Bad --micro-batch flags are refused on every rank.
source "$(dirname "$0")/common.sh"
common=(--samples 980 --batch 240 --epochs 4)
det=(--deterministic --micro-batch 10)

# last_hash: the run's last line, which must be its model hash.
last_hash() {
  local last
  last=$(tail -n 1 out.txt)
  if [[ $last =~ ^model\ hash\ crc32c:[0-9a-f]{8}$ ]]; then echo "${last#model hash }"; else echo "BAD-LAST-LINE:$last"; fi
}

declare -A hash
for n in 1 2 3 4; do
  run "$n" "${common[@]}" "${det[@]}" || fail "-n $n --deterministic exited with $?"
  grep -q 'global batch 240 (24 micro-batches of 10, deterministic)' out.txt || fail "-n $n: no deterministic header"
  hash[$n]=$(last_hash)
done
if [ "${hash[1]}" = "${hash[2]}" ] && [ "${hash[1]}" = "${hash[3]}" ] && [ "${hash[1]}" = "${hash[4]}" ] &&
   [[ ${hash[1]} == crc32c:* ]]; then
  pass "--deterministic: one model at -n 1, 2, 3 and 4 (${hash[1]})"
else
  fail "--deterministic: hashes differ: -n 1 ${hash[1]}, -n 2 ${hash[2]}, -n 3 ${hash[3]}, -n 4 ${hash[4]}"
fi

# Without --deterministic the sums follow the rank count: the check must be able to fail.
run 1 "${common[@]}" || fail "-n 1 ordinary run exited with $?"
plain1=$(last_hash)
run 4 "${common[@]}" || fail "-n 4 ordinary run exited with $?"
plain4=$(last_hash)
if [[ $plain1 == crc32c:* ]] && [[ $plain4 == crc32c:* ]] && [ "$plain1" != "$plain4" ]; then
  pass "without --deterministic -n 1 and -n 4 differ ($plain1, $plain4)"
else
  fail "without --deterministic: -n 1 $plain1, -n 4 $plain4 (expected two different hashes)"
fi

# Stopped at 4 ranks after 2 epochs, resumed at 3 ranks to 4 epochs: the uninterrupted model.
run 4 "${common[@]}" "${det[@]}" --epochs 2 --checkpoint ck.safetensors || fail "-n 4 first part exited with $?"
run 3 "${common[@]}" "${det[@]}" --checkpoint ck.safetensors --resume || fail "-n 3 resume exited with $?"
grep -q 'resumed from ck.safetensors after epoch 2' out.txt || fail "-n 3 resume did not report epoch 2"
resumed=$(last_hash)
if [ "$resumed" = "${hash[1]}" ]; then
  pass "stopped at -n 4, resumed at -n 3: the uninterrupted model ($resumed)"
else
  fail "stopped at -n 4, resumed at -n 3: $resumed, uninterrupted ${hash[1]}"
fi
# A deterministic checkpoint resumed with another micro-batch would train another model: refused.
expect_failure 2 'error: --resume: the checkpoint was written with --micro-batch 10 but this run has 20' \
  "${common[@]}" --deterministic --micro-batch 20 --checkpoint ck.safetensors --resume

# Flags: --micro-batch needs --deterministic; the global batch must be whole micro-batches (and
# need not be a multiple of the rank count).
expect_refused 2 '--micro-batch.*needs --deterministic' "${common[@]}" --micro-batch 10
expect_refused 2 '--batch.*250 is not a multiple of --micro-batch 16' --deterministic --batch 250 --micro-batch 16
finish
