#!/usr/bin/env bash
# check_installed_headers.sh BUILD_DIR: installs the build into a scratch prefix (the install
# rules as they are) and fails when an installed header declares a test hook; prints
# "installed headers: OK" otherwise.
# check_installed_headers.sh --self-test: plants a hook in a header of a scratch folder and checks
# that it is reported, and that a clean folder passes.
set -euo pipefail

# A test hook, by the names the tree gives them: TestHooks, test_hooks(), *_for_test(ing).
pattern='TestHooks|test_hooks|_for_test(ing)?\b'

# scan DIR: the headers under DIR that match, one per line (none: prints nothing).
scan() { grep -rlE "$pattern" "$1" --include='*.hpp' || true; }

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

if [ "${1:-}" = "--self-test" ]; then
  mkdir -p "$scratch/clean/lockstep" "$scratch/dirty/lockstep/x/detail"
  printf 'struct Options { int a; };\n' >"$scratch/clean/lockstep/a.hpp"
  cp "$scratch/clean/lockstep/a.hpp" "$scratch/dirty/lockstep/a.hpp"
  printf 'struct TestHooks { int a; };\nvoid delay_for_test(double);\n' >"$scratch/dirty/lockstep/x/detail/b.hpp"
  [ -z "$(scan "$scratch/clean")" ] || { echo "self-test: a clean folder was reported"; exit 1; }
  found=$(scan "$scratch/dirty")
  [ "$found" = "$scratch/dirty/lockstep/x/detail/b.hpp" ] || { echo "self-test: the planted hook was not reported ($found)"; exit 1; }
  echo "self-test: OK"
  exit 0
fi

build=${1:?usage: check_installed_headers.sh BUILD_DIR | --self-test}
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
count=$(find "$scratch/prefix/include" -name '*.hpp' | wc -l)
[ "$count" -gt 0 ] || { echo "no header was installed under $scratch/prefix/include"; exit 1; }
found=$(scan "$scratch/prefix/include")
if [ -n "$found" ]; then
  echo "installed headers that declare a test hook (move the hook to src/):"
  echo "${found//$scratch\/prefix\//}"
  exit 1
fi
echo "installed headers: OK ($count headers, none declares a test hook)"
