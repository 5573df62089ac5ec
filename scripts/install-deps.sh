#!/usr/bin/env bash
# Installs what Lockstep needs from Debian's packages, and only what is missing (idempotent):
# a second run installs nothing. Uses apt-get directly as root, sudo otherwise, and stops with
# a clear message when neither is possible.
#
# Usage: bash scripts/install-deps.sh [extra-package...]
set -euo pipefail

packages=(
  g++ make cmake                 # compiler and build (CMake >= 3.25: Debian 12's is 3.25.1)
  libopenmpi-dev openmpi-bin     # MPI headers, libraries, mpiexec
  catch2                         # the test framework (v2)
  libopenblas-dev                # BLAS for the examples' matrix products
  clang libclang-rt-14-dev       # the sanitizer and fuzz builds
  "$@"
)

missing=()
for p in "${packages[@]}"; do
  # dpkg -s succeeds for a package that is installed (not merely known or removed).
  if ! dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed'; then
    missing+=("$p")
  fi
done

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
"${apt[@]}" install -y -q "${missing[@]}"
echo "install-deps: done"
