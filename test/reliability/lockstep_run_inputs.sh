#!/usr/bin/env bash
# lockstep-run against inputs a user gives it as a matter of course (adversarial pass of
# issue 41), with real mpiexec and a trivial program (no training: seconds):
#  1. a --report-dir reused from an earlier run that left blame reports: the healthy job runs
#     to its end (it was read as this run's stall and killed 3 s in), the earlier reports kept
#     aside;
#  2. hostfile lines with slots= and max_slots= in either order give the slots= count (with
#     max_slots before slots= the host had 1 slot, silently: the job ran on fewer ranks than the
#     hostfile holds); a word that is neither is refused (exit 64);
#  3. inside a Slurm allocation without -H or --hostfile (issue 46): the hosts and rank count
#     come from SLURM_JOB_NODELIST and SLURM_NTASKS_PER_NODE (else SLURM_TASKS_PER_NODE), with a
#     stand-in scontrol and mpiexec (the real mpiexec would take the variables for an allocation);
#     -H given wins over them.
# Called as: lockstep_run_inputs.sh MPIEXEC ANY_BINARY WORKDIR (the binary is not used).
RUNNER=${TEST_LOCKSTEP_RUN:?the built lockstep-run (set by ctest)}
source "$(dirname "$0")/../examples/common.sh"
[ -x "$RUNNER" ] || { echo "no $RUNNER"; exit 1; }
mpiargs=(--mpiexec "$MPIEXEC" --mpiexec-arg --oversubscribe --mpiexec-arg --bind-to --mpiexec-arg none)
lr() { timeout 60 "$RUNNER" "$@" >out.txt 2>err.txt; }

cat >prog.sh <<'EOS'
#!/usr/bin/env bash
sleep "${PROG_SLEEP:-0}"
echo "rank $OMPI_COMM_WORLD_RANK of $OMPI_COMM_WORLD_SIZE done"
EOS
chmod +x prog.sh

# ---- 1. a report folder reused from an earlier run ------------------------------------------
mkdir -p rep/attempt-0 rep/attempt-1
printf 'rank 0\nhost elsewhere\nsilent 1\n' >rep/attempt-0/blame.0
printf 'rank 1\nhost elsewhere\nsilent 0\n' >rep/attempt-1/blame.1
PROG_SLEEP=6 lr -n 2 --max-restarts 1 --report-dir rep "${mpiargs[@]}" -- ./prog.sh
rc=$?
if [ "$rc" -eq 0 ] && [ "$(grep -c 'done$' out.txt)" -eq 2 ] && ! grep -q 'failure seen' err.txt; then
  pass "reused --report-dir: the healthy job ran to its end"
else
  fail "reused --report-dir: exit $rc, $(grep -c 'done$' out.txt) rank(s) done; $(grep -m1 'failure seen' err.txt)"
fi
kept=$(ls rep/earlier-*/attempt-0/blame.0 rep/earlier-*/attempt-1/blame.1 2>/dev/null | wc -l)
[ "$kept" -eq 2 ] && grep -q 'reports of an earlier run in rep were moved to rep/earlier-' err.txt &&
  pass "reused --report-dir: the earlier reports kept aside, and said" || fail "reused --report-dir: earlier reports: $kept kept"

# ---- 2. hostfile words in either order -------------------------------------------------------
for line in "localhost slots=2 max_slots=8" "localhost max_slots=8 slots=2" "localhost max-slots=8 slots=2"; do
  echo "$line" >hosts.txt
  lr --hostfile hosts.txt --max-restarts 0 "${mpiargs[@]}" -- ./prog.sh
  rc=$?
  n=$(grep -c 'of 2 done$' out.txt)
  [ "$rc" -eq 0 ] && [ "$n" -eq 2 ] && pass "hostfile '$line': 2 ranks" ||
    fail "hostfile '$line': exit $rc, $(head -n1 out.txt) ($(grep -m1 'attempt 1' err.txt))"
done
for line in "localhost slots=2 bogus" "localhost slots=2 slots=3" "localhost:2 slots=3"; do
  echo "$line" >hosts.txt
  lr --hostfile hosts.txt --max-restarts 0 "${mpiargs[@]}" -- ./prog.sh
  rc=$?
  [ "$rc" -eq 64 ] && grep -q "^lockstep-run: error: --hostfile hosts.txt: .*'$line'" err.txt &&
    pass "hostfile '$line' refused: $(grep -m1 'error:' err.txt)" || fail "hostfile '$line': exit $rc, $(head -c 300 err.txt)"
done
# ---- 3. hosts and rank count from Slurm ----------------------------------------------------
mkdir -p fakebin
printf '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\nprintf "%%s\\n" $FAKE_NODES\n' >fakebin/scontrol
printf '#!/bin/sh\necho "mpiexec $*"\n' >fakebin/mpiexec
chmod +x fakebin/scontrol fakebin/mpiexec
slurm_case() {  # slurm_case WHAT EXPECTED-ARGS ENV... -- lockstep-run args
  local what=$1 want=$2 envs=()
  shift 2
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  env PATH="$PWD/fakebin:$PATH" "${envs[@]}" timeout 30 "$RUNNER" --mpiexec "$PWD/fakebin/mpiexec" --max-restarts 0 "$@" -- ./prog.sh >out.txt 2>err.txt
  local rc=$? got
  got=$(grep -m1 '^mpiexec ' out.txt | sed 's/ -x .*//')
  [ "$rc" -eq 0 ] && [ "$got" = "mpiexec $want" ] && pass "Slurm: $what: $got" ||
    fail "Slurm: $what: exit $rc, '$got' (wanted 'mpiexec $want'); $(head -c 300 err.txt)"
}
slurm_case "--ntasks-per-node=2 on 2 nodes" "-H node1:2,node2:2 --map-by slot -n 4" \
  FAKE_NODES="node1 node2" SLURM_JOB_ID=7 SLURM_JOB_NODELIST='node[1-2]' SLURM_NTASKS_PER_NODE=2 SLURM_TASKS_PER_NODE='2(x2)' --
grep -q 'hosts from Slurm job 7 (SLURM_JOB_NODELIST=node\[1-2\]): node1:2,node2:2' err.txt &&
  pass "Slurm: the hosts said" || fail "Slurm: the hosts not said: $(head -c 300 err.txt)"
slurm_case "uneven SLURM_TASKS_PER_NODE" "-H a:2,b:2,c:1 --map-by slot -n 5" \
  FAKE_NODES="a b c" SLURM_JOB_NODELIST='a,b,c' SLURM_TASKS_PER_NODE='2(x2),1' --
slurm_case "-n 3 of 4 slots" "-H node1:2,node2:2 --map-by slot -n 3" \
  FAKE_NODES="node1 node2" SLURM_JOB_NODELIST='node[1-2]' SLURM_NTASKS_PER_NODE=2 -- -n 3
slurm_case "-H wins" "-H localhost:1 --map-by slot -n 1" \
  FAKE_NODES="node1 node2" SLURM_JOB_NODELIST='node[1-2]' SLURM_NTASKS_PER_NODE=2 -- -H localhost:1
finish
