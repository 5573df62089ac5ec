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

declare -A hash
for n in 1 2 3 4; do
  run "$n" "${common[@]}" "${det[@]}" || fail "-n $n --deterministic exited with $?"
  grep -q 'global batch 240 (24 micro-batches of 10, deterministic)' out.txt || fail "-n $n: no deterministic header"
  hash[$n]=$(last_hash)
done
expect_one_model 1 2 3 4
expect_plain_runs_differ "${common[@]}"

# Stopped at 4 ranks after 2 epochs, resumed at 3 ranks to 4 epochs: the uninterrupted model.
run 4 "${common[@]}" "${det[@]}" --epochs 2 --checkpoint ck.safetensors || fail "-n 4 first part exited with $?"
run 3 "${common[@]}" "${det[@]}" --checkpoint ck.safetensors --resume || fail "-n 3 resume exited with $?"
grep -q 'resumed from ck.safetensors after epoch 2' out.txt || fail "-n 3 resume did not report epoch 2"
expect_resumed_model 4 3
# A deterministic checkpoint resumed with another micro-batch would train another model: refused.
expect_failure 2 'error: --resume: the checkpoint was written with --micro-batch 10 but this run has 20' \
  "${common[@]}" --deterministic --micro-batch 20 --checkpoint ck.safetensors --resume

# Flags: --micro-batch needs --deterministic; the global batch must be whole micro-batches (and
# need not be a multiple of the rank count).
expect_refused 2 '--micro-batch.*needs --deterministic' "${common[@]}" --micro-batch 10
expect_refused 2 '--batch.*250 is not a multiple of --micro-batch 16' --deterministic --batch 250 --micro-batch 16
finish
