#!/usr/bin/env bash
# Follows the docs a new user reads first, as written, and fails where they are wrong:
#
# 1. docs/getting-started.md's build-and-install block (the ```sh block with `cmake --install`),
#    run verbatim with /opt/lockstep moved into WORK_DIR. By default it runs on a stand-in
#    source tree (a project with one test and one installed file): that checks the commands and
#    their flags as written, in seconds, and the install the programs below use is BUILD_DIR's
#    (`cmake --install`). With LOCKSTEP_DOCS_FULL=1 it runs on a scratch copy of the real source
#    tree instead, whose build directory is seeded with tests, examples, benchmarks and CUDA off
#    (the block's own configure keeps them): it builds and installs the core (a minute or two),
#    and the programs use that install.
# 2. getting-started's CMakeLists.txt (the ```cmake block with `project(`) and its build block
#    (the ```sh block with CMAKE_PREFIX_PATH), run against that install for every C++ program
#    of README.md and getting-started (the ```cpp blocks with `int main`), saved as main.cpp.
# 3. Each program's transcript: the ```console block after it, whose `$ ` lines are run as
#    written (from the program's directory) and whose other lines are the expected stdout. Each
#    program needs one at -n 2 and one at -n 4. OMPI_MCA_rmaps_base_oversubscribe is unset, so
#    a missing --oversubscribe fails as it would for a user on a machine with fewer cores.
# 4. Every ```sh block of getting-started parses (bash -n), and the labels that getting-started's
#    `ctest -L X` / `-LE X` mention select tests in BUILD_DIR.
# 5. Every relative link of docs/*.md, docs/*/*.md, README.md and NEWS.md names a file that
#    exists, and each #anchor a heading of it (test/docs/check_links.py; needs python3).
#
# Usage: check_docs.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -uo pipefail
SRC=$(cd "$1" && pwd)
BUILD=$(cd "$2" && pwd)
WORK=$3
rm -rf "$WORK" && mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd) || exit 1
cd "$WORK" || exit 1

# What the docs tell a user to do: the root pair only as root; nothing else from the test
# environment (no oversubscription unless the command line asks for it).
unset OMPI_MCA_rmaps_base_oversubscribe
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
pass() { echo "ok: $*"; }

# extract DOC DIR: every fenced block of DOC into DIR/NNN.LANG (LANG "text" when the fence has
# none), and DIR/index with one line per block: "NNN LANG LINE".
extract() {
  mkdir -p "$2"
  awk -v dir="$2" '
    /^```/ {
      if (!inside) {
        inside = 1; n++; lang = substr($0, 4); gsub(/[ \t].*/, "", lang)
        if (lang == "") lang = "text"
        file = sprintf("%s/%03d.%s", dir, n, lang)
        printf "" > file
        printf "%03d %s %d\n", n, lang, NR > (dir "/index")
      } else {
        inside = 0; close(file)
      }
      next
    }
    inside { print > file }
  ' "$1"
}

# run_block NAME FILE DIR: runs a shell block in DIR with bash -e, /opt/lockstep replaced by the
# scratch prefix; its output goes to WORK/NAME.log.
run_block() {
  local name=$1 file=$2 dir=$3
  sed "s|/opt/lockstep|$WORK/opt/lockstep|g" "$file" >"$WORK/$name.sh"
  if (cd "$dir" && timeout 1200 bash -e "$WORK/$name.sh") </dev/null >"$WORK/$name.log" 2>&1; then
    pass "$name"
    return 0
  fi
  fail "$name: the block failed; its output ends with:"
  tail -30 "$WORK/$name.log"
  return 1
}

GS=$SRC/docs/getting-started.md
extract "$SRC/README.md" "$WORK/blocks/readme"
extract "$GS" "$WORK/blocks/gs"

# Blocks of getting-started found by what they contain.
find_block() {  # find_block LANG PATTERN: the first such block of getting-started
  local n lang line
  while read -r n lang line; do
    if [ "$lang" = "$1" ] && grep -q -- "$2" "$WORK/blocks/gs/$n.$lang"; then
      echo "$WORK/blocks/gs/$n.$lang"
      return 0
    fi
  done <"$WORK/blocks/gs/index"
  return 1
}
install_block=$(find_block sh 'cmake --install') || { fail "getting-started has no sh block with 'cmake --install'"; }
cmake_block=$(find_block cmake 'project(') || { fail "getting-started has no cmake block with project()"; }
app_block=$(find_block sh 'CMAKE_PREFIX_PATH') || { fail "getting-started has no sh block with CMAKE_PREFIX_PATH"; }

# --- 4. every sh block parses; the test labels exist ----------------------------------------
while read -r n lang line; do
  [ "$lang" = sh ] || continue
  if bash -n "$WORK/blocks/gs/$n.sh" 2>"$WORK/syntax.err"; then
    pass "getting-started.md:$line: sh block parses"
  else
    fail "getting-started.md:$line: sh block does not parse: $(cat "$WORK/syntax.err")"
  fi
done <"$WORK/blocks/gs/index"
for label in $(grep -o -E 'ctest -LE? [A-Za-z_]+' "$GS" | awk '{print $3}' | sort -u); do
  count=$(ctest --test-dir "$BUILD" -N -L "$label" 2>/dev/null | awk '/^Total Tests:/ {print $3}')
  if [ "${count:-0}" -gt 0 ]; then pass "label '$label' selects $count tests"; else fail "getting-started mentions ctest label '$label', which selects no test"; fi
done

# --- 5. relative links between the docs ------------------------------------------------------
if command -v python3 >/dev/null 2>&1; then
  if python3 "$SRC/test/docs/check_links.py" "$SRC" >"$WORK/links.log" 2>&1; then
    pass "$(tail -1 "$WORK/links.log")"
  else
    fail "broken links in the docs:"
    cat "$WORK/links.log"
  fi
else
  echo "note: python3 not found: the docs' relative links are not checked"
fi

[ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }

# --- 1. build and install, as getting-started says ------------------------------------------
mkdir -p "$WORK/src/build"
if [ "${LOCKSTEP_DOCS_FULL:-0}" = 1 ]; then
  # A scratch source tree: links to the repository's entries, without its build directories.
  for entry in "$SRC"/* "$SRC"/.[!.]*; do
    [ -e "$entry" ] || continue
    case $(basename "$entry") in build* | .git) continue ;; esac
    ln -s "$entry" "$WORK/src/$(basename "$entry")"
  done
  {
    echo "LOCKSTEP_BUILD_TESTS:BOOL=OFF"
    echo "LOCKSTEP_BUILD_EXAMPLES:BOOL=OFF"
    echo "LOCKSTEP_BUILD_BENCH:BOOL=OFF"
    echo "LOCKSTEP_WITH_CUDA:BOOL=OFF"
    echo "LOCKSTEP_WITH_NCCL:BOOL=OFF"
    echo "CMAKE_CUDA_COMPILER:FILEPATH=CMAKE_CUDA_COMPILER-NOTFOUND"
    if command -v ccache >/dev/null; then echo "CMAKE_CXX_COMPILER_LAUNCHER:STRING=ccache"; fi
  } >"$WORK/src/build/CMakeCache.txt"
  run_block "build-and-install" "$install_block" "$WORK/src" || { echo "$failures check(s) failed"; exit 1; }
  grep -q 'Lockstep .* configuration summary' "$WORK/build-and-install.log" &&
    pass "configure printed its summary" || fail "configure printed no summary"
else
  # The stand-in: one test (which must run and pass) and one file to install.
  cat >"$WORK/src/CMakeLists.txt" <<'EOF_STUB'
cmake_minimum_required(VERSION 3.25)
project(stand_in LANGUAGES NONE)
enable_testing()
add_test(NAME stand_in_test COMMAND ${CMAKE_COMMAND} -E environment)
set_tests_properties(stand_in_test PROPERTIES PASS_REGULAR_EXPRESSION "DIST_TEST_MPI=true")
install(FILES CMakeLists.txt DESTINATION share/stand_in)
EOF_STUB
  run_block "build-and-install" "$install_block" "$WORK/src" ||
    { echo "$failures check(s) failed"; exit 1; }
  grep -q '100% tests passed' "$WORK/build-and-install.log" &&
    [ -f "$WORK/opt/lockstep/share/stand_in/CMakeLists.txt" ] &&
    pass "the block's commands ran a stand-in project's test and installed it" ||
    fail "the block did not run the stand-in's test or install it (see $WORK/build-and-install.log)"
  rm -rf "$WORK/opt/lockstep"
  cmake --install "$BUILD" --prefix "$WORK/opt/lockstep" >"$WORK/install.log" 2>&1 ||
    { fail "cmake --install $BUILD"; cat "$WORK/install.log"; exit 1; }
fi
[ -f "$WORK/opt/lockstep/include/lockstep/lockstep.hpp" ] || fail "the install put no lockstep.hpp under the prefix"

# --- 2 and 3. each program, built as getting-started says, run as its doc says ---------------
mkdir -p "$WORK/app"
cp "$cmake_block" "$WORK/app/CMakeLists.txt"

# check_transcript DOC LINE FILE: runs the $ lines of a console block, compares the output.
check_transcript() {
  local doc=$1 line=$2 file=$3 cmd="" expected="" l
  local -n ranks_seen=$4
  run_one() {
    [ -n "$cmd" ] || return 0
    local n
    n=$(printf '%s\n' "$cmd" | grep -o -E -- '-n [0-9]+' | head -1 | awk '{print $2}')
    [ -n "$n" ] && ranks_seen+=("$n")
    local got
    got=$(cd "$WORK/app" && timeout 120 bash -c "$cmd" </dev/null 2>"$WORK/app/stderr.txt")
    local rc=$?
    got=$(printf '%s\n' "$got" | sed -e 's/[[:space:]]*$//')
    if [ "$rc" -eq 0 ] && [ "$got" = "$(printf '%s\n' "$expected" | sed -e 's/[[:space:]]*$//')" ]; then
      pass "$doc:$line: \`$cmd\` printed what the doc says"
    else
      fail "$doc:$line: \`$cmd\` (exit $rc) printed:"
      printf '%s\n' "$got" | sed 's/^/    /'
      echo "  the doc says:"
      printf '%s\n' "$expected" | sed 's/^/    /'
      echo "  stderr:"
      sed 's/^/    /' "$WORK/app/stderr.txt" | tail -15
    fi
  }
  while IFS= read -r l || [ -n "$l" ]; do
    if [[ $l == '$ '* ]]; then
      run_one
      cmd=${l#\$ }
      expected=""
    else
      expected+="${expected:+$'\n'}$l"
    fi
  done <"$file"
  run_one
}

programs=0
for doc in readme gs; do
  case $doc in readme) docname=README.md ;; gs) docname=docs/getting-started.md ;; esac
  current=""
  ranks=()
  finish_program() {
    [ -n "$current" ] || return 0
    local need r found
    for need in 2 4; do
      found=0
      for r in "${ranks[@]}"; do [ "$r" = "$need" ] && found=1; done
      [ "$found" = 1 ] || fail "$docname:$current: the program has no output stated for \`mpiexec -n $need\`"
    done
  }
  while read -r n lang line; do
    f="$WORK/blocks/$doc/$n.$lang"
    if [ "$lang" = cpp ] && grep -q 'int main' "$f"; then
      finish_program
      current=$line
      ranks=()
      programs=$((programs + 1))
      cp "$f" "$WORK/app/main.cpp"
      if ! run_block "build-$doc-$line" "$app_block" "$WORK/app"; then
        current=""
        continue
      fi
    elif [ "$lang" = console ] && [ -n "$current" ]; then
      check_transcript "$docname" "$line" "$f" ranks
    fi
  done <"$WORK/blocks/$doc/index"
  finish_program
done
[ "$programs" -ge 2 ] || fail "found $programs C++ programs in README.md and getting-started.md (expected at least 2)"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed ($programs programs)"
