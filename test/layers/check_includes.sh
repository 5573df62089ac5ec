#!/usr/bin/env bash
# Checks every #include of the library against its layers (docs/architecture.md, "Layers").
# The build already refuses an include of a higher layer (each layer's OBJECT library sees only
# the layers it links, cmake/LockstepLayers.cmake); this check also catches what the compiler
# cannot see: a relative include that climbs out of its folder ("../mpi/monitor.hpp"), a file
# in src/ or include/lockstep/ outside every layer, a path outside the layers' folders
# ("lockstep/backend.hpp", 0.1.0's, removed in 0.4.0) used inside the library, and an umbrella
# header that holds more than includes.
#
# Usage: check_includes.sh ROOT LAYER:BELOW,BELOW... ...   (the layers, as CMake defines them)
#        check_includes.sh --self-test ROOT LAYER:... ...  (plants violations in a copy of the
#        tree and checks that each one is reported)
set -uo pipefail

if [ "${1:-}" = "--self-test" ]; then
  shift
  root=$1; shift
  copy=$(mktemp -d)
  trap 'rm -rf "$copy"' EXIT
  cp -r "$root/src" "$root/include" "$copy/"
  echo '#include "lockstep/io/checkpoint.hpp"' >>"$copy/include/lockstep/train/synchronize.hpp"
  echo '#include "../mpi/monitor.hpp"' >>"$copy/src/train/rules.cpp"
  echo '#include "lockstep/backend.hpp"' >>"$copy/src/comm/backend.cpp"
  echo 'int stray;' >"$copy/src/stray.cpp"
  out=$(bash "$0" "$copy" "$@" 2>&1)
  rc=$?
  printf '%s\n' "$out"
  ok=1
  [ $rc -ne 0 ] || { echo "self-test: the planted tree passed"; ok=0; }
  for want in "train/synchronize.hpp: includes lockstep/io/checkpoint.hpp, of layer io" \
              "train/rules.cpp: ../mpi/monitor.hpp climbs out of its folder" \
              "comm/backend.cpp: lockstep/backend.hpp is no layer's path" \
              "src/stray.cpp is in no layer"; do
    grep -qF -- "$want" <<<"$out" || { echo "self-test: not reported: $want"; ok=0; }
  done
  [ $ok -eq 1 ] && echo "self-test: OK" && exit 0
  exit 1
fi

root=$1; shift
declare -A allowed
layers=()
for spec in "$@"; do
  l=${spec%%:*}
  below=${spec#*:}
  layers+=("$l")
  allowed[$l]=" $l ${below//,/ } "
done
fail=0
report() { echo "$*"; fail=1; }

for f in $(find "$root/src" "$root/include" -type f | sort); do
  rel=${f#"$root"/}
  case $rel in
    src/*/*) layer=${rel#src/}; layer=${layer%%/*} ;;
    include/lockstep/*/*) layer=${rel#include/lockstep/}; layer=${layer%%/*} ;;
    include/lockstep/config.hpp.in) continue ;;
    include/lockstep/lockstep.hpp)
      # The umbrella header: comments, #pragma once, includes only.
      if grep -vE '^[[:space:]]*(//.*)?$|^#pragma once|^#include "lockstep/' "$f" | grep -q .; then
        report "$rel: the umbrella header holds more than includes"
      fi
      continue ;;
    *) report "$rel is in no layer"; continue ;;
  esac
  if [ -z "${allowed[$layer]+x}" ]; then report "$rel is in no layer ($layer is not one)"; continue; fi
  while IFS= read -r inc; do
    case $inc in
      ../*|*/../*) report "$rel: $inc climbs out of its folder"; continue ;;
      lockstep/config.hpp) continue ;;
      lockstep/*/*) target=${inc#lockstep/}; target=${target%%/*} ;;
      lockstep/*) report "$rel: $inc is no layer's path (0.1.0's paths are gone); include the layer's header"; continue ;;
      */*) target=${inc%%/*} ;;
      *) [ -f "$(dirname "$f")/$inc" ] || report "$rel: $inc is not beside it"; continue ;;
    esac
    if [ -z "${allowed[$target]+x}" ]; then
      report "$rel: includes $inc, of no layer"
    elif [[ "${allowed[$layer]}" != *" $target "* ]]; then
      report "$rel: includes $inc, of layer $target, which $layer may not use (it may use:${allowed[$layer]% })"
    fi
  done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]*)".*/\1/p; s/^[[:space:]]*#[[:space:]]*include[[:space:]]*<(lockstep\/[^>]*)>.*/\1/p' "$f")
done

if [ $fail -eq 0 ]; then echo "includes: OK (${layers[*]})"; exit 0; fi
exit 1
