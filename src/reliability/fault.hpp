// Internal: fault injection (LOCKSTEP_FAULT, docs/reliability.md), a test seam that the
// monitor of the mpi layer applies when a collective starts.
#pragma once

#include <cstdint>

#include "lockstep/core/tensor.hpp"

namespace lockstep::detail {

enum class FaultKind { none, delay, skip, shape, dtype, nan, kill };

struct FaultSpec {
  FaultKind kind = FaultKind::none;
  int rank = -1;
  std::int64_t after = 0;  // the fault hits the collective with this sequence number
  double seconds = 0;
};

/// The fault LOCKSTEP_FAULT asks for (kind none when it is unset); parsed on the first call,
/// throwing InvalidArgument when malformed.
const FaultSpec& fault_spec();
/// "delay", "skip", ...
const char* fault_name(FaultKind k);
/// A dtype of the same size, so that an injected dtype fault never reads or writes out of bounds.
DType other_dtype(DType t);
/// Writes a NaN into the first element of a floating host view (integers have none).
void poke_nan(TensorView& v);

}  // namespace lockstep::detail
