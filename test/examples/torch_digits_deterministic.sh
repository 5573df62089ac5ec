#!/usr/bin/env bash
# Deterministic training with lockstep::torch (issue 42), as a user checks it: `torch_digits
# --deterministic` (global batch 60 in micro-batches of 10: at -n 4 the ranks hold 2, 2, 1 and 1)
# ends with one model hash at -n 1, 2 and 4; the same flags without --deterministic give
# different hashes at -n 1 and -n 4 (the check can fail); a deterministic run stopped at 4 ranks
# and resumed at 2 ends with the uninterrupted run's hash. Every run's last line is
# `model hash crc32c:XXXXXXXX`. --micro-batch without --deterministic is refused on every rank.
# Skipped (77) when python3-sklearn's digits.csv.gz is not installed.
source "$(dirname "$0")/common.sh"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
data=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
[ -f "$data" ] || { echo "skipped: $data missing (apt-get install python3-sklearn)"; exit 77; }
common=(--epochs 2 --batch 60)
det=(--deterministic --micro-batch 10)

declare -A hash
for n in 1 2 4; do
  run "$n" "${common[@]}" "${det[@]}" || fail "-n $n --deterministic exited with $?"
  grep -q 'global batch 60 (6 micro-batches of 10, deterministic)' out.txt || fail "-n $n: no deterministic header"
  hash[$n]=$(last_hash)
done
expect_one_model 1 2 4
expect_plain_runs_differ "${common[@]}"

# Stopped at 4 ranks after 1 epoch, resumed at 2 ranks to 2 epochs: the uninterrupted model.
run 4 "${det[@]}" --batch 60 --epochs 1 --checkpoint ck.safetensors || fail "-n 4 first part exited with $?"
run 2 "${common[@]}" "${det[@]}" --checkpoint ck.safetensors --resume || fail "-n 2 resume exited with $?"
grep -q 'resumed from ck.safetensors after epoch 1' out.txt || fail "-n 2 resume did not report epoch 1"
expect_resumed_model 4 2

expect_refused 2 '--micro-batch.*needs --deterministic' "${common[@]}" --micro-batch 10
expect_refused 2 '--batch.*60 is not a multiple of --micro-batch 16' --deterministic --micro-batch 16
finish
