#!/usr/bin/env bash
# check_installed_headers.sh BUILD_DIR: installs the build into a scratch prefix (the install
# rules as they are) and fails when an installed header declares a test hook, or a pimpl
# (`struct Impl;`) that is not private (a class's state is no part of the API: declare it in the
# private section, or as a detail type defined in src/); prints "installed headers: OK" otherwise.
# check_installed_headers.sh --self-test: plants a hook and a public Impl in headers of a scratch
# folder and checks that both are reported, and that a clean folder passes.
set -euo pipefail

# A test hook, by the names the tree gives them: TestHooks, test_hooks(), *_for_test(ing).
pattern='TestHooks|test_hooks|_for_test(ing)?\b'

# scan DIR: the headers under DIR that match, one per line (none: prints nothing).
scan() { grep -rlE "$pattern" "$1" --include='*.hpp' || true; }
# scan_impl DIR: the headers under DIR that declare `struct Impl;` or `class Impl;` where the
# nearest access specifier above it is not private: or protected: (public:, or none).
scan_impl() {
  find "$1" -name '*.hpp' -print0 | xargs -0 -r awk '
    FNR == 1 { acc = "" }
    /^[ \t]*(public|private|protected)[ \t]*:/ { acc = $1 }
    /^[ \t]*(struct|class)[ \t]+Impl[ \t]*;/ && acc !~ /^(private|protected)/ { print FILENAME; nextfile }'
}

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

if [ "${1:-}" = "--self-test" ]; then
  mkdir -p "$scratch/clean/lockstep" "$scratch/dirty/lockstep/x/detail"
  printf 'struct Options { int a; };\n' >"$scratch/clean/lockstep/a.hpp"
  cp "$scratch/clean/lockstep/a.hpp" "$scratch/dirty/lockstep/a.hpp"
  printf 'class A {\n private:\n  struct Impl;\n};\n' >"$scratch/clean/lockstep/p.hpp"
  cp "$scratch/clean/lockstep/p.hpp" "$scratch/dirty/lockstep/p.hpp"
  printf 'struct TestHooks { int a; };\nvoid delay_for_test(double);\n' >"$scratch/dirty/lockstep/x/detail/b.hpp"
  printf 'class B {\n private:\n  int x_;\n public:\n  struct Impl;\n};\n' >"$scratch/dirty/lockstep/c.hpp"
  [ -z "$(scan "$scratch/clean")" ] || { echo "self-test: a clean folder was reported"; exit 1; }
  [ -z "$(scan_impl "$scratch/clean")" ] || { echo "self-test: a private Impl was reported"; exit 1; }
  found=$(scan "$scratch/dirty")
  [ "$found" = "$scratch/dirty/lockstep/x/detail/b.hpp" ] || { echo "self-test: the planted hook was not reported ($found)"; exit 1; }
  found=$(scan_impl "$scratch/dirty")
  [ "$found" = "$scratch/dirty/lockstep/c.hpp" ] || { echo "self-test: the planted public Impl was not reported ($found)"; exit 1; }
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
found=$(scan_impl "$scratch/prefix/include")
if [ -n "$found" ]; then
  echo "installed headers that declare a public struct Impl (make it private, or a detail type defined in src/):"
  echo "${found//$scratch\/prefix\//}"
  exit 1
fi
echo "installed headers: OK ($count headers, none declares a test hook or a public Impl)"
