// Internal: fault injection (LOCKSTEP_FAULT, docs/reliability.md), a test seam. It exists only in
// a build with the CMake option LOCKSTEP_FAULT_INJECTION (ON where Lockstep's own tests are
// built, OFF otherwise): the monitor of the mpi layer calls inject_fault() when a collective
// starts. Without it neither this file nor fault.cpp is compiled, the monitor has no fault code,
// and settings.cpp refuses LOCKSTEP_FAULT at initialisation.
#pragma once

#if !LOCKSTEP_FAULT_INJECTION
#error "reliability/fault.hpp belongs to fault injection, which this build leaves out (LOCKSTEP_FAULT_INJECTION=OFF)"
#endif

#include <cstdint>

#include "lockstep/core/tensor.hpp"

namespace lockstep::detail {

enum class FaultKind { none, delay, skip, shape, dtype, nan, kill, no_segment, freeze, freeze_exchange, rescue_delay };

struct FaultSpec {
  FaultKind kind = FaultKind::none;
  int rank = -1;  // kAllRanks: every rank (rank=*, rescue_delay only)
  std::int64_t after = 0;  // the fault hits the collective with this sequence number
  double seconds = 0;
};

inline constexpr int kAllRanks = -2;

/// The fault LOCKSTEP_FAULT asks for (kind none when it is unset); parsed on the first call,
/// throwing InvalidArgument when malformed (the settings read it with the other variables, so
/// that every rank throws it together).
const FaultSpec& fault_spec();

/// Whether rank `rank` must fail to make its shared-memory segment for a reduce buffer
/// (kind=no_segment: every allocate_reduce_buffer of that rank, whatever `after`).
inline bool fault_no_segment(int rank) {
  const FaultSpec& f = fault_spec();
  return f.kind == FaultKind::no_segment && f.rank == rank;
}
/// Seconds rank `rank` holds up its rescue write (kind=rescue_delay; `after` is ignored): the
/// writer thread waits that long before it writes (a disk that stalls, or a host lost in the
/// middle of the write). 0 for any other fault.
inline double fault_rescue_delay(int rank) {
  const FaultSpec& f = fault_spec();
  return f.kind == FaultKind::rescue_delay && (f.rank == rank || f.rank == kAllRanks) ? f.seconds : 0;
}
/// Injects `f` into collective #seq (`what`: its name) that `rank` is entering: sleeps (delay),
/// shortens the view and count (shape), changes the dtype to one of the same size (dtype), writes
/// a NaN into the first element of a floating host view (nan) or ends the process with SIGKILL
/// (kill). Prints a line naming the fault first. Returns false for skip: the rank must not take
/// part in the collective.
bool inject_fault(const FaultSpec& f, int rank, std::int64_t seq, const char* what, TensorView* data,
                  std::int64_t& count);

}  // namespace lockstep::detail
