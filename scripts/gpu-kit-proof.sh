#!/usr/bin/env bash
# Shows that the GPU kit (scripts/gpu-kit.sh) is enough on its own: with the machine's own
# Open MPI hidden, it configures Lockstep's core and tests against the kit's mpicxx, mpi.h,
# libmpi and Catch2, builds one MPI test and runs it with the kit's mpiexec at 2 ranks.
#
#   scripts/gpu-kit-proof.sh [KIT_DIR] [BUILD_DIR]
#       (defaults: gpu-kit in the repository, /tmp/lockstep-kit-proof)
#
# Hiding the system's MPI: the script runs itself again in a private mount namespace
# (`unshare -m`, needs root), where every file of the system's Open MPI, PMIx, hwloc, libevent
# and munge packages is covered by /dev/null and their folders by empty tmpfs mounts, so that
# anything that still reached for them would fail loudly. Without unshare (not root) it falls
# back to another PATH and LD_LIBRARY_PATH only and says so. Exit status 0 when the test passed
# at 2 ranks, and the build used the kit's files; the log says what was checked.
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

if [ "${LOCKSTEP_KIT_PROOF_HIDDEN:-0}" = 1 ]; then
  pkgs="openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libpmix-dev libhwloc15
    libhwloc-dev libhwloc-plugins libevent-core-2.1-7 libevent-pthreads-2.1-7 libevent-dev
    libmunge2 catch2"
  for d in /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 /usr/share/openmpi \
    /etc/openmpi /usr/include/catch2 /usr/lib/cmake/Catch2 /usr/lib/x86_64-linux-gnu/hwloc; do
    [ -d "$d" ] && mount -t tmpfs none "$d"
  done
  n=0
  for p in $pkgs; do
    dpkg -L "$p" 2>/dev/null || true
  done | while IFS= read -r f; do
    [ -e "$f" ] || continue
    real=$(readlink -f "$f")
    [ -f "$real" ] || continue
    case $real in /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/*) continue ;; esac
    mount --bind /dev/null "$real" 2>/dev/null && n=$((n + 1))
    echo "$n" >/tmp/.kit-proof-masked
  done
  echo "hidden: $(cat /tmp/.kit-proof-masked 2>/dev/null || echo 0) files of the system's Open MPI, PMIx, hwloc, libevent, munge, Catch2 (bound to /dev/null), and their folders"
fi

# A PATH without the system's MPI even when nothing could be hidden: only the tools the build
# needs, through a folder of links.
tools=$(mktemp -d)
for t in cmake ctest g++ gcc c++ cc ld as ar ranlib nm make ninja ccache sh bash env timeout \
  readlink dirname basename cat grep sed awk mkdir rm cp mv ln ls find head tail tr id uname \
  sort wc date ldd xargs objdump mktemp touch chmod expr getconf; do
  p=$(command -v "$t" 2>/dev/null) && ln -s "$p" "$tools/$t"
done
export PATH=$tools
unset LD_LIBRARY_PATH OPAL_PREFIX PMIX_INSTALL_PREFIX MPI_HOME
# shellcheck source=/dev/null
. "$kit/env.sh"

fail() { echo "gpu-kit-proof: FAIL: $*"; exit 1; }
echo "mpiexec: $(command -v mpiexec)"
[ "$(command -v mpiexec)" = "$kit/usr/bin/mpiexec" ] || fail "mpiexec is not the kit's"
if [ -x /usr/bin/orterun ] && [ -s /usr/bin/orterun ]; then
  [ "${LOCKSTEP_KIT_PROOF_HIDDEN:-0}" = 1 ] && fail "the system's orterun is still visible"
fi
mpiexec --version | head -1

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
rm -rf "$build"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DLOCKSTEP_WITH_CUDA=OFF -DLOCKSTEP_WITH_NCCL=OFF -DLOCKSTEP_WITH_TORCH=OFF \
  -DLOCKSTEP_BUILD_EXAMPLES=OFF -DLOCKSTEP_BUILD_BENCH=OFF -DLOCKSTEP_BUILD_TESTS=ON \
  -DMPI_CXX_COMPILER="$LOCKSTEP_KIT_MPICXX" -DCatch2_DIR="$LOCKSTEP_KIT_CATCH2_DIR" >"$build.configure.log" 2>&1 ||
  { tail -30 "$build.configure.log"; fail "configure"; }
inc=$(sed -n 's/^MPI_CXX_HEADER_DIR:[A-Z]*=//p' "$build/CMakeCache.txt")
libmpi=$(sed -n 's/^MPI_mpi_LIBRARY:[A-Z]*=//p' "$build/CMakeCache.txt")
catch=$(sed -n 's/^Catch2_DIR:[A-Z]*=//p' "$build/CMakeCache.txt")
echo "mpi.h from: $inc"
echo "libmpi from: $libmpi"
echo "Catch2 from: $catch"
case $inc in "$kit"/*) ;; *) fail "mpi.h is not the kit's" ;; esac
case $libmpi in "$kit"/*) ;; *) fail "libmpi is not the kit's" ;; esac
case $catch in "$kit"/*) ;; *) fail "Catch2 is not the kit's" ;; esac
cmake --build "$build" -j "$jobs" --target test_collective >"$build.build.log" 2>&1 ||
  { tail -30 "$build.build.log"; fail "build"; }
echo "libmpi at run time: $(ldd "$build/test/test_collective" | grep libmpi)"
ldd "$build/test/test_collective" | grep -q "$kit/usr/lib/x86_64-linux-gnu/libmpi.so" ||
  fail "the test does not load the kit's libmpi"
export DIST_TEST_MPI=true
timeout 600 mpiexec --bind-to none -n 2 "$build/test/test_collective" >"$build.run.log" 2>&1 ||
  { tail -40 "$build.run.log"; fail "test_collective at 2 ranks"; }
tail -3 "$build.run.log"
echo "gpu-kit-proof: PASS (test_collective, 2 ranks, kit's mpiexec, mpi.h, libmpi and Catch2$([ "${LOCKSTEP_KIT_PROOF_HIDDEN:-0}" = 1 ] && echo ', system Open MPI hidden'))"
