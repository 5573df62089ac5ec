#!/usr/bin/env bash
# CI stage "fuzz": builds the libFuzzer target over the checkpoint reader with clang 14
# (-fsanitize=fuzzer,address,undefined) and runs it for a bounded time from the seed corpus in
# test/fuzz/corpus/. Inputs it discovers go to a scratch directory; a crash leaves
# crash-<sha1> in the build directory and fails the stage.
#
# Usage: scripts/ci-fuzz.sh   (LOCKSTEP_FUZZ_SECONDS, default 60; BUILD_DIR, default build-fuzz;
#                              JOBS, default 2; CXX, default clang++-14)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build-fuzz}
jobs=${JOBS:-2}
seconds=${LOCKSTEP_FUZZ_SECONDS:-60}
# A fixed seed by default, so that CI explores the same inputs on every run and a red run can be
# reproduced; LOCKSTEP_FUZZ_SEED=0 lets libFuzzer pick one (for longer exploratory runs).
seed=${LOCKSTEP_FUZZ_SEED:-1}
cxx=${CXX:-clang++-14}

# The library is compiled with coverage instrumentation (fuzzer-no-link); the target links the
# fuzzer's main. Only the fuzz target and what it needs are built. test/fuzz/shim supplies
# <source_location>, which clang 14 cannot compile from libstdc++ 12.
cmake -S "$root" -B "$build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_UNITY_BUILD=ON \
  -DCMAKE_CXX_FLAGS="-isystem $root/test/fuzz/shim -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined" \
  -DLOCKSTEP_BUILD_FUZZERS=ON -DLOCKSTEP_WITH_CUDA=OFF -DLOCKSTEP_WITH_NCCL=OFF -DLOCKSTEP_WITH_TORCH=OFF \
  -DLOCKSTEP_BUILD_TESTS=ON -DLOCKSTEP_BUILD_EXAMPLES=OFF -DLOCKSTEP_BUILD_BENCH=OFF
cmake --build "$build" -j "$jobs" --target lockstep_fuzz_checkpoint

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
cd "$build"
# -timeout: one input taking over 10 s is a hang; -rss_limit_mb: a huge allocation from a
# small file is a bug (the reader must check sizes against the file before allocating).
./test/lockstep_fuzz_checkpoint "$scratch" "$root/test/fuzz/corpus" \
  -max_total_time="$seconds" -seed="$seed" -timeout=10 -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1
