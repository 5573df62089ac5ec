#!/usr/bin/env bash
# Builds the GPU kit: what the bare GPU image lacks to build and run Lockstep's GPU check, in one
# relocatable folder that the `device` tool carries there (an ignored path, well under its
# 64 MiB limit).
#
#   scripts/gpu-kit.sh [KIT_DIR]        (default: gpu-kit in the repository; git-ignored)
#
# Run on a Debian 12 (bookworm) machine with apt-get (this project's build machine). It fetches
# Debian's Open MPI 4.1.4 packages and their libraries with `apt-get download` (no install, no
# root needed for the unpacking), unpacks them with `dpkg -x`, and keeps:
#   - Open MPI: mpiexec (orterun), the mpicxx wrapper, mpi.h, libmpi and the plugins a job on
#     one machine needs (shared memory, TCP). Plugins that need libraries not in the kit
#     (InfiniBand verbs, UCX, libfabric, PSM) are removed, so they are never looked for;
#   - the libraries those need that a bare image may lack: PMIx, hwloc, libevent, libudev,
#     munge, zlib;
#   - Catch2 v2 (the single header catch.hpp and its CMake package files);
#   - the header-only CLI11 (command lines of the examples and benchmarks) and nlohmann-json
#     (checkpoint headers), with their CMake package files;
#   - the reference BLAS with CBLAS (libblas3, 0.5 MB, no dependencies) for the train
#     example's CPU side, where OpenBLAS (30 MB) is not needed.
# Only glibc, libstdc++ and libgcc_s are taken from the machine that uses the kit
# (MANIFEST.txt records the newest glibc symbol version the kit needs).
#
# Open MPI is relocated with OPAL_PREFIX and PMIx with PMIX_INSTALL_PREFIX; KIT_DIR/env.sh sets
# those, PATH and LD_LIBRARY_PATH, and the MCA settings of a one-machine job:
#   . KIT_DIR/env.sh
#   cmake ... -DMPI_CXX_COMPILER="$LOCKSTEP_KIT_MPICXX" -DCatch2_DIR="$LOCKSTEP_KIT_CATCH2_DIR"
# scripts/gpu-kit-proof.sh shows that a build and an np 2 run work from the kit alone.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
kit=${1:-$root/gpu-kit}
# The folder is replaced as a whole: refuse anything that is not a dedicated folder.
case $kit in
  / | "$HOME" | "$root" | "" | .) echo "gpu-kit: refusing to replace $kit; give a new folder" >&2; exit 1 ;;
esac
if [ -e "$kit" ] && [ ! -f "$kit/env.sh" ] && [ -n "$(ls -A "$kit" 2>/dev/null)" ]; then
  echo "gpu-kit: $kit exists and is not a kit (no env.sh): refusing to replace it" >&2
  exit 1
fi
arch=x86_64-linux-gnu

packages=(openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libhwloc15
  libevent-core-2.1-7 libevent-pthreads-2.1-7 libudev1 libmunge2 zlib1g catch2
  libcli11-dev nlohmann-json3-dev libblas3 libblas-dev)

command -v apt-get >/dev/null || { echo "gpu-kit: needs apt-get (Debian 12)" >&2; exit 1; }
command -v dpkg >/dev/null || { echo "gpu-kit: needs dpkg" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/x"
(cd "$work/debs" && apt-get download "${packages[@]}" >"$work/download.log" 2>&1) || {
  cat "$work/download.log" >&2
  echo "gpu-kit: apt-get download failed (run apt-get update first?)" >&2
  exit 1
}
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/x"; done

rm -rf "$kit"
mkdir -p "$kit"
x=$work/x
# Debian 12 has merged /usr, but some packages still unpack into /lib: put everything in usr/.
if [ -d "$x/lib" ]; then
  mkdir -p "$x/usr/lib"
  cp -a "$x/lib/." "$x/usr/lib/"
  rm -rf "${x:?}/lib"
fi
cp -a "$x/usr" "$kit/usr"
[ -d "$x/etc" ] && cp -a "$x/etc" "$kit/etc"

u=$kit/usr
lib=$u/lib/$arch
# Not needed to build or run a C++ MPI program on one machine.
rm -rf "$u/share/doc" "$u/share/man" "$u/share/lintian" "$u/lib/$arch/pkgconfig/ompi-fort.pc" \
  "$u/lib/udev" "$u/share/bug" "$u/sbin" "$u/bin/udevadm" 2>/dev/null || true
rm -f "$lib"/libmpi_java* "$lib"/libmpi_mpifh* "$lib"/libmpi_usempi* "$lib"/liboshmem* \
  "$lib"/libompitrace* "$lib"/openmpi/lib/*.mod "$lib"/openmpi/lib/libmpi_java* \
  "$lib"/openmpi/lib/libmpi_mpifh* "$lib"/openmpi/lib/libmpi_usempi* "$lib"/openmpi/lib/liboshmem* \
  "$lib"/openmpi/lib/mpi.jar "$lib"/*.a "$lib"/openmpi/lib/*.a "$lib"/libsystemd* 2>/dev/null || true
rm -rf "$lib"/openmpi/lib/openmpi3/mca_spml_* "$lib"/openmpi/lib/openmpi3/mca_sshmem_* \
  "$lib"/openmpi/lib/openmpi3/mca_scoll_* "$lib"/openmpi/lib/openmpi3/mca_atomic_* \
  "$lib"/openmpi/lib/openmpi3/mca_memheap_* "$lib"/openmpi/lib/openmpi3/mca_fcoll_* \
  "$lib"/openmpi/lib/openmpi3/mca_fbtl_* "$lib"/openmpi/lib/openmpi3/mca_sharedfp_* \
  "$lib"/openmpi/lib/openmpi3/mca_io_* "$lib"/openmpi/lib/openmpi3/mca_fs_* \
  "$lib"/libmca_common_ompio* "$lib"/openmpi/include/openmpi/ompi/mpi/fortran \
  "$lib"/openmpi/include/*.mod "$lib"/openmpi/lib/openmpi3/*java* 2>/dev/null || true
# The fortran and oshmem wrappers (symlinks to opal_wrapper) and the tools of those parts.
(cd "$u/bin" && rm -f mpif77* mpif90* mpifort* oshcc* oshfort* oshmem_info oshrun shmem* \
  mpijava* mpijavac* ortecc opal_wrapper-fort 2>/dev/null || true)

# Remove, repeatedly, every plugin or library that needs a library neither in the kit nor in
# the base system every Linux image has (glibc, libstdc++, libgcc_s).
base='^(libc|libm|libdl|librt|libpthread|libutil|libresolv|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so'
have() { [ -e "$lib/$1" ] || [ -e "$lib/openmpi/lib/$1" ] || [ -e "$lib/pmix2/lib/$1" ]; }
while :; do
  removed=0
  while IFS= read -r f; do
    while IFS= read -r need; do
      if ! [[ $need =~ $base ]] && ! have "$need"; then
        echo "gpu-kit: dropping ${f#"$kit"/} (needs $need)" >>"$kit/dropped.txt"
        rm -f "$f"
        removed=1
        break
      fi
    done < <(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  done < <(find "$u" -type f \( -name '*.so*' -o -perm -u+x \) -exec sh -c 'head -c4 "$1" | grep -q ELF' _ {} \; -print)
  [ "$removed" -eq 0 ] && break
done

rm -rf "$lib/fortran"   # (libCatch2WithMain.a stays: Catch2Targets.cmake checks it exists)
find "$u" -xtype l -delete   # links to what was removed

# What Debian's alternatives would provide.
ln -sf orterun "$u/bin/mpiexec"
ln -sf orterun "$u/bin/mpirun"
ln -sf opal_wrapper "$u/bin/mpicxx"
ln -sf opal_wrapper "$u/bin/mpic++"
ln -sf opal_wrapper "$u/bin/mpicc"
ln -sf blas/libblas.so.3 "$lib/libblas.so.3"
ln -sf blas/libblas.so.3 "$lib/libblas.so"
ln -sf cblas-netlib.h "$u/include/$arch/cblas.h"

cat >"$kit/env.sh" <<'EOF'
# Sourced (". gpu-kit/env.sh"): puts the kit's Open MPI first and relocates it to this folder.
_kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LOCKSTEP_KIT=$_kit
export OPAL_PREFIX=$_kit/usr
export PMIX_INSTALL_PREFIX=$_kit/usr/lib/x86_64-linux-gnu/pmix2
export PATH=$_kit/usr/bin:$PATH
export LD_LIBRARY_PATH=$_kit/usr/lib/x86_64-linux-gnu:$_kit/usr/lib/x86_64-linux-gnu/openmpi/lib:$_kit/usr/lib/x86_64-linux-gnu/pmix2/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The kit's plugins and help files, not those of an MPI the machine may have elsewhere.
export OMPI_MCA_mca_base_component_path=$_kit/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3
export PMIX_MCA_mca_base_component_path=$_kit/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix
# One machine: shared memory and self; TCP for the runtime only; no network plugins.
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_osc=^ucx OMPI_MCA_plm=isolated
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export LOCKSTEP_KIT_MPIEXEC=$_kit/usr/bin/mpiexec
export LOCKSTEP_KIT_MPICXX=$_kit/usr/bin/mpicxx
export LOCKSTEP_KIT_MPI_H=$_kit/usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h
export LOCKSTEP_KIT_CATCH2_DIR=$_kit/usr/lib/cmake/Catch2
# Everything a configure needs from the kit, for cmake's command line (unquoted: no spaces
# allowed in the kit's path).
export LOCKSTEP_KIT_CMAKE_ARGS="-DMPI_CXX_COMPILER=$_kit/usr/bin/mpicxx -DCatch2_DIR=$_kit/usr/lib/cmake/Catch2 \
-DCLI11_DIR=$_kit/usr/share/cmake/CLI11 -Dnlohmann_json_DIR=$_kit/usr/share/cmake/nlohmann_json \
-DCMAKE_LIBRARY_PATH=$_kit/usr/lib/x86_64-linux-gnu -DCMAKE_INCLUDE_PATH=$_kit/usr/include/x86_64-linux-gnu"
unset _kit
EOF

glibc=$(find "$u" -type f -exec sh -c 'head -c4 "$1" | grep -q ELF' _ {} \; -print0 |
  xargs -0 objdump -T 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -t. -k2,2n -u -V | tail -1)
{
  echo "Lockstep GPU kit, built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "packages:"
  for deb in "$work"/debs/*.deb; do echo "  $(dpkg-deb --show --showformat='${Package} ${Version}' "$deb")"; done
  echo "newest glibc symbol needed: ${glibc:-none}"
  echo "size: $(du -sb "$kit" | cut -f1) bytes"
} >"$kit/MANIFEST.txt"
echo "$glibc" >"$kit/GLIBC_NEEDED"
[ -f "$kit/dropped.txt" ] || : >"$kit/dropped.txt"
cat "$kit/MANIFEST.txt"
echo "gpu-kit: $(du -sh "$kit" | cut -f1) in $kit ($(wc -l <"$kit/dropped.txt") plugins dropped, see dropped.txt)"
