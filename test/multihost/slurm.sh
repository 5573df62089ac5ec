#!/usr/bin/env bash
# Slurm on one machine (issue 46): scripts/cluster.sh up --slurm 2 (munged, slurmctld, a slurmd
# per simulated host, partition batch), and the jobs an HPC user submits, as scripts/test.sh's
# multihost stage runs them:
#   srun      sbatch -N 2 --ntasks-per-node=2 of a script running `srun --mpi=pmix` of the train
#             example (and hello_world when built: ranks 0,1 and 2,3 on two hosts, local 0 and 1)
#   mpiexec   the same job with `mpiexec` (Open MPI starts its daemons through srun): the same
#             final loss as the srun job
#   lsrun     the same job with tools/lockstep-run given no hosts: 4 ranks on the allocation's
#             two nodes, from SLURM_JOB_NODELIST and SLURM_NTASKS_PER_NODE
#   lost      a lost node: sbatch --no-kill of lockstep-run (LOCKSTEP_TIMEOUT=3) training 100
#             epochs with checkpoints every 10; after the epoch-30 checkpoint every process of
#             node 1 (its slurmd, slurmstepd, orted and ranks) is SIGKILLed; the survivors'
#             failure is seen, node 1 dropped, the job restarts at 2 ranks on node 0 inside the
#             allocation and finishes 100 epochs; the job COMPLETED, node 1 DOWN (not responding).
# Usage: slurm.sh BUILD_DIR WORKDIR [case...]   (default: every case, in that order)
# WORKDIR and BUILD_DIR must be in the source tree (which every node sees, cluster.sh binds it)
# or outside /tmp (every node has a /tmp of its own).
# Exits 77 where the Slurm cluster cannot be made (cluster.sh exit 77: not root, no namespaces,
# Slurm or munge not installed). Prints "figures: ..." lines; times are indications (the machine
# is shared): nothing asserts a time except bounds far above it (a hang fails, it does not stall).
set -uo pipefail
BIN=$1 WORK=$2
shift 2
CASES=("$@")
[ ${#CASES[@]} -gt 0 ] || CASES=(srun mpiexec lsrun lost)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
[[ $BIN == /* ]] || BIN=$PWD/$BIN
[[ $WORK == /* ]] || WORK=$PWD/$WORK
# Every node sees the source tree (cluster.sh binds it back into a node's own /tmp when it lies
# there, as a build on a shared file system); anything else under /tmp it would not see.
for d in "$WORK" "$BIN"; do
  case $d in "$ROOT" | "$ROOT"/*) continue ;; esac
  case $d in /tmp | /tmp/*) echo "slurm.sh: $d must be in the source tree or outside /tmp (each node has a /tmp of its own)"; exit 2 ;; esac
done
CLUSTER=(bash "$ROOT/scripts/cluster.sh")
NAME=${LOCKSTEP_CLUSTER:-lockstep}
H0=$NAME-h0 H1=$NAME-h1
TRAIN=$BIN/examples/train/train HELLO=$BIN/examples/hello_world
[ -x "$TRAIN" ] || { echo "slurm.sh: $TRAIN is not built"; exit 1; }
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }
now() { echo "${EPOCHREALTIME/,/.}"; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
on() { "${CLUSTER[@]}" exec "$@"; }   # on HOST command...

trap '"${CLUSTER[@]}" down >/dev/null 2>&1' EXIT
trap 'exit 143' TERM INT HUP
"${CLUSTER[@]}" down >/dev/null 2>&1   # a fresh cluster: no job of an earlier run, job ids from 1
t=$(now)
"${CLUSTER[@]}" up --slurm 2 --slots 2 >up.log 2>&1
rc=$?
cat up.log
[ "$rc" -eq 77 ] && { echo "slurm.sh: skipped: $(tail -1 up.log)"; exit 77; }
[ "$rc" -eq 0 ] || { echo "slurm.sh: cluster.sh up --slurm 2 failed ($rc)"; exit 1; }
echo "figures: up --slurm 2 (namespaces, munged, slurmctld, 2 slurmd, both nodes idle) in $(secs "$t" "$(now)") s"
on "$H0" sinfo

# submit SCRIPT [sbatch args]: the job id.
submit() { on "$H0" sbatch --parsable "$@" | cut -d';' -f1; }
# state JOB: its JobState.
state() { on "$H0" scontrol show job "$1" -o 2>/dev/null | sed -n -E 's/.*JobState=([A-Z_]+).*/\1/p'; }
# wait_job JOB LIMIT: until the job has ended (or LIMIT s); its final state on stdout.
wait_job() {
  local s=""
  for _ in $(seq $(($2 * 4))); do
    s=$(state "$1")
    case $s in PENDING | RUNNING | CONFIGURING | COMPLETING | "") sleep 0.25 ;; *) echo "$s"; return ;; esac
  done
  echo "TIMEOUT_WAITING($s)"
  on "$H0" scancel "$1"
}

# The job scripts, as a user writes them.
cat >srun.sbatch <<EOF
#!/bin/bash
#SBATCH --job-name=train-srun
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:05:00
#SBATCH --output=%x-%j.out
echo "job \$SLURM_JOB_ID: nodes \$SLURM_JOB_NODELIST, \$SLURM_NTASKS_PER_NODE tasks per node"
[ ! -x $HELLO ] || srun --mpi=pmix $HELLO | sort
srun --mpi=pmix $TRAIN --epochs 20
EOF
sed -e 's/train-srun/train-mpiexec/' -e "s|^srun --mpi=pmix $TRAIN|mpiexec $TRAIN|" -e '/hello_world/d' srun.sbatch >mpiexec.sbatch
sed -e 's/train-srun/train-lsrun/' -e "s|^srun --mpi=pmix $TRAIN|$BIN/tools/lockstep-run --max-restarts 0 -- $TRAIN|" -e '/hello_world/d' \
  srun.sbatch >lsrun.sbatch

# check_job CASE: submits CASE.sbatch, waits, checks the training finished.
declare -A jobid=()
check_job() {
  local c=$1 t0 st out
  t0=$(now)
  jobid[$c]=$(submit "$c.sbatch")
  st=$(wait_job "${jobid[$c]}" 180)
  out=train-$c-${jobid[$c]}.out
  echo "---- $c: job ${jobid[$c]} $st in $(secs "$t0" "$(now)") s (submit to end); $out:"
  sed 's/^/    /' "$out" | grep -v '^    epoch' | tail -20
  [ "$st" = COMPLETED ] && pass "$c: job ${jobid[$c]} COMPLETED" || fail "$c: job ${jobid[$c]} $st"
  grep -q '^done: 20 epochs (20 this run) on 4 ranks' "$out" && pass "$c: 20 epochs on 4 ranks" ||
    fail "$c: no 'done: 20 epochs ... on 4 ranks' in $out"
  echo "figures: $c: $(grep -m1 '^done:' "$out")"
}

for c in "${CASES[@]}"; do
  case $c in
    srun)
      check_job srun
      out=train-srun-${jobid[srun]}.out
      if [ -x "$HELLO" ]; then
        [ "$(grep -c 'allreduce sum = 10 (expected 10)' "$out")" -eq 4 ] &&
          grep -q '^rank 2 of 4 (local 0 of 2)' "$out" && grep -q '^rank 1 of 4 (local 1 of 2)' "$out" &&
          pass "srun: hello_world: 4 ranks, 2 a host (local_rank from the host)" || fail "srun: hello_world's placement"
      fi
      ;;
    mpiexec)
      check_job mpiexec
      a=$(awk '/^final loss/ {print $3}' "train-mpiexec-${jobid[mpiexec]}.out")
      b=$(awk '/^final loss/ {print $3}' train-srun-*.out 2>/dev/null)
      [ -z "$b" ] || { [ "$a" = "$b" ] && pass "mpiexec: final loss $a, the srun job's" || fail "mpiexec: final loss $a, srun's $b"; }
      ;;
    lsrun)
      check_job lsrun
      out=train-lsrun-${jobid[lsrun]}.out
      grep -q "hosts from Slurm job ${jobid[lsrun]} (SLURM_JOB_NODELIST=$NAME-h\[0-1\]): $H0:2,$H1:2" "$out" &&
        grep -q "attempt 1 (restart 0 of at most 0): 4 ranks on $H0:2,$H1:2" "$out" &&
        pass "lsrun: lockstep-run took 4 ranks on $H0:2,$H1:2 from Slurm" || fail "lsrun: lockstep-run's hosts: $(grep -m2 'lockstep-run' "$out")"
      ;;
    lost)
      cat >lost.sbatch <<EOF
#!/bin/bash
#SBATCH --job-name=train-lost
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --no-kill
#SBATCH --time=00:05:00
#SBATCH --output=%x-%j.out
export LOCKSTEP_TIMEOUT=3
$BIN/tools/lockstep-run --max-restarts 2 --min-ranks 2 --per-host-timeout 20 -- \\
    $TRAIN --epochs 100 --batch 240 --checkpoint run/ck --checkpoint-every 10 --checkpoint-keep 3 --resume auto
EOF
      rm -rf run
      t0=$(now)
      jobid[lost]=$(submit lost.sbatch)
      out=train-lost-${jobid[lost]}.out
      # Node 1 lost once the epoch-30 checkpoint is committed: every process in its namespace.
      tf=""
      for _ in $(seq 2400); do
        e=$(sed -n -E 's/^ck-0*([0-9]+)\.safetensors$/\1/p' run/ck.latest 2>/dev/null)
        [ -n "$e" ] && [ "$e" -ge 30 ] && break
        case $(state "${jobid[lost]}") in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
        sleep 0.1
      done
      if [ -n "${e:-}" ] && [ "$e" -ge 30 ]; then
        pids=$(ip netns pids "$H1" | tr '\n' ' ')
        tf=$(now)
        # shellcheck disable=SC2086
        kill -KILL $pids
        echo "killed node $H1 after the epoch-$e checkpoint: $(echo $pids | wc -w) processes (slurmd, slurmstepd, orted, ranks)"
      else
        fail "lost: no epoch-30 checkpoint seen"
      fi
      # From the kill on: when lockstep-run (in the job's output) saw the failure and started
      # attempt 2, and when slurmctld marked the node down (SlurmdTimeout=10), up to 40 s.
      td="" t_seen="" t_next="" t_ok="" t_done=""
      for _ in $(seq 200); do
        [ -z "$tf" ] && break
        [ -n "$t_seen" ] || ! grep -q 'failure seen' "$out" 2>/dev/null || t_seen=$(now)
        [ -n "$t_next" ] || ! grep -q 'attempt 2 (' "$out" 2>/dev/null || t_next=$(now)
        [ -n "$t_ok" ] || ! grep -q 'attempt 2 succeeded' "$out" 2>/dev/null || t_ok=$(now)
        if [ -z "$td" ] && [[ $(on "$H0" sinfo -h -n "$H1" -o %T 2>/dev/null) == down* ]]; then td=$(now); fi
        if [ -z "$t_done" ]; then
          case $(state "${jobid[lost]}") in RUNNING | COMPLETING) ;; *) t_done=$(now) ;; esac
        fi
        [ -n "$td" ] && [ -n "$t_done" ] && break
        sleep 0.2
      done
      st=$(wait_job "${jobid[lost]}" 240)
      t_end=$(now)
      echo "---- lost: job ${jobid[lost]} $st in $(secs "$t0" "$t_end") s; $out (epochs left out):"
      grep -v '^epoch' "$out" | sed 's/^/    /' | tail -40
      echo "---- scontrol show job ${jobid[lost]}:"
      on "$H0" scontrol show job "${jobid[lost]}" | grep -E 'JobState|NodeList|BatchHost|Requeue|Restarts|RunTime' | sed 's/^ */    /'
      echo "---- sinfo:"
      on "$H0" sinfo -N -o '%N %T %E' | sed 's/^/    /'
      [ "$st" = COMPLETED ] && pass "lost: job ${jobid[lost]} COMPLETED" || fail "lost: job ${jobid[lost]} $st"
      grep -q "dropping host $H1" "$out" && pass "lost: $H1 dropped" || fail "lost: $H1 not dropped"
      grep -q "attempt 2 (restart 1 of at most 2): 2 ranks on $H0:2" "$out" && pass "lost: restarted at 2 ranks on $H0" ||
        fail "lost: no restart at 2 ranks on $H0: $(grep 'attempt 2' "$out")"
      grep -q '^done: 100 epochs' "$out" && pass "lost: all 100 epochs" || fail "lost: the run did not finish 100 epochs"
      loss=$(awk '/^final loss/ {print $3}' "$out")
      awk -v l="$loss" 'BEGIN { exit !(l != "" && l + 0 < 1e-3) }' && pass "lost: final loss $loss < 1e-3" || fail "lost: final loss '$loss'"
      on "$H0" sinfo -h -n "$H1" -o %T | grep -q '^down' && pass "lost: Slurm has $H1 down" || fail "lost: $H1 is $(on "$H0" sinfo -h -n "$H1" -o %T)"
      if [ -n "$tf" ]; then
        reached=$(awk '/^resumed from/ {exit} /^epoch/ {e = $2} END {print e + 0}' "$out")
        resumed=$(sed -n -E 's/^resumed from run\/ck-0*([0-9]+)\.safetensors after epoch ([0-9]+).*/\2/p' "$out")
        since() { [ -n "$1" ] && secs "$tf" "$1" || echo '?'; }
        echo "figures: lost: node $H1 killed after epoch $reached; from the kill: lockstep-run saw the failure" \
          "after $(since "$t_seen") s, started attempt 2 (2 ranks on $H0) after $(since "$t_next") s and" \
          "finished after $(since "$t_ok") s (redid $((reached - ${resumed:-0})) epoch(s)); slurmctld marked $H1 down after" \
          "$(since "$td") s (SlurmdTimeout=10), and the job, COMPLETING until then, ended after $(since "$t_done") s;" \
          "final loss $loss"
      fi
      ;;
    *) echo "slurm.sh: unknown case '$c'"; exit 2 ;;
  esac
done
[ "$failures" -eq 0 ] || { echo "slurm.sh: $failures failure(s); work in $WORK"; exit 1; }
echo "slurm.sh: passed"
