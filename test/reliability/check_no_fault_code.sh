#!/usr/bin/env bash
# A build without fault injection has no fault code in the monitor of a collective:
# src/mpi/monitor*.cpp (one file including them all), with the headers they include, preprocessed with LOCKSTEP_FAULT_INJECTION=0
# names none of the fault identifiers, which the same file names with LOCKSTEP_FAULT_INJECTION=1
# (so that the check can fail). Prints the fast path's test, fast_ok(), as the build without
# fault injection compiles it.
# Usage: check_no_fault_code.sh CXX SOURCE [COMPILER FLAGS...]
set -u
cxx=$1 src=$2
shift 2
ids='\b(fault_pending_|fault_spec|inject_fault|FaultSpec|FaultKind|skipped_)\b'
fail=0
for fi in 1 0; do
  if ! out=$("$cxx" -std=c++20 -E -P -DLOCKSTEP_FAULT_INJECTION=$fi "$@" "$src"); then
    echo "FAIL: $src does not preprocess with LOCKSTEP_FAULT_INJECTION=$fi"
    exit 1
  fi
  n=$(grep -cE "$ids" <<<"$out")
  echo "LOCKSTEP_FAULT_INJECTION=$fi: $n lines name fault code"
  if [ "$fi" = 1 ] && [ "$n" -eq 0 ]; then echo "FAIL: no fault code found even with fault injection"; fail=1; fi
  if [ "$fi" = 0 ] && [ "$n" -ne 0 ]; then
    echo "FAIL: fault code left in the build without fault injection:"
    grep -nE "$ids" <<<"$out" | head -n 20
    fail=1
  fi
  if [ "$fi" = 0 ]; then
    echo "fast_ok() without fault injection:"
    grep -A4 'bool fast_ok() const noexcept' <<<"$out"
  fi
done
[ "$fail" = 0 ] && echo "no fault code: OK"
exit "$fail"
