#!/usr/bin/env bash
# The gpt example (examples/torch/gpt.cpp) as a user runs it, at its tiny preset (seconds): at
# -n 1 and -n 2 with --deterministic the validation loss falls, every `step S train loss X val
# loss Y` line and the last line `model hash crc32c:XXXXXXXX` are the same at both rank counts;
# an ordinary run at -n 2 learns too (its loss falls), prints a sample and writes its CSV.
# Skipped (77) when the corpus (Debian package fortunes) is not installed.
source "$(dirname "$0")/common.sh"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
data=/usr/share/games/fortunes
[ -d "$data" ] || { echo "skipped: $data missing (apt-get install fortunes)"; exit 77; }

last_hash() {
  local last
  last=$(tail -n 1 out.txt)
  if [[ $last =~ ^model\ hash\ crc32c:[0-9a-f]{8}$ ]]; then echo "${last#model hash }"; else echo "BAD-LAST-LINE:$last"; fi
}
# falls: the first and last validation losses printed, and whether the last is below the first by 0.3.
falls() {
  awk '/^step [0-9]+ train loss / {v = $8; if (first == "") first = v} END {
    if (first != "" && v + 0.3 < first + 0) { print "yes " first " -> " v } else { print "no " first " -> " v } }' out.txt
}

run 1 --preset tiny --steps 30 --deterministic || fail "-n 1 --deterministic exited with $?"
grep -q 'deterministic' out.txt || fail "-n 1: no deterministic header"
h1=$(last_hash)
curve1=$(grep '^step ' out.txt | sed 's/ (lr.*//')
f1=$(falls)
run 2 --preset tiny --steps 30 --deterministic || fail "-n 2 --deterministic exited with $?"
h2=$(last_hash)
curve2=$(grep '^step ' out.txt | sed 's/ (lr.*//')
[[ $f1 == yes* ]] && pass "-n 1: validation loss falls ($f1)" || fail "-n 1: validation loss does not fall ($f1)"
[ "$(echo "$curve1" | wc -l)" -eq 3 ] || fail "-n 1: expected 3 step lines (steps 10, 20, 30), got: $curve1"
if [[ $h1 == crc32c:* ]] && [ "$h1" = "$h2" ]; then
  pass "--deterministic: one model at -n 1 and -n 2 ($h1)"
else
  fail "--deterministic: -n 1 $h1, -n 2 $h2"
fi
[ "$curve1" = "$curve2" ] && pass "the same loss lines at -n 1 and -n 2" || fail "loss lines differ: '$curve1' vs '$curve2'"

run 2 --preset tiny --steps 30 --log loss.csv || fail "-n 2 ordinary run exited with $?"
f=$(falls)
[[ $f == yes* ]] && pass "-n 2: validation loss falls ($f)" || fail "-n 2: validation loss does not fall ($f)"
grep -q '^sample:$' out.txt || fail "-n 2: no sample printed"
[[ $(last_hash) == crc32c:* ]] || fail "-n 2: the last line is not the model hash: $(tail -n 1 out.txt)"
if [ "$(head -n 1 loss.csv)" = "step,lr,train_loss,val_loss" ] && [ "$(wc -l <loss.csv)" -eq 31 ]; then
  pass "loss.csv: a header and 30 rows"
else
  fail "loss.csv: $(head -n 2 loss.csv | tr '\n' ';') $(wc -l <loss.csv) lines"
fi
# Its plot: a PNG at the path printed, or where gnuplot is missing, the reason.
png=$(sed -n 's/^loss plot: \(\/.*\)$/\1/p' out.txt)
if command -v gnuplot >/dev/null; then
  [ -n "$png" ] && [ "$(head -c 4 "$png" | tail -c 3)" = PNG ] && pass "loss plot: $png" ||
    fail "loss plot: $(grep '^loss plot' out.txt)"
else
  grep -q '^loss plot: skipped: gnuplot is not installed' out.txt || fail "loss plot without gnuplot: $(grep '^loss plot' out.txt)"
fi
expect_refused 2 '--batch.*7 is not a multiple of the 2 ranks' --batch 7
expect_failure 2 'no such file or directory' --data /nonexistent/corpus.txt
expect_failure 2 'rank 0 cannot write this file' --log /nonexistent/loss.csv
finish
