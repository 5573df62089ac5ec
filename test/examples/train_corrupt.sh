#!/usr/bin/env bash
# A truncated, corrupted or missing checkpoint is refused with a clear error on every rank, and
# the job ends (no hang, non-zero exit); the file is not modified.
source "$(dirname "$0")/common.sh"
n=3
common=(--samples 384 --batch 96 --epochs 2)
run "$n" "${common[@]}" --checkpoint good.st || fail "writing the checkpoint exited with $?"
size=$(stat -c %s good.st)
head -c $((size - 7)) good.st >truncated.st
head -c 6 good.st >tiny.st
cp good.st flipped.st
# Flip one bit in the data, 100 bytes before the end (plain shell: od, printf, dd).
poke() {  # poke FILE OFFSET XOR_MASK
  local byte
  byte=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf "\\$(printf '%03o' $((byte ^ $3)))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
poke flipped.st $((size - 100)) 8
# A header byte: the name "model.w1" becomes "model.x1" (still valid JSON, so only the checksum,
# which also covers the header, catches it).
cp good.st renamed.st
offset=$(grep -obUa 'model.w1' good.st | head -1 | cut -d: -f1)
poke renamed.st $((offset + 6)) 15
printf 'not a checkpoint at all, just text\n' >garbage.st
# expect_bad_checkpoint FILE PATTERN: resuming from a copy of FILE is refused on every rank with
# PATTERN, and the copy is left as it was.
expect_bad_checkpoint() {
  local file=$1 pattern=$2
  cp "$file" probe.st
  expect_refused "$n" "$pattern" "${common[@]}" --epochs 4 --checkpoint probe.st --resume
  cmp -s "$file" probe.st || fail "$file was modified by the refused resume"
}
expect_bad_checkpoint truncated.st "truncated"
expect_bad_checkpoint tiny.st "truncated"
expect_bad_checkpoint flipped.st "checksum mismatch"
expect_bad_checkpoint renamed.st "checksum mismatch"
expect_bad_checkpoint garbage.st "not a checkpoint"
run "$n" "${common[@]}" --checkpoint missing.st --resume
rc=$?
[ "$rc" -ne 0 ] && [ "$(grep -c 'error: .*cannot open' err.txt)" -eq "$n" ] && pass "missing checkpoint refused on all ranks" || fail "missing checkpoint: exit $rc"
# The good one still resumes.
cp good.st probe.st
run "$n" "${common[@]}" --epochs 4 --checkpoint probe.st --resume && grep -q 'after epoch 2' out.txt && pass "good checkpoint resumes" || fail "good checkpoint did not resume"
finish
