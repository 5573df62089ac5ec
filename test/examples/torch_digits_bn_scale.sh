#!/usr/bin/env bash
# The torch_digits_bn example (a CNN whose BatchNorm2d lt::convert_sync_batchnorm made
# SyncBatchNorm2d, trained with lt::DistributedOptimizer) at -n 1, 2 and 4 for 2 epochs: the
# final test loss is the same at the three sizes up to float rounding (relative 1e-5; measured 1.2e-7), since
# every size normalises with the global batch's statistics; and the model learned (accuracy
# above 0.8). Skipped (77) when python3-sklearn's digits.csv.gz is not installed.
source "$(dirname "$0")/common.sh"
export OMP_NUM_THREADS=1
data=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
[ -f "$data" ] || { echo "skipped: $data missing (apt-get install python3-sklearn)"; exit 77; }
test_loss() { awk '/^final test loss/ {print $4}' out.txt; }
declare -A loss
for n in 1 2 4; do
  if run "$n" --epochs 2; then
    loss[$n]=$(test_loss)
    acc=$(awk '/^final test accuracy/ {print $4}' out.txt)
    grep -q "with 2 SyncBatchNorm2d" out.txt || fail "-n $n: convert_sync_batchnorm did not report 2 modules"
    if less 0.8 "$acc"; then pass "-n $n test loss ${loss[$n]}, accuracy $acc"; else fail "-n $n accuracy '$acc' not above 0.8"; fi
  else
    fail "-n $n exited with $?: $(tail -c 300 err.txt)"
    loss[$n]=nan
  fi
done
for n in 2 4; do
  if rel_close "${loss[1]}" "${loss[$n]}" 1e-5; then
    pass "-n $n test loss ${loss[$n]} equals -n 1's ${loss[1]} within 1e-5"
  else
    fail "-n $n test loss '${loss[$n]}' differs from -n 1's '${loss[1]}' by more than 1e-5"
  fi
done
finish
