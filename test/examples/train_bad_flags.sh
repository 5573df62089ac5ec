#!/usr/bin/env bash
# A bad flag or value prints usage and exits non-zero on every rank, without a hang; --device
# cuda and --backend nccl fail cleanly in a build without them, naming the CMake option.
source "$(dirname "$0")/common.sh"
n=2
expect_usage_error() {
  local pattern=$1
  shift
  run "$n" "$@"
  local rc=$? count
  count=$(grep -c "error: .*$pattern" err.txt)
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$count" -eq "$n" ]; then
    pass "'$*' refused on all ranks: $(grep -m1 'error:' err.txt | sed 's/.*error: //')"
  else
    fail "'$*': exit $rc, $count of $n ranks reported '$pattern'"
  fi
}
expect_usage_error 'unknown flag "--bogus"' --bogus
expect_usage_error '--epochs expects a number' --epochs abc
expect_usage_error '--epochs must be >= 1' --epochs 0
expect_usage_error '--lr must be a positive number' --lr -1
expect_usage_error '--lr needs a value' --lr
expect_usage_error 'not a multiple of the 2 ranks' --batch 255
expect_usage_error '--backend must be mpi or nccl' --backend gloo
expect_usage_error '--resume needs --checkpoint' --resume
grep -q 'usage: mpiexec -n N train' err.txt && pass "usage printed" || fail "usage not printed"
if grep -q '^#define LOCKSTEP_HAS_CUDA 0' "$(dirname "$EXE")/../../include/lockstep/config.hpp" 2>/dev/null; then
  expect_usage_error 'LOCKSTEP_WITH_CUDA=ON' --device cuda
fi
if grep -q '^#define LOCKSTEP_HAS_NCCL 0' "$(dirname "$EXE")/../../include/lockstep/config.hpp" 2>/dev/null; then
  expect_usage_error 'LOCKSTEP_WITH_NCCL=ON' --backend nccl --device cuda
fi
run "$n" --help && grep -q -- '--checkpoint-every K' out.txt && pass "--help exits 0 with usage" || fail "--help"
finish
