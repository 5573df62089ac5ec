#!/usr/bin/env bash
# Shows that the GPU kit (scripts/gpu-kit.sh) is enough on its own. With the machine's own
# Open MPI (and Catch2, CLI11, nlohmann-json, BLAS, OpenBLAS) hidden, it
#   1. compiles a small MPI program with the kit's mpicxx and runs it with the kit's mpiexec at
#      2 ranks (the program checks that it sees 2 ranks and that an allreduce adds them up);
#   2. configures Lockstep (CPU only) with the kit's mpicxx, mpi.h, libmpi, Catch2 and BLAS
#      (and CLI11, nlohmann-json where this version looks for them), checks in CMake's cache
#      that each came from the kit, builds test_collective and the train example, and runs
#      both at 2 ranks with the kit's mpiexec.
#
#   scripts/gpu-kit-proof.sh [KIT_DIR] [BUILD_DIR]
#       (defaults: gpu-kit in the repository, /tmp/lockstep-kit-proof)
#
# Hiding: the script runs itself again in a private mount namespace (`unshare -m`, needs
# root), where every file of the system's packages above is covered by /dev/null and their
# folders by empty tmpfs mounts, so that anything still reaching for them fails loudly. PATH is
# a folder of links to the build tools only, LD_LIBRARY_PATH and OPAL_PREFIX are the kit's.
# Without unshare (not root) it hides by PATH and LD_LIBRARY_PATH only, and says so.
# Exit status 0 when everything passed; the output says what was checked.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
kit=$(cd "${1:-$root/gpu-kit}" && pwd)
build=${2:-/tmp/lockstep-kit-proof}
jobs=${LOCKSTEP_JOBS:-2}

if [ "${LOCKSTEP_KIT_PROOF_INNER:-}" != 1 ]; then
  if [ "$(id -u)" -eq 0 ] && unshare -m true 2>/dev/null; then
    exec env LOCKSTEP_KIT_PROOF_INNER=1 LOCKSTEP_KIT_PROOF_HIDDEN=1 \
      unshare -m --propagation private bash "$0" "$kit" "$build"
  fi
  echo "gpu-kit-proof: cannot create a mount namespace; hiding the system MPI by PATH only"
  LOCKSTEP_KIT_PROOF_INNER=1 LOCKSTEP_KIT_PROOF_HIDDEN=0 exec bash "$0" "$kit" "$build"
fi

fail() {
  echo "gpu-kit-proof: FAIL: $*"
  exit 1
}

if [ "${LOCKSTEP_KIT_PROOF_HIDDEN:-0}" = 1 ]; then
  pkgs="openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libpmix-dev libhwloc15
    libhwloc-dev libhwloc-plugins libevent-core-2.1-7 libevent-pthreads-2.1-7 libevent-dev
    libmunge2 catch2 libcli11-dev nlohmann-json3-dev libblas3 libblas-dev libopenblas0-pthread
    libopenblas-pthread-dev libopenblas-dev libopenblas0"
  for d in /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 /usr/share/openmpi \
    /etc/openmpi /usr/include/catch2 /usr/lib/cmake/Catch2 /usr/lib/x86_64-linux-gnu/hwloc \
    /usr/share/cmake/CLI11 /usr/include/CLI /usr/share/cmake/nlohmann_json /usr/include/nlohmann \
    /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/include/x86_64-linux-gnu/openblas-pthread \
    /usr/lib/x86_64-linux-gnu/blas; do
    if [ -d "$d" ]; then mount -t tmpfs none "$d"; fi
  done
  n=0
  while IFS= read -r f; do
    [ -e "$f" ] || continue
    real=$(readlink -f "$f")
    [ -f "$real" ] || continue
    case $real in /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/*) continue ;; esac
    if mount --bind /dev/null "$real" 2>/dev/null; then n=$((n + 1)); fi
  done < <(for p in $pkgs; do dpkg -L "$p" 2>/dev/null || true; done)
  echo "hidden: $n files of the system's Open MPI, PMIx, hwloc, libevent, munge, Catch2, CLI11, nlohmann-json, BLAS and OpenBLAS packages (bound to /dev/null), and their folders (empty tmpfs)"
  if [ -s /usr/bin/orterun ]; then fail "the system's orterun is still visible"; fi
fi

# A PATH without the system's MPI even when nothing could be hidden: only the build tools,
# through a folder of links.
tools=$(mktemp -d)
for t in cmake ctest g++ gcc c++ cc ld as ar ranlib nm make ninja ccache sh bash env timeout \
  readlink dirname basename cat grep sed awk mkdir rm cp mv ln ls find head tail tr id uname \
  sort wc date ldd xargs objdump mktemp touch chmod expr getconf; do
  if p=$(command -v "$t" 2>/dev/null); then ln -s "$p" "$tools/$t"; fi
done
export PATH=$tools
unset LD_LIBRARY_PATH OPAL_PREFIX PMIX_INSTALL_PREFIX MPI_HOME CPATH LIBRARY_PATH
export PKG_CONFIG_PATH="" PKG_CONFIG_LIBDIR=$kit/usr/lib/x86_64-linux-gnu/pkgconfig
# shellcheck source=/dev/null
. "$kit/env.sh"

echo "mpiexec: $(command -v mpiexec)"
[ "$(command -v mpiexec)" = "$kit/usr/bin/mpiexec" ] || fail "mpiexec is not the kit's"
mpiexec --version | head -1

# 1. A plain MPI program through the kit's compiler wrapper.
mkdir -p "$build.hello"
cat >"$build.hello/hello.cpp" <<'CPP'
#include <mpi.h>
#include <cstdio>
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0, sum = 0, one = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  if (rank == 0) std::printf("hello: %d ranks, allreduce sum %d, %.40s\n", size, sum, version);
  MPI_Finalize();
  return size == 2 && sum == 2 ? 0 : 1;
}
CPP
mpicxx -o "$build.hello/hello" "$build.hello/hello.cpp" || fail "mpicxx could not build an MPI program"
echo "hello's libmpi: $(ldd "$build.hello/hello" | grep -o '/[^ ]*libmpi.so[^ ]*')"
timeout 60 mpiexec -n 2 "$build.hello/hello" || fail "the MPI program at 2 ranks"

# 2. Lockstep against the kit.
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
rm -rf "$build"
# shellcheck disable=SC2086  # LOCKSTEP_KIT_CMAKE_ARGS is a list of -D arguments
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DLOCKSTEP_WITH_CUDA=OFF -DLOCKSTEP_WITH_NCCL=OFF -DLOCKSTEP_WITH_TORCH=OFF \
  -DLOCKSTEP_BUILD_EXAMPLES=ON -DLOCKSTEP_BUILD_BENCH=OFF -DLOCKSTEP_BUILD_TESTS=ON \
  $LOCKSTEP_KIT_CMAKE_ARGS >"$build.configure.log" 2>&1 ||
  { tail -30 "$build.configure.log"; fail "configure"; }
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
from_kit() { # NAME VALUE: VALUE must lie in the kit
  echo "$1 from: ${2:-(not set)}"
  case $2 in "$kit"/*) ;; *) fail "$1 is not the kit's" ;; esac
}
from_kit mpi.h "$(cache MPI_CXX_HEADER_DIR)"
from_kit libmpi "$(cache MPI_mpi_LIBRARY)"
from_kit Catch2 "$(cache Catch2_DIR)"
# CLI11 (the examples' command lines) and nlohmann-json (the checkpoint reader) are being added
# to Lockstep; where this version looks for them they must come from the kit.
for pkg in CLI11 nlohmann_json; do
  if grep -r -q --include=CMakeLists.txt --include='*.cmake' "find_package($pkg" "$root"; then
    from_kit "$pkg" "$(cache "${pkg}_DIR")"
  else
    echo "$pkg: not looked for by this version of Lockstep (the kit holds it for the versions that do)"
  fi
done
blas=$(cache BLAS_blas_LIBRARY)
[ -n "$blas" ] || blas=$(cache BLAS_LIBRARIES)
from_kit "BLAS (train)" "$blas"
from_kit "cblas.h (train)" "$(cache LOCKSTEP_CBLAS_INCLUDE_DIR)"
cmake --build "$build" -j "$jobs" --target test_collective train >"$build.build.log" 2>&1 ||
  { tail -30 "$build.build.log"; fail "build"; }
echo "test_collective's libmpi: $(ldd "$build/test/test_collective" | grep -o '/[^ ]*libmpi.so[^ ]*')"
ldd "$build/test/test_collective" | grep -q "$kit/usr/lib/x86_64-linux-gnu/libmpi.so" ||
  fail "the test does not load the kit's libmpi"
export DIST_TEST_MPI=true
timeout 600 mpiexec --bind-to none -n 2 "$build/test/test_collective" >"$build.run.log" 2>&1 ||
  { tail -40 "$build.run.log"; fail "test_collective at 2 ranks"; }
echo "test_collective at 2 ranks: $(grep -a -o 'All tests passed.*' "$build.run.log" | head -1)"
echo "train's BLAS: $(ldd "$build/examples/train/train" | grep -o '/[^ ]*blas[^ ]*' | head -1)"
timeout 300 mpiexec --bind-to none -n 2 "$build/examples/train/train" --epochs 3 --samples 512 \
  >"$build.train.log" 2>&1 || { tail -20 "$build.train.log"; fail "train at 2 ranks"; }
echo "train at 2 ranks: $(grep 'final loss' "$build.train.log")"
hidden=""
if [ "${LOCKSTEP_KIT_PROOF_HIDDEN:-0}" = 1 ]; then hidden="; the system's packages hidden"; fi
echo "gpu-kit-proof: PASS (an MPI program, test_collective and train at 2 ranks with the kit's mpiexec, mpicxx, mpi.h, libmpi, Catch2 and BLAS$hidden)"
