#!/usr/bin/env bash
# lockstep-run (tools/lockstep_run) with real mpiexec runs of examples/train on this machine:
#  1. a rank SIGKILLed mid-run (LOCKSTEP_FAULT kind=kill, first attempt only): lockstep-run
#     restarts the job once on the same host at the same N, the run resumes from the newest
#     checkpoint, finishes all epochs with final loss < 1e-3, redoes at most one checkpoint
#     interval, and the last k checkpoints are kept (the pointer naming the newest);
#  1b. a rank frozen by SIGSTOP (its watchdog cannot answer, as on a lost host): with
#     LOCKSTEP_TIMEOUT=3 the others name it silent in their blame reports; restarted and resumed;
#  2. shrinking: two host names for this machine, the probe fails one: the restart runs on the
#     other at half the ranks and resumes the 4-rank checkpoint at 2 ranks;
#  3. --max-restarts 0: exits with mpiexec's failing status, no restart;
#  4. --min-ranks above what is left: stops with a message naming it;
#  5. a stall blame report (LOCKSTEP_REPORT_DIR) is read and the behind rank named;
#  6. a hung job (a rank exits 3, mpiexec told not to end the job for it) is ended after
#     --per-host-timeout;
#  7. bad arguments: exit 64 with a clear error;
#  8. a silent host: its rank frozen (SIGSTOP), named silent by the ranks of the other host, is
#     left out of the restart although its probe answers.
# Called as: lockstep_run.sh MPIEXEC TRAIN_BINARY WORKDIR
source "$(dirname "$0")/../examples/common.sh"
RUNNER=${TEST_LOCKSTEP_RUN:?the built lockstep-run (set by ctest)}
[ -x "$RUNNER" ] || { echo "no $RUNNER"; exit 1; }
mpiargs=(--mpiexec "$MPIEXEC" --mpiexec-arg --oversubscribe --mpiexec-arg --bind-to --mpiexec-arg none)
K=10     # checkpoint interval (epochs)
KEEP=3
common=(--batch 240 --epochs 100 --checkpoint run/ck --checkpoint-every "$K" --checkpoint-keep "$KEEP" --resume auto)

# The program lockstep-run starts: train, with the fault on the first attempt only (a restart
# must not be killed again at the same collective).
cat >wrap.sh <<EOF
#!/usr/bin/env bash
if [ "\${LOCKSTEP_RUN_ATTEMPT:-}" = 0 ] && [ -n "\${FAULT_FIRST:-}" ]; then export LOCKSTEP_FAULT="\$FAULT_FIRST"; fi
exec "$EXE" "\$@"
EOF
chmod +x wrap.sh

# lr ARGS...: lockstep-run, bounded; stdout to out.txt, stderr to err.txt.
lr() { timeout 200 "$RUNNER" "$@" >out.txt 2>err.txt; }
stamp() { sed -n -E "s/^lockstep-run: \[ *([0-9.]+)s\] $1.*/\1/p" err.txt | head -n1; }

# ---- 1. a killed rank: restart on the same host, same N ------------------------------------
rm -rf run
FAULT_FIRST="rank=1,kind=kill,after=1400" lr -n 3 "${mpiargs[@]}" -- ./wrap.sh "${common[@]}"
rc=$?
[ "$rc" -eq 0 ] || fail "killed rank: lockstep-run exited $rc"
grep -q "injecting fault kind=kill on rank 1" err.txt || fail "killed rank: the fault was not injected"
attempts=$(grep -c '^lockstep-run: .* attempt [0-9]* (restart' err.txt)
[ "$attempts" -eq 2 ] && grep -q 'attempt 2 succeeded .*(1 restart(s))' err.txt &&
  pass "killed rank: one restart, then success" || fail "killed rank: $attempts attempts"
grep -q 'rank 1 died on' err.txt && pass "killed rank: lockstep-run names rank 1" || fail "killed rank: rank 1 not named"
grep -q 'newest checkpoint: run/ck-0000[0-9]*.safetensors' err.txt || fail "killed rank: the newest checkpoint is not printed"
resumed=$(sed -n -E 's/^resumed from run\/ck-0*([0-9]+)\.safetensors after epoch ([0-9]+).*/\2/p' out.txt)
reached=$(awk '/^resumed from/ {exit} /^epoch/ {e = $2} END {print e + 0}' out.txt)
if [ -n "$resumed" ] && [ "$resumed" -gt 0 ] && [ $((reached - resumed)) -ge 0 ] && [ $((reached - resumed)) -le $K ]; then
  pass "killed rank: killed after epoch $reached, resumed from epoch $resumed: $((reached - resumed)) epoch(s) redone (<= $K)"
else
  fail "killed rank: resumed from '$resumed' after reaching epoch $reached"
fi
grep -q '^done: 100 epochs' out.txt || fail "killed rank: the run did not finish 100 epochs"
loss=$(final_loss)
less "$loss" 1e-3 && pass "killed rank: final loss $loss < 1e-3" || fail "killed rank: final loss '$loss'"
kept=$(cd run && echo ck-*.safetensors)
[ "$kept" = "ck-000080.safetensors ck-000090.safetensors ck-000100.safetensors" ] &&
  [ "$(cat run/ck.latest)" = ck-000100.safetensors ] &&
  pass "killed rank: the last $KEEP checkpoints are kept, ck.latest names epoch 100" ||
  fail "killed rank: kept '$kept', pointer '$(cat run/ck.latest 2>/dev/null)'"
t_fail=$(stamp 'attempt 1 failed') t_next=$(stamp 'attempt 2 ')
echo "figures: attempt 1 ended at ${t_fail}s (rank killed after epoch $reached), attempt 2 started at ${t_next}s;" \
  "$(grep -o 'attempt 2 succeeded after [0-9.]*s' err.txt)"

# ---- 1b. a frozen rank (SIGSTOP: like a lost host's, its watchdog cannot answer) ------------
# With LOCKSTEP_TIMEOUT=3 the other ranks raise TimeoutError naming it ("No answer from rank
# 1"), write their blame reports and exit; lockstep-run reads them and restarts.
rm -rf run
cat >stopwrap.sh <<EOF
#!/usr/bin/env bash
if [ "\$LOCKSTEP_RUN_ATTEMPT" = 0 ] && [ "\$OMPI_COMM_WORLD_RANK" = 1 ]; then
  "$EXE" "\$@" & pid=\$!
  # Stopped once the first checkpoint is committed (not after a fixed time: on a quiet machine
  # the whole run can end within seconds), so that there is a checkpoint to resume from.
  (for _ in \$(seq 1 2000); do [ -e run/ck.latest ] && break; sleep 0.01; done
   echo "test: SIGSTOP rank 1 at unix time \$EPOCHREALTIME" >&2; kill -STOP \$pid) &
  wait \$pid
  exit \$?
fi
exec "$EXE" "\$@"
EOF
chmod +x stopwrap.sh
t0=$EPOCHREALTIME
LOCKSTEP_TIMEOUT=3 lr -n 3 --per-host-timeout 10 "${mpiargs[@]}" -- ./stopwrap.sh "${common[@]}"
rc=$?
resumed=$(sed -n -E 's/^resumed from run\/ck-0*([0-9]+)\.safetensors after epoch ([0-9]+).*/\2/p' out.txt)
reached=$(awk '/^resumed from/ {exit} /^epoch/ {e = $2} END {print e + 0}' out.txt)
if [ "$rc" -eq 0 ] && grep -q 'failure seen: a rank reported a stall (blame\.' err.txt &&
  grep -q 'reports no answer from rank 1' err.txt && grep -q '(1 restart(s))' err.txt &&
  [ -n "$resumed" ] && [ $((reached - resumed)) -le "$K" ] && less "$(final_loss)" 1e-3; then
  pass "frozen rank: named silent in the blame reports, restarted, resumed from epoch $resumed (reached $reached), final loss $(final_loss)"
else
  fail "frozen rank: exit $rc, resumed '$resumed', reached $reached, final loss '$(final_loss)'; lockstep-run said:"
  grep 'lockstep-run' err.txt | tail -n 12
fi
t_stop=$(sed -n 's/^test: SIGSTOP rank 1 at unix time //p' err.txt)
awk -v t0="$t0" -v stop="$t_stop" -v seen="$(stamp 'failure seen')" -v failed="$(stamp 'attempt 1 failed')" \
  -v nxt="$(stamp 'attempt 2 ')" 'BEGIN { printf "figures: frozen rank: blame report seen %.1fs after the SIGSTOP (LOCKSTEP_TIMEOUT=3), mpiexec ended %.1fs later, attempt 2 started %.1fs after that\n", t0 + seen - stop, failed - seen, nxt - failed }'

# ---- 2. shrinking: one of two hosts fails its probe ----------------------------------------
rm -rf run
FAULT_FIRST="rank=3,kind=kill,after=1400" lr -H localhost:2,127.0.0.1:2 --probe 'test localhost !=' \
  "${mpiargs[@]}" -- ./wrap.sh "${common[@]}"
rc=$?
if [ "$rc" -eq 0 ] && grep -q 'dropping host localhost: the probe failed' err.txt &&
  grep -q 'restarting on 2 ranks on 127.0.0.1:2' err.txt && grep -q '^resumed from run/ck-' out.txt &&
  grep -q 'epochs: 2 ranks\|2 ranks, 4096 samples' out.txt && grep -q '^done: 100 epochs .* on 2 ranks' out.txt; then
  pass "shrinking: host localhost dropped, resumed at 2 ranks and finished ($(final_loss))"
else
  fail "shrinking: exit $rc"
fi

# ---- 3. --max-restarts 0: the program's failing status ---------------------------------------
rm -rf run
FAULT_FIRST="rank=1,kind=kill,after=200" lr -n 3 --max-restarts 0 "${mpiargs[@]}" -- ./wrap.sh "${common[@]}"
rc=$?
status=$(sed -n -E 's/.*mpiexec exit status ([0-9]+).*/\1/p' err.txt | head -n1)
if [ "$rc" -ne 0 ] && [ "$rc" = "$status" ] && grep -q 'giving up: 0 restart(s) made, --max-restarts 0' err.txt &&
  [ "$(grep -c 'attempt [0-9]* (restart' err.txt)" -eq 1 ]; then
  pass "--max-restarts 0: no restart, exit $rc (mpiexec's status)"
else
  fail "--max-restarts 0: exit $rc, mpiexec status '$status'"
fi

# ---- 4. --min-ranks above what is left (hosts from a hostfile) -----------------------------
rm -rf run
printf '# two names of this machine\nlocalhost slots=2\n127.0.0.1:2  # the second\n' >hosts.txt
FAULT_FIRST="rank=1,kind=kill,after=200" lr --hostfile hosts.txt --probe 'test localhost !=' --min-ranks 3 \
  "${mpiargs[@]}" -- ./wrap.sh "${common[@]}"
rc=$?
if [ "$rc" -ne 0 ] && grep -q 'stopping: 2 rank(s) left on the remaining hosts (127.0.0.1), fewer than --min-ranks 3' err.txt; then
  pass "--min-ranks 3 with 2 left: stops, exit $rc: $(grep -o 'stopping: .*' err.txt | head -n1)"
else
  fail "--min-ranks: exit $rc"
fi

# ---- 5. a stall: the blame report names the behind rank ------------------------------------
LOCKSTEP_TIMEOUT=2 FAULT_FIRST="rank=1,kind=delay,after=50,seconds=6" lr -n 3 --max-restarts 0 "${mpiargs[@]}" -- \
  ./wrap.sh --batch 240 --epochs 5
rc=$?
if [ "$rc" -ne 0 ] && grep -q 'failure seen: a rank reported a stall (blame\.' err.txt &&
  grep -q 'reports rank 1 behind' err.txt; then
  pass "stall: the blame report is read ($(grep -m1 -o 'rank [0-9] (on [^)]*) reports rank 1 behind' err.txt))"
else
  fail "stall: exit $rc; $(grep -c blame err.txt) blame line(s)"
  grep -v '^ *rank [0-9]' err.txt | cut -c1-200 | head -n 30
fi

# ---- 6. a hung job is ended after --per-host-timeout ---------------------------------------
# Rank 1 exits 3 (its agent tells lockstep-run), the others sleep on, and mpiexec, told not to
# end the job for a non-zero status, would wait for them for ever.
marker=$((RANDOM + 1000))
cat >hang.sh <<EOF
#!/usr/bin/env bash
[ "\$OMPI_COMM_WORLD_RANK" = 1 ] && exit 3
exec sleep $marker
EOF
chmod +x hang.sh
t0=$(date +%s)
lr -n 3 --max-restarts 0 --per-host-timeout 3 --mca orte_abort_on_non_zero_status 0 "${mpiargs[@]}" -- ./hang.sh
rc=$?
took=$(($(date +%s) - t0))
sleep 1
left=$(pgrep -f "sleep $marker" | wc -l)
if [ "$rc" -ne 0 ] && [ "$took" -le 20 ] && [ "$left" -eq 0 ] && grep -q 'killing its process group' err.txt &&
  grep -q 'failure seen: rank 1 exited with status 3' err.txt; then
  pass "hung job: ended by lockstep-run after ${took}s (--per-host-timeout 3), exit $rc, no rank left"
else
  fail "hung job: exit $rc after ${took}s, $left rank(s) left"
  for p in $(pgrep -f "sleep $marker"); do kill -9 "$p"; done
fi

# ---- 7. bad arguments ----------------------------------------------------------------------
bad() {
  local pattern=$1
  shift
  timeout 20 "$RUNNER" "$@" >out.txt 2>err.txt
  local rc=$?
  if [ "$rc" -eq 64 ] && grep -q "^lockstep-run: error: .*$pattern" err.txt && grep -q -- "--help" err.txt; then
    pass "'$*' refused: $(grep -m1 'error:' err.txt)"
  else
    fail "'$*': exit $rc, stderr: $(head -c 200 err.txt)"
  fi
}
bad 'no program' -n 2
bad "no program" -n 2 --
bad "-n: 'abc'" -n abc -- true
bad "--min-ranks 5 is more than the 3 ranks" -n 3 --min-ranks 5 -- true
bad "--max-restarts: '-1'" -n 2 --max-restarts -1 -- true
bad "--per-host-timeout: 'x'" -n 2 --per-host-timeout x -- true
bad "unknown option '--bogus'" --bogus -n 2 -- true
bad "--hostfile: cannot read" --hostfile /nonexistent -- true
bad "-n 5: the hosts have 4 slots" -H a:2,b:2 -n 5 -- true
bad "host 'a' has slots 'x'" -H a:x -- true
bad "--mca: needs a key and a value" -n 2 --mca btl -- true
bad "--mca: needs a key and a value" -n 2 --mca btl
bad "-n N is needed" -- true
bad "--mpiexec: '/nonexistent/mpiexec'" -n 1 --mpiexec /nonexistent/mpiexec -- true
timeout 20 "$RUNNER" --help >out.txt 2>err.txt && grep -q '^Usage: lockstep-run' out.txt && pass "--help" || fail "--help"

# ---- 8. a silent host is left out although it answers its probe -----------------------------
# Rank 2, alone on host 127.0.0.1, is frozen: ranks 0 and 1 (host localhost) name it silent in
# their blame reports; the probe ('true') answers for both hosts; the restart runs on localhost.
# Frozen once the first checkpoint is committed (not after a fixed time: on a quiet machine the
# whole run can end within a second), as in case 1b.
rm -rf run
cat >frozen.sh <<EOF
#!/usr/bin/env bash
if [ "\$LOCKSTEP_RUN_ATTEMPT" = 0 ] && [ "\$OMPI_COMM_WORLD_RANK" = 2 ]; then
  "$EXE" "\$@" & pid=\$!
  (for _ in \$(seq 1 2000); do [ -e run/ck.latest ] && break; sleep 0.01; done; kill -STOP \$pid) &
  wait \$pid
  exit \$?
fi
exec "$EXE" "\$@"
EOF
chmod +x frozen.sh
LOCKSTEP_TIMEOUT=2 lr -H localhost:2,127.0.0.1:1 --probe true --max-restarts 1 --per-host-timeout 10 \
  "${mpiargs[@]}" -- ./frozen.sh "${common[@]}"
rc=$?
if [ "$rc" -eq 0 ] && grep -q 'dropping host 127.0.0.1: its ranks went silent' err.txt &&
  grep -q 'restarting on 2 ranks on localhost:2' err.txt && grep -q '^done: 100 epochs' out.txt; then
  pass "silent host: 127.0.0.1 left out although its probe answers, restarted on localhost"
else
  fail "silent host: exit $rc; $(grep -E 'dropping|keeping|restarting|failure seen' err.txt | head -5)"
fi
finish
