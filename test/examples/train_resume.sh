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
# Rotating checkpoints and --resume auto: with no checkpoint it starts afresh; stopped after 7
# epochs (checkpoints after 2, 4, 6 and 7, the last 2 kept) and resumed with the same command, it
# continues from epoch 7 and ends bitwise identical to the uninterrupted run.
rot=(--samples 1024 --batch 128 --checkpoint rot/ck --checkpoint-every 2 --checkpoint-keep 2 --resume auto)
run 2 "${rot[@]}" --epochs 7 || fail "rotating first part exited with $?"
grep -q '^no checkpoint at rot/ck.latest: starting afresh' out.txt && pass "--resume auto without a checkpoint starts afresh" ||
  fail "--resume auto without a checkpoint: $(head -n1 out.txt)"
[ "$(cd rot && echo ck-*.safetensors)" = "ck-000006.safetensors ck-000007.safetensors" ] &&
  [ "$(cat rot/ck.latest)" = ck-000007.safetensors ] && pass "the last 2 checkpoints kept, ck.latest names epoch 7" ||
  fail "kept: $(cd rot && echo ck-*), pointer $(cat rot/ck.latest)"
run 2 "${rot[@]}" --epochs 20 || fail "rotating resume exited with $?"
grep -q '^resumed from rot/ck-000007.safetensors after epoch 7 (step 56)' out.txt || fail "--resume auto did not resume from epoch 7"
[ "$(grep '^model hash' out.txt)" = "$(run 2 --samples 1024 --batch 128 --epochs 20 && grep '^model hash' out.txt)" ] &&
  pass "--resume auto: bitwise the uninterrupted run" || fail "--resume auto: model hash differs"
# Plain --resume with rotation and no pointer is an error, not a fresh start.
expect_failure 2 'error: --resume: no checkpoint to resume from (none/ck.latest does not exist)' \
  --samples 1024 --batch 128 --epochs 3 --checkpoint none/ck --checkpoint-keep 2 --resume
# --checkpoint-seconds: with T = 0.000001 a checkpoint after every epoch (rank 0's clock decides for all).
run 2 --samples 1024 --batch 128 --epochs 4 --checkpoint sec/ck --checkpoint-keep 10 --checkpoint-seconds 0.000001 ||
  fail "--checkpoint-seconds exited with $?"
[ "$(cd sec && echo ck-*.safetensors)" = "ck-000001.safetensors ck-000002.safetensors ck-000003.safetensors ck-000004.safetensors" ] &&
  pass "--checkpoint-seconds: one checkpoint per epoch" || fail "--checkpoint-seconds: $(cd sec && echo ck-*)"
finish
