#!/usr/bin/env bash
# A rank SIGKILLed in the middle of training (examples/train, checkpoints every 3 epochs): the
# job ends, mpiexec names the dead rank, and resuming from the last checkpoint written before
# the kill ends bitwise identical to an uninterrupted run (final checkpoint byte for byte, and
# the model hash). The kill comes from LOCKSTEP_FAULT (kind=kill) at collective #100 of rank 1.
# Called as: kill_resume.sh MPIEXEC TRAIN_BINARY WORKDIR
source "$(dirname "$0")/../examples/common.sh"
common=(--samples 1024 --batch 120 --epochs 20)
for n in 2 3; do
  run "$n" "${common[@]}" --checkpoint "full$n.st" || fail "-n $n full run exited with $?"
  full_hash=$(grep '^model hash' out.txt)
  LOCKSTEP_FAULT="rank=1,kind=kill,after=100" run "$n" "${common[@]}" --checkpoint-every 3 --checkpoint "part$n.st"
  rc=$?
  [ "$rc" -ne 0 ] || fail "-n $n: the run with a killed rank exited 0"
  grep -q "injecting fault kind=kill on rank 1" err.txt || fail "-n $n: the fault was not injected"
  if grep -q "process rank 1 with PID .* exited on signal 9" err.txt; then pass "-n $n: mpiexec names the killed rank"; else fail "-n $n: no message naming rank 1"; fi
  run "$n" "${common[@]}" --checkpoint "part$n.st" --resume || fail "-n $n resume exited with $?"
  grep -q 'resumed from .* after epoch [1-9]' out.txt || fail "-n $n: did not resume from a checkpoint written before the kill"
  grep -h 'resumed from' out.txt
  if cmp -s "full$n.st" "part$n.st"; then pass "-n $n resumed run's checkpoint is byte-identical"; else fail "-n $n checkpoints differ after resume"; fi
  [ "$(grep '^model hash' out.txt)" = "$full_hash" ] || fail "-n $n model hash differs"
done
finish
