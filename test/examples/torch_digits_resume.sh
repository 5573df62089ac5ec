#!/usr/bin/env bash
# Stop and resume with lt::save_checkpoint / lt::load_checkpoint: 2 epochs, then --resume to 4,
# ends bitwise identical to an uninterrupted 4-epoch run at -n 2: the final loss and accuracy
# lines (losses printed with 17 digits) and the final checkpoints (parameters, the epochs_done
# buffer, Adam's step and moments) byte for byte.
# Skipped (77) when python3-sklearn's digits.csv.gz is not installed.
source "$(dirname "$0")/common.sh"
export OMP_NUM_THREADS=1
data=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
[ -f "$data" ] || { echo "skipped: $data missing (apt-get install python3-sklearn)"; exit 77; }
finals() { grep '^final ' out.txt; }
run 2 --epochs 4 --checkpoint full.safetensors || fail "full run exited with $?"
full=$(finals)
run 2 --epochs 2 --checkpoint part.safetensors || fail "first part exited with $?"
run 2 --epochs 4 --checkpoint part.safetensors --resume || fail "resume exited with $?"
grep -q '^resumed from part.safetensors after epoch 2$' out.txt || fail "resume did not report epoch 2"
[ "$(grep -c '^epoch ' out.txt)" -eq 2 ] || fail "the resumed run did not train exactly epochs 3 and 4"
grep -q '^epoch   3 ' out.txt || fail "the resumed run did not start at epoch 3"
part=$(finals)
if [ -n "$full" ] && [ "$full" = "$part" ]; then pass "final lines identical: $(echo "$full" | tr '\n' ';')"; else fail "final lines differ: '$full' vs '$part'"; fi
if cmp -s full.safetensors part.safetensors; then pass "checkpoints byte-identical"; else fail "checkpoints differ after resume"; fi
finish
