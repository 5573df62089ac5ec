#!/usr/bin/env bash
# Installs what Lockstep needs from Debian's packages, and only what is missing (idempotent):
# a second run installs nothing. Uses apt-get directly as root, sudo otherwise, and stops with
# a clear message when neither is possible.
#
# Usage: bash scripts/install-deps.sh [extra-package...]
# Extra packages (scripts/run-main.sh and scripts/test.sh ask for gnuplot-nox, which draws the
# loss plot) come without their recommended packages: gnuplot-nox's would bring ImageMagick and
# Ghostscript. scripts/test.sh (stage deps) also asks for slurmctld slurmd slurm-client munge,
# for the Slurm cluster of stage multihost (scripts/cluster.sh up --slurm): their dependencies
# (slurm-wlm-basic-plugins, with the pmix plugin) are enough, and Slurm's PMIx plugin finds
# libpmix through libopenmpi-dev's libpmix-dev. On a machine with systemd, installing them
# enables Debian's munge, slurmd and slurmctld services, which cluster.sh does not use.
set -euo pipefail

base=(
  g++ make cmake                 # compiler and build (CMake >= 3.25: Debian 12's is 3.25.1)
  libopenmpi-dev openmpi-bin     # MPI headers, libraries, mpiexec
  catch2                         # the test framework (v2)
  libopenblas-dev                # BLAS for the examples' matrix products
  libcli11-dev                   # command lines of the examples and benchmarks (CLI11 2.1)
  nlohmann-json3-dev             # JSON: the checkpoint reader's header parser, the benchmarks' files
  clang libclang-rt-14-dev       # the sanitizer and fuzz builds
)
extra=("$@")
packages=("${base[@]}" "${extra[@]}")

# is_installed P: dpkg -s succeeds for a package that is installed (not merely known or removed).
is_installed() { dpkg -s "$1" 2>/dev/null | grep -q '^Status: install ok installed'; }
missing=() missing_base=() missing_extra=()
for p in "${base[@]}"; do
  is_installed "$p" || missing_base+=("$p")
done
for p in "${extra[@]}"; do
  is_installed "$p" || missing_extra+=("$p")
done
missing=("${missing_base[@]}" "${missing_extra[@]}")

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages already installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  apt=(apt-get)
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  apt=(sudo apt-get)
elif command -v sudo >/dev/null 2>&1; then
  echo "install-deps: sudo will ask for your password to run apt-get"
  apt=(sudo apt-get)
else
  echo "install-deps: these Debian packages are missing: ${missing[*]}" >&2
  echo "install-deps: run this script as root, or install sudo, or install them yourself:" >&2
  echo "  apt-get install -y ${missing[*]}" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
"${apt[@]}" update -q
if [ ${#missing_base[@]} -gt 0 ]; then
  "${apt[@]}" install -y -q "${missing_base[@]}"
fi
if [ ${#missing_extra[@]} -gt 0 ]; then
  "${apt[@]}" install -y -q --no-install-recommends "${missing_extra[@]}"
fi
echo "install-deps: done"
