#!/usr/bin/env bash
# A bad flag or value is named on every rank, which all exit non-zero without a hang; --device
# cuda and --backend nccl fail cleanly in a build without them, naming the CMake option.
source "$(dirname "$0")/common.sh"
n=2
expect_refused "$n" 'not expected: --bogus' --bogus
expect_refused "$n" '--epochs: expects a number' --epochs abc
expect_refused "$n" '--epochs = 1.5' --epochs 1.5
expect_refused "$n" '--epochs: must be >= 1' --epochs 0
expect_refused "$n" '--lr: must be a positive number' --lr -1
expect_refused "$n" '--lr: .*missing' --lr
expect_refused "$n" '--seed: must be >= 0' --seed -1
expect_refused "$n" 'not a multiple of the 2 ranks' --batch 255
expect_refused "$n" '--backend: gloo not in' --backend gloo
expect_refused "$n" '--resume: needs --checkpoint' --resume
expect_refused "$n" '--checkpoint-every: needs --checkpoint' --checkpoint-every 2
expect_refused "$n" '--checkpoint-keep: needs --checkpoint' --checkpoint-keep 2
expect_refused "$n" '--checkpoint-seconds: needs --checkpoint' --checkpoint-seconds 5
expect_refused "$n" '--checkpoint-keep: must be >= 0' --checkpoint ck --checkpoint-keep -1
expect_refused "$n" '--resume: bogus not in' --checkpoint ck --resume bogus
grep -q "Run 'train --help'" err.txt && pass "--help named" || fail "the error does not point at --help"
expect_refused "$n" 'rescue_buddy .*needs shard_optimizer_state' --samples 96 --batch 48 --epochs 1 --rescue-buddy
# A bad flag on one rank only (two programs in one job): both ranks stop with it, none waits.
timeout 120 "$MPIEXEC" --oversubscribe --bind-to none -n 1 "$EXE" --epochs 1 : -n 1 "$EXE" --epochs 1 --bogus \
  >out.txt 2>err.txt
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && grep -q 'rank 0/2\]: error: .*--bogus (the command line of rank 1)' err.txt &&
  grep -q 'rank 1/2\]: error: .*--bogus' err.txt && ! grep -q '^epoch' out.txt; then
  pass "a bad flag on rank 1 alone stops both ranks before training"
else
  fail "a bad flag on rank 1 alone: exit $rc"
fi
if grep -q '^#define LOCKSTEP_HAS_CUDA 0' "$(dirname "$EXE")/../../include/lockstep/config.hpp" 2>/dev/null; then
  expect_refused "$n" 'LOCKSTEP_WITH_CUDA=ON' --device cuda
fi
if grep -q '^#define LOCKSTEP_HAS_NCCL 0' "$(dirname "$EXE")/../../include/lockstep/config.hpp" 2>/dev/null; then
  expect_refused "$n" 'LOCKSTEP_WITH_NCCL=ON' --backend nccl --device cuda
fi
# --help: exit 0, every flag listed with its value's name, printed once (rank 0), nothing on stderr.
expect_help "$n" train '--epochs E' '--samples S' '--batch B' '--lr LR' '--seed SEED' '--backend mpi|nccl' \
  '--device cpu|cuda' '--init torch|flux' '--checkpoint PATH' '--checkpoint-every K' \
  '--checkpoint-seconds T' '--checkpoint-keep K' '--resume [auto]' '--log CSV' '--help'
finish
