#!/usr/bin/env bash
# Runs fault_program under mpiexec with the LOCKSTEP_* variables of the environment, then checks
# what every rank reported: each rank's file must contain every expected pattern (fixed strings).
#
# Usage: run_fault.sh [--abort] [--max-ms-after-fault MS] NPROCS PROGRAM [--steps N]
#                    [--mode blocking|nonblocking] -- PATTERN...
#   Patterns may contain {rank}, replaced by the rank being checked. A pattern starting with
#   "r<K>:" applies to rank K only; one starting with "!" must NOT appear.
#   --abort: the job is expected to end abnormally (MPI_Abort, a killed rank); the patterns are
#   then checked against the combined output of mpiexec instead of per-rank files.
#   --ended-rank K: rank K was stalled and is ended with the job (the others skip MPI_Finalize
#   after the stall, so mpiexec ends it before it reports); it must write no report.
#   --max-ms-after-fault MS: the job must end within MS milliseconds of the injected fault (the
#   time the faulty rank printed just before it), e.g. a killed rank must not leave the others
#   spinning.
#   --log-has PATTERN: mpiexec's combined output must contain PATTERN (a fixed string).
#   --report-dir-missing: LOCKSTEP_REPORT_DIR is set to a folder that does not exist yet (two
#   levels down), which must hold a blame report afterwards.
set -u
abort=0
max_ms=""
ended_rank=""
log_has=()
report_dir_missing=0
while [ "${1#--}" != "$1" ]; do
  case $1 in
    --abort) abort=1; shift ;;
    --ended-rank) ended_rank=$2; shift 2 ;;
    --max-ms-after-fault) max_ms=$2; shift 2 ;;
    --log-has) log_has+=("$2"); shift 2 ;;
    --report-dir-missing) report_dir_missing=1; shift ;;
    *) break ;;
  esac
done
nprocs=$1 program=$2
shift 2
steps=8
mode=blocking
if [ "${1:-}" = "--steps" ]; then steps=$2; shift 2; fi
if [ "${1:-}" = "--mode" ]; then mode=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift

outdir=$(mktemp -d /tmp/lockstep-fault.XXXXXX)
trap 'rm -rf "$outdir"' EXIT
mpiexec_cmd=${MPIEXEC:-mpiexec}
start=$(date +%s%N)
# A rank that fails waits for the others' reports before it exits (see fault_program.cpp).
export FAULT_PROGRAM_AWAIT_REPORTS=1 FAULT_PROGRAM_ENDED_RANK=$ended_rank
if [ "$report_dir_missing" = 1 ]; then export LOCKSTEP_REPORT_DIR=$outdir/not/yet; fi
"$mpiexec_cmd" -n "$nprocs" --oversubscribe --bind-to none "$program" "$outdir" "$steps" "$mode" >"$outdir/mpiexec.log" 2>&1
rc=$?
end=$(date +%s%N)
echo "mpiexec exit code $rc after $(( (end - start) / 1000000 )) ms; LOCKSTEP_FAULT=${LOCKSTEP_FAULT:-} LOCKSTEP_CHECK=${LOCKSTEP_CHECK:-} LOCKSTEP_TIMEOUT=${LOCKSTEP_TIMEOUT:-}"

fail=0
for pat in "${log_has[@]}"; do
  grep -qF -- "$pat" "$outdir/mpiexec.log" || { echo "FAIL: mpiexec's output lacks '$pat'"; fail=1; }
done
if [ "$report_dir_missing" = 1 ]; then
  if ls "$outdir"/not/yet/blame.* >/dev/null 2>&1; then
    echo "blame report written in the folder made for it: $(ls "$outdir"/not/yet)"
  else
    echo "FAIL: no blame report in $outdir/not/yet (LOCKSTEP_REPORT_DIR, missing before the run)"; fail=1
  fi
fi
if [ -n "$max_ms" ]; then
  fault_ms=$(grep -o "at unix time ms [0-9]*" "$outdir/mpiexec.log" | head -1 | awk '{print $5}')
  end_ms=$((end / 1000000))
  if [ -z "$fault_ms" ]; then
    echo "FAIL: no injected fault was reported"; fail=1
  else
    echo "the job ended $((end_ms - fault_ms)) ms after the fault (limit $max_ms ms)"
    if [ $((end_ms - fault_ms)) -gt "$max_ms" ]; then echo "FAIL: the job outlived the fault by more than $max_ms ms"; fail=1; fi
  fi
fi
check_text() {  # label file pattern...
  local label=$1 file=$2
  shift 2
  for pat in "$@"; do
    local want=1
    if [ "${pat#!}" != "$pat" ]; then want=0; pat=${pat#!}; fi
    if grep -qF -- "$pat" "$file"; then found=1; else found=0; fi
    if [ "$found" != "$want" ]; then
      if [ "$want" = 1 ]; then echo "FAIL: $label: missing \"$pat\""; else echo "FAIL: $label: unexpected \"$pat\""; fi
      fail=1
    fi
  done
}

if [ "$abort" = 1 ]; then
  if [ "$rc" = 0 ]; then echo "FAIL: expected the job to abort, but mpiexec exited 0"; fail=1; fi
  check_text "mpiexec output" "$outdir/mpiexec.log" "$@"
else
  for ((r = 0; r < nprocs; ++r)); do
    f="$outdir/rank$r.txt"
    if [ "$r" = "$ended_rank" ]; then
      if [ -f "$f" ]; then echo "FAIL: rank $r reported, but the job should have ended while it was stalled"; fail=1; fi
      continue
    fi
    if [ ! -f "$f" ]; then echo "FAIL: rank $r wrote no report"; fail=1; continue; fi
    pats=()
    for pat in "$@"; do
      if [[ "$pat" =~ ^r([0-9]+):(.*)$ ]]; then
        [ "${BASH_REMATCH[1]}" = "$r" ] || continue
        pat=${BASH_REMATCH[2]}
      fi
      pats+=("${pat//\{rank\}/$r}")
    done
    check_text "rank $r" "$f" "${pats[@]}"
  done
fi
if [ "$fail" != 0 ]; then
  echo "---- mpiexec output ----"
  cat "$outdir/mpiexec.log"
  for f in "$outdir"/rank*.txt; do [ -f "$f" ] && { echo "---- $f ----"; cat "$f"; }; done
  exit 1
fi
echo "every rank reported what was expected"
for f in "$outdir"/rank*.txt; do [ -f "$f" ] && { echo "---- $(basename "$f") ----"; cat "$f"; }; done
exit 0
