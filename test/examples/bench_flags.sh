#!/usr/bin/env bash
# The benchmarks' command lines (CLI11, bench_common.hpp), as a user meets them under mpiexec:
# --help lists the flags and exits 0; a bad or unknown flag is named on every rank, which all
# exit non-zero without a hang; a positional argument is checked too; and --json writes a file
# that a JSON reader accepts, with the fields bench/summarize.py reads.
#   bench_flags.sh MPIEXEC BENCH_COLLECTIVES WORKDIR BENCH_OVERHEAD
source "$(dirname "$0")/common.sh"
overhead=$4
n=2
expect_help "$n" bench_collectives '--json PATH' '--reps N' '--quick' '--shapes-dir DIR' '--max-bytes BYTES' \
  '--target-ms MS' '--dat PATH' '--help'
expect_refused "$n" 'not expected: .*--bogus' --bogus 1
expect_refused "$n" '--max-bytes: expects a number' --max-bytes lots
expect_refused "$n" '--reps: must be >= 1' --reps 0
expect_refused "$n" '--json: .*missing' --json

# A positional argument: bench_overhead [calls].
timeout 120 "$MPIEXEC" -n "$n" --oversubscribe --bind-to none "$overhead" many >out.txt 2>err.txt
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$(grep -c 'error: calls: expects a number' err.txt)" -eq "$n" ]; then
  pass "bench_overhead refuses a calls count that is not a number"
else
  fail "bench_overhead many: exit $rc"
fi
timeout 120 "$MPIEXEC" -n "$n" --oversubscribe --bind-to none "$overhead" 10 >out.txt 2>err.txt &&
  grep -q '10 calls each, result correct' out.txt && pass "bench_overhead 10 runs 10 calls" || fail "bench_overhead 10"

# --json: a file JSON readers accept, with the fields summarize.py uses.
if run "$n" --max-bytes 1024 --reps 1 --target-ms 1 --json out.json; then
  if ! command -v python3 >/dev/null; then
    pass "(python3 missing: the JSON file is not read back)"
  elif python3 - out.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["bench"] == "collectives" and d["ranks"] == 2 and d["all_correct"] is True, d
ar = [r for r in d["rows"] if r["op"] == "allreduce"]
assert ar and all(isinstance(r["ratio_median"], float) and isinstance(r["bytes"], int) for r in ar), ar
PY
  then
    pass "--json writes a file python's json reads, with the expected fields"
  else
    fail "--json: the file does not read back: $(head -c 300 out.json)"
  fi
else
  fail "--json run exited with $?"
fi
finish
