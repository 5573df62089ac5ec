#!/usr/bin/env bash
# lockstep-run --rescue with examples/train --rescue on this machine (issue 43): rank 2 of 4
# SIGKILLed in epoch 2 (LOCKSTEP_FAULT kind=kill, first attempt only). lockstep-run passes
# --enable-recovery to mpiexec, so the three survivors outlive the loss: their allreduce fails
# at LOCKSTEP_TIMEOUT, each writes its rescue state and exits. The attempt counts as failed
# although mpiexec exits 0 (the ranks' own ends decide), the restart resumes from the rescue
# state of the step of the fault (no checkpoint on disk: none is due in 4 epochs) and the run
# finishes; the summary says the restart took the freshest state the ranks agreed on.
# Called as: lockstep_run_rescue.sh MPIEXEC TRAIN_BINARY WORKDIR
source "$(dirname "$0")/../examples/common.sh"
RUNNER=${TEST_LOCKSTEP_RUN:?the built lockstep-run (set by ctest)}
[ -x "$RUNNER" ] || { echo "no $RUNNER"; exit 1; }
cat >wrap.sh <<EOW
#!/usr/bin/env bash
if [ "\${LOCKSTEP_RUN_ATTEMPT:-}" = 0 ]; then export LOCKSTEP_FAULT=rank=2,kind=kill,after=40; fi
exec "$EXE" "\$@"
EOW
chmod +x wrap.sh
LOCKSTEP_TIMEOUT=2 timeout 120 "$RUNNER" -n 4 --rescue --max-restarts 1 --mpiexec "$MPIEXEC" \
  --mpiexec-arg --oversubscribe --mpiexec-arg --bind-to --mpiexec-arg none -- ./wrap.sh --epochs 4 \
  --checkpoint run/ck --checkpoint-every 10 --rescue --resume auto >out.txt 2>err.txt
rc=$?
[ "$rc" -eq 0 ] && pass "lockstep-run --rescue: exit 0" || fail "lockstep-run exited $rc: $(tail -5 err.txt)"
grep -q "injecting fault kind=kill on rank 2" err.txt || fail "the fault was not injected"
grep -q "^lockstep-run: .* running: .*--enable-recovery" err.txt && pass "mpiexec ran with --enable-recovery" ||
  fail "--rescue did not pass --enable-recovery to mpiexec"
# mpiexec forwards the ranks' stderr as it comes: another rank's unfinished line can sit in front
# of a rank's message, so the messages are found anywhere in a line, one file name per rank.
written=$(grep -o "lockstep: rescue state of step [0-9]* written to run/ck.rescue/rescue-[0-9]*-r[0-9]*" err.txt | sort -u)
n=$(grep -c . <<<"$written")
[ "$n" -eq 3 ] && pass "the 3 survivors wrote their rescue state" || fail "$n rescue state(s) written (3 expected)"
grep -q "attempt 1 failed after .*(but a rank failed)\|attempt 1 failed after" err.txt &&
  pass "attempt 1 counted as failed" || fail "attempt 1 not counted as failed"
grep -q "attempt 2 succeeded .*(1 restart(s))" err.txt && pass "one restart, then success" || fail "no successful restart"
step=$(sed -n -E 's/^lockstep: rescue state of step ([0-9]+) written.*/\1/p' <<<"$written" | sort -n | tail -1)
if grep -q "^resuming from the rescue state run/ck.rescue/rescue-0*$step-r[0-9].safetensors" out.txt &&
  grep -q "^resumed from run/ck.rescue/.* (step $step)" out.txt; then
  pass "resumed from the rescue state of step $step (the step of the fault)"
else
  fail "not resumed from the rescue state of step $step: $(grep -m2 '^resum' out.txt)"
fi
grep -q "^first step after the resume done: step $((step + 1))" out.txt && pass "the first step after the resume is step $((step + 1))" ||
  fail "no first step $((step + 1)) after the resume"
grep -q '^done: 4 epochs' out.txt || fail "the run did not finish 4 epochs"
grep -q "resumed from: the freshest state the ranks agree on" err.txt && pass "the summary names the freshest state" ||
  fail "the summary: $(grep -A3 'summary' err.txt)"
[ -z "$(ls run/ck.rescue 2>/dev/null)" ] && pass "no rescue state left (the final checkpoint supersedes them)" ||
  fail "rescue states left: $(ls run/ck.rescue)"
finish
