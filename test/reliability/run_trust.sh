#!/usr/bin/env bash
# Runs one scenario of trust_program under mpiexec and checks what every rank printed and that
# the job ended within MAX seconds (an outer `timeout` kills it after MAX + 30 s, which fails).
#
# Usage: run_trust.sh PROGRAM SCENARIO NP MAX_SECONDS [--env VAR=VALUE...] [--rank-env R VAR=VALUE]
#                     -- PATTERN...
#   A pattern containing {rank} must appear for every rank 0..NP-1 (with the rank put in);
#   "r<K>:pattern" only for rank K; "!pattern" must not appear.
set -u
program=$1 scenario=$2 np=$3 max=$4
shift 4
envs=()
rank_env=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    --env) envs+=(-x "$2"); export "${2?}"; shift 2 ;;
    --rank-env) rank_env="$2 $3"; shift 3 ;;
    *) echo "run_trust.sh: unknown argument $1"; exit 2 ;;
  esac
done
[ "${1:-}" = "--" ] && shift
log=$(mktemp /tmp/lockstep-trust.XXXXXX)
trap 'rm -f "$log"' EXIT
mpiexec=${MPIEXEC:-mpiexec}
flags=(--oversubscribe --bind-to none)
start=$(date +%s%N)
if [ -n "$rank_env" ]; then
  # MPMD: rank R gets VAR=VALUE, the others do not.
  read -r rr rv <<< "$rank_env"
  cmd=()
  for ((i = 0; i < np; i++)); do
    [ $i -gt 0 ] && cmd+=(:)
    if [ "$i" = "$rr" ]; then cmd+=(-n 1 env "$rv" "$program" "$scenario"); else cmd+=(-n 1 "$program" "$scenario"); fi
  done
  timeout $((max + 30)) "$mpiexec" "${flags[@]}" "${cmd[@]}" >"$log" 2>&1
else
  timeout $((max + 30)) "$mpiexec" "${flags[@]}" -n "$np" "$program" "$scenario" >"$log" 2>&1
fi
rc=$?
end=$(date +%s%N)
secs=$(( (end - start) / 1000000000 ))
echo "scenario $scenario at np $np: mpiexec exit code $rc after $secs s (limit $max s)"
fail=0
if [ "$secs" -gt "$max" ]; then echo "FAIL: the job took $secs s, more than $max s"; fail=1; fi
for p in "$@"; do
  if [ "${p#!}" != "$p" ]; then
    if grep -qF -- "${p#!}" "$log"; then echo "FAIL: found '${p#!}'"; fail=1; fi
  elif [[ "$p" =~ ^r([0-9]+):(.*)$ ]]; then
    q=${BASH_REMATCH[2]//\{rank\}/${BASH_REMATCH[1]}}
    grep -qF -- "$q" "$log" || { echo "FAIL: missing '$q'"; fail=1; }
  elif [ "${p//\{rank\}/}" != "$p" ]; then
    for ((i = 0; i < np; i++)); do
      q=${p//\{rank\}/$i}
      grep -qF -- "$q" "$log" || { echo "FAIL: missing '$q'"; fail=1; }
    done
  else
    grep -qF -- "$p" "$log" || { echo "FAIL: missing '$p'"; fail=1; }
  fi
done
if [ $fail -ne 0 ]; then echo "---- output ----"; cat "$log"; exit 1; fi
echo "passed"
