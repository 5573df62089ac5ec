#!/usr/bin/env bash
# Stop and resume the gpt example (tiny preset): a run stopped after step 10 of a 20-step schedule
# and resumed continues the uninterrupted run's loss curve, and ends with its model hash:
# - ordinary mode at -n 2 (the model, AdamW's state, the schedule, the data position and both
#   ranks' dropout generators restored: without the generators the hash would differ);
# - --deterministic, stopped at -n 2 and resumed at -n 1;
# - --checkpoint-keep 2 --resume auto: a fresh start without a checkpoint, the same command
#   rerun after a stop resumes from STEM.latest, two numbered files kept, the uninterrupted hash.
# Skipped (77) when the corpus (Debian package fortunes) is not installed.
source "$(dirname "$0")/common.sh"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
data=/usr/share/games/fortunes
[ -d "$data" ] || { echo "skipped: $data missing (apt-get install fortunes)"; exit 77; }
common=(--preset tiny --steps 20 --eval-every 5)
curve() { grep '^step ' out.txt | sed 's/ (lr.*//'; }
last() { tail -n 1 out.txt; }

for mode in ordinary deterministic; do
  extra=()
  n_resume=2
  if [ $mode = deterministic ]; then extra=(--deterministic); n_resume=1; fi
  run 2 "${common[@]}" "${extra[@]}" || fail "$mode: uninterrupted run exited with $?"
  full_curve=$(curve)
  full_hash=$(last)
  [ $mode = ordinary ] && ordinary_hash=$full_hash
  rm -f ck.safetensors
  run 2 "${common[@]}" "${extra[@]}" --checkpoint ck.safetensors --stop-after 10 || fail "$mode: first part exited with $?"
  first_curve=$(curve)
  run "$n_resume" "${common[@]}" "${extra[@]}" --checkpoint ck.safetensors --resume || fail "$mode: resume exited with $?"
  grep -q '^resumed from ck.safetensors after step 10$' out.txt || fail "$mode: the resume did not report step 10"
  resumed_curve=$(printf '%s\n%s' "$first_curve" "$(curve)")
  if [ "$resumed_curve" = "$full_curve" ] && [[ $full_hash == "model hash crc32c:"* ]] && [ "$(last)" = "$full_hash" ]; then
    pass "$mode: stopped at step 10 at -n 2, resumed at -n $n_resume: the uninterrupted curve and ${full_hash#model hash }"
  else
    fail "$mode: resumed '$resumed_curve' / $(last); uninterrupted '$full_curve' / $full_hash"
  fi
done

# Rotation and --resume auto: the same command twice, the first stopped after step 10.
rot=(--preset tiny --steps 20 --eval-every 5 --checkpoint run/ck --checkpoint-keep 2 --resume auto)
run 2 "${rot[@]}" --stop-after 10 || fail "rotation: first part exited with $?"
grep -q '^no checkpoint at run/ck.latest: starting afresh' out.txt || fail "rotation: no fresh-start message"
run 2 "${rot[@]}" || fail "rotation: rerun exited with $?"
grep -q '^resumed from run/ck-000010.safetensors after step 10$' out.txt || fail "rotation: did not resume from step 10"
files=$(cd run && ls ck-*.safetensors | tr '\n' ' ')
if [ "$files" = "ck-000015.safetensors ck-000020.safetensors " ] && [ "$(cat run/ck.latest)" = "ck-000020.safetensors" ]; then
  pass "rotation: the last 2 kept ($files), ck.latest names step 20"
else
  fail "rotation: files '$files', pointer '$(cat run/ck.latest 2>/dev/null)'"
fi
if [ "$(last)" = "$ordinary_hash" ]; then
  pass "rotation: --resume auto ends with the uninterrupted run's ${ordinary_hash#model hash }"
else
  fail "rotation: $(last), uninterrupted $ordinary_hash"
fi
expect_refused 2 '--resume.*needs --checkpoint PATH' --resume
finish
