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

# Rank 3 killed inside step 5's all-gather of the updated parameters (collective #45: the live
# parameters are then half updated, so what the survivors write must come from the copy of
# step 4), and inside step 5's buddy exchange (#47, after the update: again step 4's copy).
for case in "45 shard_gather.cpp" "47 buddy_copy.cpp"; do
  read -r after where <<<"$case"
  rm -rf rd.*
  LOCKSTEP_FAULT="rank=3,kind=kill,after=$after" timeout 120 "$MPIEXEC" -n 4 --oversubscribe --bind-to none \
    --enable-recovery "$EXE" "$STEPS" >out.txt 2>err.txt
  grep -q "injecting fault kind=kill on rank 3" err.txt || fail "($after) the fault was not injected"
  grep -q "rank 0: step 5 failed: lockstep: stall: [a-z_]* #$after .* at $where" err.txt &&
    pass "($after) rank 3 killed in step 5, in $where" || { fail "($after) not killed in $where"; grep -m1 failed err.txt; }
  written=$(grep -c 'lockstep: rescue state of step 4 written to .*/rd.host[01]/shard-' err.txt)
  if [ "$written" -eq 3 ]; then pass "($after) the 3 survivors wrote shard rescue files of step 4"; else
    fail "($after) $written shard rescue files of step 4 written"; cat err.txt; fi
  rm -rf rd.host1  # host 1 is lost, its disk too
  run 2 "$STEPS" resume || { fail "($after) -n 2 resume exited with $?"; cat out.txt err.txt; }
  grep -q "lockstep: the 4 shards of step 4 assembled from the shard rescue files" err.txt &&
    pass "($after) host 0's files hold all 4 shards: assembled" || fail "($after) the shards were not assembled"
  grep -q '^resumed from .*/rd.host0/rescue-000000004-r0.safetensors of rank 0 (step 4, .*rescue 1)$' out.txt &&
    pass "($after) resumed at -n 2 from the assembled rescue state of step 4" || fail "($after) not resumed from it"
  grep -q "^done: $STEPS steps on 2 ranks" out.txt || fail "($after) the resumed run did not finish"
  if [ -n "$full" ] && [ "$(last_hash)" = "$full" ]; then pass "($after) the model hash of the uninterrupted -n 4 run ($full)"
  else fail "($after) model hash $(last_hash), uninterrupted $full"; fi
done

# Without rescue_buddy: no rescue state of a sharded state, and the line says why.
rm -rf rd.*
LOCKSTEP_FAULT="rank=3,kind=kill,after=47" timeout 120 "$MPIEXEC" -n 4 --oversubscribe --bind-to none \
  --enable-recovery "$EXE" "$STEPS" plain >out.txt 2>err.txt
n3=$(grep -c 'wrote no rescue state: the optimizer state is sharded (ZeRO-1).*rescue_buddy' err.txt)
[ "$n3" -eq 3 ] && pass "without rescue_buddy the 3 survivors say no rescue state" || fail "plain: $n3 survivors said so"
[ -z "$(ls rd.* 2>/dev/null)" ] || fail "plain: files written: $(ls rd.*)"

# Three ranks, hosts of 2 and 1: a copy would stay on its own host; refused on every rank.
EXE=$EXE_SAVED
expect_refused 3 "rescue_buddy keeps each shard's copy on another host, but one host runs 2 of the 3 ranks" "$STEPS"
exit $((failures > 0))
