#!/usr/bin/env bash
# A lost rank costs one step (issue 43): examples/train --deterministic --rescue at -n 4, rank R
# SIGKILLed mid-epoch (LOCKSTEP_FAULT kind=kill; mpiexec --enable-recovery keeps the survivors,
# LOCKSTEP_TIMEOUT=2 makes their step fail): each survivor writes the state of the last
# completed step to its rescue directory and says where; resumed at -n 3 with --resume auto,
# the run goes on from that step (not from the last checkpoint) and ends with the model hash
# of the uninterrupted -n 4 run, its loss curve the uninterrupted one. Then the same with the
# ranks given different rescue directories and rank 0 killed inside the step's reduction (the
# failed step must not be half-applied): the only copy left is on rank 2
# of the resumed run, which reads it and gives it to the others. And a sharded optimizer state
# (ZeRO-1), which no rank holds whole: no rescue state, said on every survivor.
# Called as: rescue_resume.sh MPIEXEC TRAIN_BINARY WORKDIR
source "$(dirname "$0")/../examples/common.sh"
common=(--samples 980 --batch 240 --epochs 4 --deterministic --micro-batch 10)
export LOCKSTEP_TIMEOUT=2

last_hash() { awk '/^model hash/ {print $3}' out.txt; }
# faulty N RANK AFTER ARGS...: the run with rank RANK killed at its collective AFTER; survivors kept.
faulty() {
  local n=$1 r=$2 after=$3
  shift 3
  LOCKSTEP_FAULT="rank=$r,kind=kill,after=$after" timeout 120 "$MPIEXEC" -n "$n" --oversubscribe --bind-to none \
    --enable-recovery "$EXE" "$@" >out.txt 2>err.txt
}
# same_curve A B: the loss CSVs A and B have the same epochs, each loss within 1e-9 (relative).
same_curve() {
  [ "$(wc -l <"$1")" = "$(wc -l <"$2")" ] &&
    paste -d, "$1" "$2" | awk -F, 'NR > 1 { d = $2 - $4; if (d < 0) d = -d; if (d > 1e-9 * $2) bad = 1 } END { exit bad }'
}

run 4 "${common[@]}" --log full.csv || fail "uninterrupted -n 4 run exited with $?"
full=$(last_hash)
[[ $full == crc32c:* ]] || fail "the uninterrupted run printed no model hash"

# (1) Rank 2 killed; one rescue directory (run/ck.rescue, the default) for every rank.
faulty 4 2 40 "${common[@]}" --checkpoint run/ck --rescue
# (mpiexec --enable-recovery exits 0 whatever its ranks did: the survivors' errors are the sign.)
[ "$(grep -o 'error: lockstep: stall' err.txt | wc -l)" -eq 3 ] || fail "(1) not every survivor's step failed"
grep -q "injecting fault kind=kill on rank 2" err.txt || fail "(1) the fault was not injected"
# Found anywhere in a line: mpiexec can put another rank's unfinished line in front of one.
written=$(grep -o 'lockstep: rescue state of step [0-9]* written to run/ck.rescue/' err.txt | wc -l)
steps=$(grep -o 'lockstep: rescue state of step [0-9]* written' err.txt | awk '{print $6}' | sort -u | tr '\n' ' ')
if [ "$written" -eq 3 ]; then pass "(1) the 3 survivors wrote rescue states (steps: $steps)"; else fail "(1) $written rescue states written"; cat err.txt; fi
[ ! -e run/ck.safetensors ] || fail "(1) a regular checkpoint exists: the resume would not show the rescue"
run 3 "${common[@]}" --checkpoint run/ck --rescue --resume auto --log part.csv || fail "(1) -n 3 resume exited with $?"
grep -h '^resum' out.txt
step=$(sed -n -E 's/^resuming from the rescue state .* of rank [0-9]+ \(step ([0-9]+),.*/\1/p' out.txt)
if [ -n "$step" ] && [ "$step" -gt 0 ] && [[ " $steps" == *" $step "* ]]; then
  pass "(1) resumed at -n 3 from the rescue state of step $step (newest written: $(echo $steps | awk '{print $NF}'))"
else
  fail "(1) did not resume from a rescue state written by the survivors (step '$step', written: $steps)"
fi
[ "$(echo "$steps" | awk '{print $NF}')" = "$step" ] || fail "(1) resumed from step $step, not the newest ($steps)"
grep -q '^done: 4 epochs .* on 3 ranks' out.txt || fail "(1) the resumed run did not finish 4 epochs"
if [ "$(last_hash)" = "$full" ]; then pass "(1) the model hash of the uninterrupted -n 4 run ($full)"; else fail "(1) model hash $(last_hash), uninterrupted $full"; fi
if same_curve full.csv part.csv; then pass "(1) the loss curve goes on: every epoch within 1e-9 of the uninterrupted run"; else fail "(1) loss curves differ"; paste -d, full.csv part.csv; fi
[ -z "$(ls run/ck.rescue 2>/dev/null)" ] || fail "(1) rescue states left after the final checkpoint: $(ls run/ck.rescue)"

# (2) Every rank its own rescue directory (LOCKSTEP_RESCUE_DIR), rank 0 killed. Of the copies
# (rd.1, rd.2, rd.3) only rd.2's is kept: at -n 3 it is rank 2's alone, and rank 0 never sees it.
cat >wrap.sh <<WRAP
#!/usr/bin/env bash
LOCKSTEP_RESCUE_DIR=$PWD/rd.\$OMPI_COMM_WORLD_RANK exec "$EXE" "\$@"
WRAP
chmod +x wrap.sh
EXE_SAVED=$EXE
EXE=./wrap.sh
# The kill lands inside apply_accumulated (the exact sum's collectives): a step whose reduction
# failed must leave the state of the step before. The first such collective after #40 is taken.
inside=""
for after in 41 42 43 44; do
  rm -rf two rd.*
  faulty 4 0 "$after" "${common[@]}" --checkpoint two/ck --checkpoint-every 1 --checkpoint-keep 2 --rescue
  inside=$(grep -m1 -o 'stall: [a-z_]* #[0-9]* ([^)]*) at [a-z_.]*:[0-9]* (inside the call at train.cpp:[0-9]*)' err.txt)
  [ -n "$inside" ] && break
done
[ -n "$inside" ] && pass "(2) rank 0 killed inside the step's reduction: $inside" ||
  fail "(2) no kill at collectives #41 to #44 came inside the optimizer's reduction"
[ "$(grep -c 'error: lockstep: stall' err.txt)" -eq 3 ] || fail "(2) not every survivor's step failed"
n2=$(grep -c 'lockstep: rescue state of step [0-9]* written to .*/rd\.[123]/' err.txt)
[ "$n2" -eq 3 ] || fail "(2) $n2 rescue states written (3 expected, in rd.1, rd.2, rd.3)"
rm -rf rd.1 rd.3
[ -e two/ck.latest ] || fail "(2) no regular checkpoint was committed before the kill"
run 3 "${common[@]}" --checkpoint two/ck --checkpoint-every 1 --checkpoint-keep 2 --rescue --resume auto ||
  fail "(2) -n 3 resume exited with $?"
grep -h '^resum' out.txt
if grep -q "^resuming from the rescue state $PWD/rd.2/rescue-.* of rank 2 " out.txt; then
  pass "(2) rank 2 read its own rescue state, newer than the checkpoint two/ck.latest names, and gave it to ranks 0 and 1"
else
  fail "(2) not resumed from rank 2's rescue state"
fi
if [ "$(last_hash)" = "$full" ]; then pass "(2) the model hash of the uninterrupted run"; else fail "(2) model hash $(last_hash), uninterrupted $full"; fi
EXE=$EXE_SAVED

# (3) ZeRO-1: no rank holds the whole optimizer state, so none writes one; each says so.
faulty 3 1 30 --samples 960 --batch 240 --epochs 3 --shard-optimizer-state --checkpoint z/ck --rescue
n3=$(grep -c 'wrote no rescue state: the optimizer state is sharded (ZeRO-1).*newest full checkpoint' err.txt)
[ "$n3" -eq 2 ] && pass "(3) sharded state: both survivors say no rescue state, resume from the newest checkpoint" ||
  fail "(3) sharded: $n3 survivors said so"
# (4) Sharded with --rescue-buddy, two simulated hosts of 2 ranks: rank 3 killed in step 4, the 3
# survivors write shard files; host 1's (rank 2's) removed, host 0's hold all 4 shards: resumed at
# -n 2 from the step of the fault, assembled, with no checkpoint on disk.
sharded=(--samples 960 --batch 240 --epochs 3 --shard-optimizer-state --rescue-buddy --checkpoint y/ck --rescue)
LOCKSTEP_TEST_HOST_SIZE=2 faulty 4 3 30 "${sharded[@]}"
n4=$(grep -c 'lockstep: rescue state of step 3 written to y/ck.rescue/shard-000000003-r[012].safetensors' err.txt)
[ "$n4" -eq 3 ] && pass "(4) --rescue-buddy: the 3 survivors wrote shard rescue files of step 3" ||
  { fail "(4) $n4 shard rescue files of step 3"; cat err.txt; }
rm -f y/ck.rescue/shard-*-r2.safetensors
LOCKSTEP_TEST_HOST_SIZE=2 run 2 "${sharded[@]}" --resume auto || fail "(4) -n 2 resume exited with $?"
grep -q 'lockstep: the 4 shards of step 3 assembled' err.txt &&
  grep -q '^resuming from the rescue state y/ck.rescue/rescue-000000003-r0.safetensors of rank 0 (step 3,' out.txt &&
  grep -q '^done: 3 epochs .* on 2 ranks' out.txt && pass "(4) resumed at -n 2 from host 0's shards, step 3, and finished" ||
  { fail "(4) not resumed from the assembled shards"; cat out.txt err.txt; }
# Flags: --rescue needs --checkpoint (refused on every rank); nothing anywhere is a fresh start.
expect_refused 2 "rescue.*needs --checkpoint" --samples 96 --batch 48 --epochs 1 --rescue
run 2 --samples 96 --batch 48 --epochs 1 --checkpoint fresh.st --rescue-dir fresh.rd --resume auto ||
  fail "a fresh --rescue --resume auto run exited with $?"
grep -q '^no checkpoint at fresh.st and no rescue state: starting afresh' out.txt &&
  pass "--rescue --resume auto with nothing anywhere starts afresh" || fail "no fresh start"
finish
