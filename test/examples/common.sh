# Helpers shared by the example tests (sourced). Each test script is called as
#   script.sh MPIEXEC EXAMPLE_BINARY WORKDIR
# and runs the example under mpiexec as a user would, with --oversubscribe (CI has 2 cores).
set -uo pipefail
MPIEXEC=$1
EXE=$2
WORK=$3
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK" || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
failures=0

# run N args...: runs the example on N ranks (bounded by a timeout, so a hang fails instead of
# stalling CI); stdout to out.txt, stderr to err.txt; returns the exit status.
run() {
  local n=$1
  shift
  timeout 120 "$MPIEXEC" -n "$n" --oversubscribe --bind-to none "$EXE" "$@" >out.txt 2>err.txt
}

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
pass() { echo "ok: $*"; }

# expect_refused N PATTERN ARGS...: the example, run on N ranks with ARGS, exits non-zero (and
# not by the timeout), every rank reporting "error: ...PATTERN" on stderr.
expect_refused() {
  local n=$1 pattern=$2
  shift 2
  run "$n" "$@"
  local rc=$? count
  count=$(grep -c "error: .*$pattern" err.txt)
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$count" -eq "$n" ]; then
    pass "'$*' refused on all ranks: $(grep -m1 'error:' err.txt | sed 's/.*error: //')"
  else
    fail "'$*': exit $rc, $count of $n ranks reported '$pattern'"
  fi
}

# expect_failure N TEXT ARGS...: the example, run on N ranks with ARGS, exits non-zero, every
# rank reporting TEXT (a fixed string) on stderr.
expect_failure() {
  local n=$1 text=$2
  shift 2
  run "$n" "$@"
  local rc=$? count
  count=$(grep -cF -- "$text" err.txt)
  if [ "$rc" -ne 0 ] && [ "$count" -eq "$n" ]; then
    pass "'$*' refused on all $n ranks: $text"
  else
    fail "'$*': exit $rc, $count of $n ranks reported '$text'"
  fi
}

# expect_help N PROGRAM FLAG...: --help on N ranks exits 0, prints one "Usage: PROGRAM" (rank 0
# alone), lists every FLAG as written in the help (value name included), and nothing on stderr.
expect_help() {
  local n=$1 prog=$2 missing="" flag
  shift 2
  if ! run "$n" --help; then
    fail "--help exited with $?"
    return
  fi
  for flag in "$@"; do
    grep -qF -- "$flag" out.txt || missing="$missing '$flag'"
  done
  local usage
  usage=$(grep -c "^Usage: $prog" out.txt)
  if [ -z "$missing" ] && [ "$usage" -eq 1 ] && [ ! -s err.txt ]; then
    pass "--help exits 0 and lists all $# flags once"
  else
    fail "--help: missing$missing; $usage usage line(s); stderr: $(head -c 200 err.txt)"
  fi
}

# The value printed after "final loss" by rank 0.
final_loss() { awk '/^final loss/ {print $3}' "${1:-out.txt}"; }

# rel_close A B TOL: true if |A - B| <= TOL * |A|.
rel_close() {
  awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; m = a < 0 ? -a : a; exit !(a != "" && b != "" && d <= t * m) }'
}
# less A B: true if A < B numerically.
less() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a != "" && a + 0 < b + 0) }'; }

# The deterministic examples' checks (train --deterministic, torch_digits --deterministic). Every
# run of those examples ends with the line `model hash crc32c:XXXXXXXX`.
# last_hash: the last run's last line, which must be its model hash.
last_hash() {
  local last
  last=$(tail -n 1 out.txt)
  if [[ $last =~ ^model\ hash\ crc32c:[0-9a-f]{8}$ ]]; then echo "${last#model hash }"; else echo "BAD-LAST-LINE:$last"; fi
}
# expect_one_model N...: the deterministic runs' hashes at N ranks (the array `hash`, by N) are
# one model hash.
expect_one_model() {
  local first=${hash[$1]} n same=1 seen=""
  for n in "$@"; do
    [ "${hash[$n]}" = "$first" ] || same=0
    seen+=", -n $n ${hash[$n]}"
  done
  if [ $same -eq 1 ] && [[ $first == crc32c:* ]]; then
    pass "--deterministic: one model at -n $* ($first)"
  else
    fail "--deterministic: hashes differ: ${seen#, }"
  fi
}
# expect_plain_runs_differ ARGS...: without --deterministic the sums follow the rank count, so
# runs at -n 1 and -n 4 with ARGS end with two different hashes: the check above can fail.
expect_plain_runs_differ() {
  local plain1 plain4
  run 1 "$@" || fail "-n 1 ordinary run exited with $?"
  plain1=$(last_hash)
  run 4 "$@" || fail "-n 4 ordinary run exited with $?"
  plain4=$(last_hash)
  if [[ $plain1 == crc32c:* ]] && [[ $plain4 == crc32c:* ]] && [ "$plain1" != "$plain4" ]; then
    pass "without --deterministic -n 1 and -n 4 differ ($plain1, $plain4)"
  else
    fail "without --deterministic: -n 1 $plain1, -n 4 $plain4 (expected two different hashes)"
  fi
}
# expect_resumed_model FROM TO: the last run, resumed at TO ranks from a checkpoint written at
# FROM, ends with the uninterrupted model (hash[1]).
expect_resumed_model() {
  local resumed
  resumed=$(last_hash)
  if [ "$resumed" = "${hash[1]}" ]; then
    pass "stopped at -n $1, resumed at -n $2: the uninterrupted model ($resumed)"
  else
    fail "stopped at -n $1, resumed at -n $2: $resumed, uninterrupted ${hash[1]}"
  fi
}

finish() {
  if [ "$failures" -ne 0 ]; then
    echo "$failures check(s) failed; last stdout/stderr:"
    cat out.txt err.txt 2>/dev/null | tail -40
    exit 1
  fi
  echo "all checks passed"
  exit 0
}
