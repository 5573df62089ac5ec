#!/usr/bin/env bash
# Stop and resume: a run stopped after epoch k and resumed ends bitwise identical to an
# uninterrupted run (the final checkpoints, which hold parameters, Adam moments, step count and
# loss history, are compared byte for byte, and so are the loss CSVs). At 2 and 4 ranks, stopping
# at an epoch that is and one that is not a multiple of --checkpoint-every.
source "$(dirname "$0")/common.sh"
common=(--samples 1024 --batch 128)
for n in 2 4; do
  run "$n" "${common[@]}" --epochs 20 --checkpoint "full$n.st" --log "full$n.csv" || fail "-n $n full run exited with $?"
  full_hash=$(grep '^model hash' out.txt)
  # Interrupted: 7 epochs with a checkpoint every 3 (written after 3, 6 and at the end, 7).
  run "$n" "${common[@]}" --epochs 7 --checkpoint-every 3 --checkpoint "part$n.st" || fail "-n $n first part exited with $?"
  run "$n" "${common[@]}" --epochs 20 --checkpoint "part$n.st" --resume --log "part$n.csv" || fail "-n $n resume exited with $?"
  grep -q 'resumed from .* after epoch 7 (step 56)' out.txt || fail "-n $n resume did not report epoch 7, step 56"
  if cmp -s "full$n.st" "part$n.st"; then pass "-n $n resumed checkpoint is byte-identical"; else fail "-n $n checkpoints differ after resume"; fi
  if cmp -s "full$n.csv" "part$n.csv"; then pass "-n $n loss CSV identical"; else fail "-n $n loss CSVs differ"; fi
  [ "$(grep '^model hash' out.txt)" = "$full_hash" ] || fail "-n $n model hash differs"
done
# Resuming with different data flags is refused on every rank.
expect_failure 2 'error: --resume: the checkpoint was written with --samples 1024' \
  --samples 2048 --batch 128 --epochs 20 --checkpoint part2.st --resume
finish
