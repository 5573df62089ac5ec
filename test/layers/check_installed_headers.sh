#!/usr/bin/env bash
# check_installed_headers.sh BUILD_DIR SOURCE_DIR: fails when a header a user gets declares a test
# hook, or a pimpl (`struct Impl;`) that is not private (a class's state is no part of the API:
# declare it in the private section, or as a detail type defined in src/); prints "installed
# headers: OK" otherwise. The headers a user gets: what the install rules put under include/
# (BUILD_DIR installed into a scratch prefix: lockstep::core and every component this build has),
# and the headers every component installs whether or not this build has it (SOURCE_DIR's
# ext/*/include, e.g. lockstep::nccl's in a build without CUDA).
# check_installed_headers.sh --self-test: plants hooks and a public Impl in headers of a scratch
# folder and checks that each is reported, and that a clean folder passes.
set -euo pipefail

# A test hook, by the names the tree gives them: TestHooks, test_hooks(), *_for_test(ing), a
# `testing` namespace (declared or named: lt::testing::fail_next_gradient), fail_next_*.
pattern='TestHooks|test_hooks|_for_test(ing)?\b|\bnamespace[[:space:]]+([[:alnum:]_]+::)*testing\b|\btesting::|\bfail_next_'

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
  mkdir -p "$scratch/clean/lockstep" "$scratch/dirty/lockstep/x/detail" "$scratch/dirty/lockstep/t"
  printf 'struct Options { int a; };\n// A comment on testing: for tests.\n' >"$scratch/clean/lockstep/a.hpp"
  cp "$scratch/clean/lockstep/a.hpp" "$scratch/dirty/lockstep/a.hpp"
  printf 'class A {\n private:\n  struct Impl;\n};\n' >"$scratch/clean/lockstep/p.hpp"
  cp "$scratch/clean/lockstep/p.hpp" "$scratch/dirty/lockstep/p.hpp"
  printf 'struct TestHooks { int a; };\nvoid delay_for_test(double);\n' >"$scratch/dirty/lockstep/x/detail/b.hpp"
  # lockstep::torch's hook as it was in its installed header (0.3 moved it to ext/torch/src).
  printf 'namespace lockstep::torch {\nnamespace testing {\nvoid fail_next_gradient(std::string m);\n}\n}\n' \
    >"$scratch/dirty/lockstep/t/torch.hpp"
  printf 'namespace lockstep::testing {\nvoid hook();\n}\n' >"$scratch/dirty/lockstep/t/ns.hpp"
  printf '/// Call lt::testing::hook() first.\nvoid f();\n' >"$scratch/dirty/lockstep/t/named.hpp"
  printf 'void fail_next_send(int n);\n' >"$scratch/dirty/lockstep/t/fail.hpp"
  printf 'class B {\n private:\n  int x_;\n public:\n  struct Impl;\n};\n' >"$scratch/dirty/lockstep/c.hpp"
  [ -z "$(scan "$scratch/clean")" ] || { echo "self-test: a clean folder was reported"; exit 1; }
  [ -z "$(scan_impl "$scratch/clean")" ] || { echo "self-test: a private Impl was reported"; exit 1; }
  found=$(scan "$scratch/dirty" | sed "s|^$scratch/dirty/||" | sort | tr '\n' ' ')
  want="lockstep/t/fail.hpp lockstep/t/named.hpp lockstep/t/ns.hpp lockstep/t/torch.hpp lockstep/x/detail/b.hpp "
  [ "$found" = "$want" ] || { echo "self-test: the planted hooks were not all reported (reported: $found)"; exit 1; }
  found=$(scan_impl "$scratch/dirty")
  [ "$found" = "$scratch/dirty/lockstep/c.hpp" ] || { echo "self-test: the planted public Impl was not reported ($found)"; exit 1; }
  echo "self-test: OK"
  exit 0
fi

build=${1:?usage: check_installed_headers.sh BUILD_DIR SOURCE_DIR | --self-test}
source_dir=${2:?usage: check_installed_headers.sh BUILD_DIR SOURCE_DIR | --self-test}
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
count=$(find "$scratch/prefix/include" -name '*.hpp' | wc -l)
[ "$count" -gt 0 ] || { echo "no header was installed under $scratch/prefix/include"; exit 1; }
# Every component's headers, as its install rule takes them (ext/<name>/include/lockstep/**.hpp).
components=()
for dir in "$source_dir"/ext/*/include; do
  [ -d "$dir/lockstep" ] && components+=("$dir")
done
[ "${#components[@]}" -gt 0 ] || { echo "no component headers under $source_dir/ext/*/include"; exit 1; }
ext_count=$(find "${components[@]}" -name '*.hpp' | wc -l)
report() {  # report KIND FOUND
  [ -n "$2" ] || return 0
  echo "$1"
  echo "$2" | sed -e "s|^$scratch/prefix/||" -e "s|^$source_dir/||"
  exit 1
}
found=$(scan "$scratch/prefix/include"; for dir in "${components[@]}"; do scan "$dir"; done)
report "installed headers that declare a test hook (move the hook to a header under src/ that is not installed):" "$found"
found=$(scan_impl "$scratch/prefix/include"; for dir in "${components[@]}"; do scan_impl "$dir"; done)
report "installed headers that declare a public struct Impl (make it private, or a detail type defined in src/):" "$found"
echo "installed headers: OK ($count installed by this build, $ext_count of the components ${components[*]#$source_dir/}; none declares a test hook or a public Impl)"
