#!/usr/bin/env bash
# gpu_bench's command line, which it parses before it looks for a GPU, so this runs anywhere
# the NCCL extension is built: --help lists the flags and exits 0; an unknown flag or a missing
# value is named and ends the run with a non-zero status.
#   gpu_bench_flags.sh MPIEXEC GPU_BENCH WORKDIR
source "$(dirname "$0")/common.sh"
expect_help 1 gpu_bench '--out DIR' '--quick' '--help'
expect_refused 1 'not expected: --bogus' --bogus
expect_refused 1 '--out: .*missing' --out
finish
