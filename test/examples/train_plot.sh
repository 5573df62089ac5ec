#!/usr/bin/env bash
# The loss plot of `train --log CSV` (what scripts/run-main.sh ends with): with gnuplot on PATH
# the run writes CSV.png, a real PNG (over an earlier run's file), and prints its absolute path;
# a gnuplot that fails is reported as such. Without gnuplot the run
# must say how to install it, and the test reports itself skipped, or fails where
# LOCKSTEP_REQUIRE_GNUPLOT=1 (CI installs gnuplot-nox, see scripts/test.sh).
source "$(dirname "$0")/common.sh"
flags=(--epochs 5 --samples 512 --batch 128 --log loss.csv)
if ! command -v gnuplot >/dev/null; then
  run 2 "${flags[@]}" || fail "exited with $?"
  grep -q '^loss plot: skipped: gnuplot is not installed (Debian: apt-get install gnuplot-nox)$' out.txt &&
    pass "without gnuplot the run says how to install it" || fail "no install hint: $(grep '^loss plot' out.txt)"
  if [ "${LOCKSTEP_REQUIRE_GNUPLOT:-0}" = 1 ]; then
    fail "gnuplot is not installed, and LOCKSTEP_REQUIRE_GNUPLOT=1"
    finish
  fi
  [ "$failures" -eq 0 ] || finish
  echo "skipped: gnuplot is not installed (apt-get install gnuplot-nox)"
  exit 77
fi

echo stale >loss.csv.png
run 2 "${flags[@]}" || fail "exited with $?"
png="$PWD/loss.csv.png"
if grep -qxF "loss plot: $png" out.txt; then pass "printed the plot's absolute path"; else fail "plot line: '$(grep '^loss plot' out.txt)', expected 'loss plot: $png'"; fi
if [ "$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] && [ "$(stat -c %s "$png")" -gt 2000 ]; then
  pass "loss.csv.png is a PNG of $(stat -c %s "$png") bytes"
else
  fail "loss.csv.png is not a fresh PNG ($(stat -c %s "$png" 2>/dev/null) bytes)"
fi
grep -qx 'loss CSV: .*/loss.csv' out.txt && [ "$(wc -l <loss.csv)" -eq 6 ] && pass "CSV with 5 epochs" || fail "CSV"

# A gnuplot that fails (it cannot write the PNG where a directory stands): reported as such, and
# nothing of gnuplot's (which then writes the picture to its stdout) reaches the output.
rm -f "$png"
mkdir -p "$png/in-the-way"
run 2 "${flags[@]}" || fail "exited with $? when gnuplot failed"
if grep -qx 'loss plot: skipped: gnuplot failed to write the PNG' out.txt && ! grep -qa IEND out.txt; then
  pass "a failing gnuplot is reported, its output kept out"
else
  fail "failing gnuplot: '$(grep -a '^loss plot' out.txt)'"
fi
finish
