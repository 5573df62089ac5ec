#!/usr/bin/env bash
# Runs a test command only when the named variable is "true"; otherwise reports the test as
# skipped to CTest (exit code 77, the tests' SKIP_RETURN_CODE) instead of passing it.
# Usage: gate.sh VAR command [args...]
#        gate.sh --skip REASON ...   reports the test skipped, with REASON (a test that this
#                                    build cannot run, e.g. one injecting faults in a build
#                                    without fault injection)
if [ "${1:-}" = "--skip" ]; then
  echo "skipped: $2"
  exit 77
fi
var=$1
shift
if [ "${!var:-}" != "true" ]; then
  echo "skipped: set $var=true to run this test"
  exit 77
fi
exec "$@"
