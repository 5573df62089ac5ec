#!/usr/bin/env bash
# lockstep-run's own behaviour, with real mpiexec and trivial programs (seconds):
#  1. INT, TERM, HUP and QUIT sent to lockstep-run alone: every rank ends (ranks that ignore
#     TERM too: KILL after --term-grace), and lockstep-run exits 128+N (130, 143, 129, 131)
#     after its summary;
#  2. the summary: each attempt's ranks, how it ended, the first failure and where; --log-dir
#     keeps each rank's output and the summary;
#  3. text a program prints is not taken for a failure: a rank that prints Open MPI's and
#     Lockstep's failure wording, then succeeds, is not ended (--per-host-timeout 1).
# Called as: lockstep_run_signals.sh MPIEXEC ANY_BINARY WORKDIR (the binary is not used).
RUNNER=${TEST_LOCKSTEP_RUN:?the built lockstep-run (set by ctest)}
source "$(dirname "$0")/../examples/common.sh"
[ -x "$RUNNER" ] || { echo "no $RUNNER"; exit 1; }
mpiargs=(--mpiexec "$MPIEXEC" --mpiexec-arg --oversubscribe --mpiexec-arg --bind-to --mpiexec-arg none)

# ---- 1. the four signals ---------------------------------------------------------------------
marker=$((RANDOM + 20000))
printf '#!/bin/sh\ntrap "" TERM\nexec sleep %s\n' "$marker" >stubborn.sh
chmod +x stubborn.sh
ranks_left() { pgrep -f "sleep $marker" | wc -l; }
for sig in INT TERM HUP QUIT; do
  timeout 60 "$RUNNER" -n 3 --term-grace 1 "${mpiargs[@]}" -- ./stubborn.sh >out.txt 2>err.txt &
  pid=$!
  for _ in $(seq 200); do [ "$(ranks_left)" -ge 3 ] && break; sleep 0.05; done
  started=$(ranks_left)
  kill -s "$sig" "$pid"
  wait "$pid"
  rc=$?
  # Killed processes can be seen for a moment after lockstep-run returns (a loaded machine
  # delivers the KILL and reaps them later): every rank must be gone within 5 s.
  for _ in $(seq 100); do [ "$(ranks_left)" -eq 0 ] && break; sleep 0.05; done
  left=$(ranks_left)
  want=$((128 + $(kill -l "$sig")))
  if [ "$started" -eq 3 ] && [ "$rc" -eq "$want" ] && [ "$left" -eq 0 ] &&
    grep -q "got SIG$sig: ending the job" err.txt && grep -q "ended by lockstep-run on SIG$sig" err.txt; then
    pass "SIG$sig: every rank ended, exit $rc"
  else
    fail "SIG$sig: $started rank(s) started, exit $rc (wanted $want), $left rank(s) left; $(grep lockstep-run err.txt | tail -3)"
    for p in $(pgrep -f "sleep $marker"); do kill -9 "$p"; done
  fi
done

# ---- 2. the summary and --log-dir ------------------------------------------------------------
cat >flaky.sh <<'EOS'
#!/bin/sh
echo "rank $OMPI_COMM_WORLD_RANK says hello in attempt $LOCKSTEP_RUN_ATTEMPT"
[ "$LOCKSTEP_RUN_ATTEMPT" = 0 ] && [ "$OMPI_COMM_WORLD_RANK" = 1 ] && exit 3
exit 0
EOS
chmod +x flaky.sh
timeout 60 "$RUNNER" -n 2 --max-restarts 1 --log-dir logs "${mpiargs[@]}" -- ./flaky.sh >out.txt 2>err.txt
rc=$?
summary=$(sed -n '/^lockstep-run: summary: /,$p' err.txt)
if [ "$rc" -eq 0 ] && grep -q '^lockstep-run: summary: 2 attempt(s), exit status 0' <<<"$summary" &&
  grep -Eq '^  attempt 1: 2 ranks on this host, .*: failed: mpiexec exit status [1-9]' <<<"$summary" &&
  grep -Eq '^    first failure: rank 1 exited with status 3 on [^ ]+ at [0-9.]+s' <<<"$summary" &&
  grep -q '^  attempt 2: 2 ranks on this host, .*: succeeded' <<<"$summary"; then
  pass "summary: two attempts, the first failure and where"
else
  fail "summary: exit $rc; $summary"
fi
if grep -q 'rank 1 says hello in attempt 0' logs/attempt-0/1/rank.1/stdout 2>/dev/null &&
  grep -q 'rank 0 says hello in attempt 1' logs/attempt-1/1/rank.0/stdout 2>/dev/null &&
  cmp -s <(echo "$summary") logs/summary.txt; then
  pass "--log-dir: each rank's output per attempt, and the summary"
else
  fail "--log-dir: $(find logs -type f 2>/dev/null | head -8 | tr '\n' ' ')"
fi

# ---- 3. printed text is not a failure --------------------------------------------------------
cat >talker.sh <<'EOS'
#!/bin/sh
echo "mpiexec noticed that process rank 1 with PID 7 on node x exited on signal 9 (Killed)." >&2
echo "lockstep: stall: rank 1 gives up (this is only text)" >&2
sleep 3
echo "rank $OMPI_COMM_WORLD_RANK done"
EOS
chmod +x talker.sh
timeout 60 "$RUNNER" -n 2 --max-restarts 0 --per-host-timeout 1 "${mpiargs[@]}" -- ./talker.sh >out.txt 2>err.txt
rc=$?
[ "$rc" -eq 0 ] && [ "$(grep -c 'done$' out.txt)" -eq 2 ] && ! grep -q 'failure seen' err.txt &&
  pass "printed failure wording: not taken for a failure" || fail "printed text: exit $rc; $(grep lockstep-run err.txt | tail -3)"
finish
