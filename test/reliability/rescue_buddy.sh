# rescue_buddy (DistributedOptions): a sharded (ZeRO-1) run at -n 4 on two simulated hosts
# (LOCKSTEP_TEST_HOST_SIZE=2, each host its own rescue directory) loses rank 3; the survivors
# write shard rescue files (their shard and their buddy's copy); host 1's directory is then
# removed (the host lost with its disk), and a run at -n 2 resumes from host 0's files alone,
# with no checkpoint anywhere, and ends with the model hash of the uninterrupted -n 4 run.
# Without rescue_buddy the survivors write nothing and say so; a placement where a buddy on
# another host is impossible is refused on every rank.
source "$(dirname "$0")/../examples/common.sh"
export LOCKSTEP_TIMEOUT=2 LOCKSTEP_TEST_HOST_SIZE=2
STEPS=12

cat >wrap.sh <<WRAP
#!/bin/bash
LOCKSTEP_RESCUE_DIR=$PWD/rd.host\$((OMPI_COMM_WORLD_RANK / 2)) exec "$EXE" "\$@"
WRAP
chmod +x wrap.sh
EXE_SAVED=$EXE
EXE=./wrap.sh
last_hash() { sed -n -E 's/^done: .* model hash (crc32c:[0-9a-f]+)$/\1/p' out.txt; }

run 4 "$STEPS" || fail "uninterrupted -n 4 run exited with $?"
full=$(last_hash)
[[ $full == crc32c:* ]] || { fail "the uninterrupted run printed no model hash"; cat out.txt err.txt; }
rm -rf rd.*

# Collectives per step here: 4 buckets reduce-scattered and all-gathered, one buddy exchange;
# the kill at #50 lands in step 6.
LOCKSTEP_FAULT="rank=3,kind=kill,after=50" timeout 120 "$MPIEXEC" -n 4 --oversubscribe --bind-to none \
  --enable-recovery "$EXE" "$STEPS" >out.txt 2>err.txt
grep -q "injecting fault kind=kill on rank 3" err.txt || fail "the fault was not injected"
written=$(grep -c 'lockstep: rescue state of step [0-9]* written to .*/rd.host[01]/shard-' err.txt)
steps=$(sed -n -E 's/^lockstep: rescue state of step ([0-9]+) written.*/\1/p' err.txt | sort -u | tr '\n' ' ')
if [ "$written" -eq 3 ]; then pass "the 3 survivors wrote shard rescue files (steps: $steps)"; else
  fail "$written shard rescue files written"; cat err.txt; fi
ls rd.host0 rd.host1 2>&1 | tr '\n' ' '; echo
rm -rf rd.host1  # host 1 is lost, its disk too
run 2 "$STEPS" resume || { fail "-n 2 resume exited with $?"; cat out.txt err.txt; }
grep -h '^resumed\|assembled' out.txt err.txt
grep -q "lockstep: the 4 shards of step [0-9]* assembled from the shard rescue files" err.txt &&
  pass "host 0's files hold all 4 shards: assembled" || fail "the shards were not assembled"
step=$(sed -n -E 's/^resumed from .* \(step ([0-9]+), .*rescue 1\)$/\1/p' out.txt)
if [ -n "$step" ] && [ "$step" -gt 0 ]; then pass "resumed at -n 2 from the rescue state of step $step"; else
  fail "did not resume from a rescue state"; fi
grep -q "^done: $STEPS steps on 2 ranks" out.txt || fail "the resumed run did not finish"
if [ -n "$full" ] && [ "$(last_hash)" = "$full" ]; then pass "the model hash of the uninterrupted -n 4 run ($full)"; else
  fail "model hash $(last_hash), uninterrupted $full"; fi

# Without rescue_buddy: no rescue state of a sharded state, and the line says why.
rm -rf rd.*
LOCKSTEP_FAULT="rank=3,kind=kill,after=50" timeout 120 "$MPIEXEC" -n 4 --oversubscribe --bind-to none \
  --enable-recovery "$EXE" "$STEPS" plain >out.txt 2>err.txt
n3=$(grep -c 'wrote no rescue state: the optimizer state is sharded (ZeRO-1).*rescue_buddy' err.txt)
[ "$n3" -eq 3 ] && pass "without rescue_buddy the 3 survivors say no rescue state" || fail "plain: $n3 survivors said so"
[ -z "$(ls rd.* 2>/dev/null)" ] || fail "plain: files written: $(ls rd.*)"

# Three ranks, hosts of 2 and 1: a copy would stay on its own host; refused on every rank.
EXE=$EXE_SAVED
expect_refused 3 "rescue_buddy keeps each shard's copy on another host, but one host runs 2 of the 3 ranks" "$STEPS"
exit $((failures > 0))
