// Internal to the mpi layer: the call agreement of the shared-memory and hierarchical paths, one
// record and one report. Before either path moves a byte, every rank learns that every rank made
// the same call, and only then is a path chosen from the agreed call, so no two ranks ever take
// two paths. The shared-memory path compares the records in the slice headers its peers publish;
// the hierarchical path exchanges them as a max over the ranks of each field and of its
// complement (agreement_encode / agreement_holds, the encoding the monitor's fingerprints use
// too). Either way, a disagreement is seen by every rank alike, and throw_mismatch (the monitor's
// fingerprints and, through throw_call_mismatch, the paths' records) turns it into the same
// MismatchError on every rank, naming the ranks and their values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep::detail {

/// The collectives the paths tell apart (a value of CallRecord::kind).
enum class CallKind : std::uint32_t {
  allreduce = 1,
  broadcast = 2,
  reduce = 3,
  allgather = 4,
  reduce_scatter = 5,
  allreduce_wire16 = 6,  // f32 data, 16-bit between the ranks: dtype is the wire dtype
  reduce_scatter_wire16 = 7,
  barrier = 8,
  exact_sum = 9,  // deterministic mode's exact sum of f32 values (Backend::do_exact_sum), op sum or avg
};

/// One call as the ranks agree on it. Trivially copyable and 40 bytes: it rides in a shared-memory
/// slice header and in an MPI exchange as bytes.
struct CallRecord {
  std::uint64_t call = 0;  // calls so far on this path's communicator (the same on every rank)
  std::int64_t numel = 0;  // the caller's element count (recv's for reduce-scatter)
  std::uint32_t kind = 0;  // CallKind
  std::uint32_t dtype = 0;  // DType
  std::int32_t op = -1;     // ReduceOp; -1: none (broadcast, allgather, barrier)
  std::int32_t root = -1;   // broadcast's and reduce's root; -1: none
  std::uint32_t host = 1;   // 1: host memory; 0: device memory
  std::uint32_t unused = 0;

  static constexpr int kFields = 7;
  /// Field i as an integer (the order of kCallFieldNames in agreement.cpp), for the max-and-complement exchange.
  std::int64_t field(int i) const noexcept;
  bool same_call(const CallRecord& other) const noexcept;
};

/// A record of `kind` with dtype, count and the rest.
CallRecord call_record(std::uint64_t call, CallKind kind, std::int64_t numel, DType dtype, int op, int root,
                       bool host) noexcept;

/// "allreduce of 16384 f32 elements with op sum", "allreduce_wire16 of 16384 f32 elements sent as
/// bf16 with op avg", "broadcast of 3 u8 elements from root 1 in device memory".
std::string describe(const CallRecord& r);

/// The max-and-complement encoding of n integer fields into buf[2n]: after an MPI_MAX allreduce
/// (or a shared-memory max) of buf over the ranks, agreement_holds says whether every rank had
/// the same value in every field (max x == ~max ~x exactly when min x == max x). The verdict is
/// the same on every rank.
void agreement_encode(const std::int64_t* fields, int n, std::int64_t* buf) noexcept;
bool agreement_holds(const std::int64_t* buf, int n) noexcept;
/// The same for a CallRecord (buf: 2 * CallRecord::kFields).
void agreement_encode(const CallRecord& r, std::int64_t* buf) noexcept;

/// A disagreement every rank saw alike, in the terms of whoever found it (the monitor's
/// fingerprints, a path's CallRecords): `values[r]` is rank r's value of each compared field,
/// `called[r]` what rank r called, in words; both the same vectors on every rank.
struct Disagreement {
  std::string head;                               // what the message starts with
  std::vector<const char*> field_names;           // the compared fields, in order
  std::string (*show)(int field, std::int64_t value) = nullptr;  // a field's value in words
  std::vector<std::vector<std::int64_t>> values;  // by rank, then by field
  std::vector<std::string> called;                // by rank
  std::string tail;                               // what became of the data; who reports it
};

/// The one place a disagreement becomes a MismatchError: the fields that differ, each with the
/// ranks holding each value; what each rank called, one line a rank; the odd ranks out where a
/// strict majority made one call. Every rank throws the same text but for what `tail` says.
[[noreturn]] void throw_mismatch(const Disagreement& d);

/// A path's disagreement: `by_rank[r]` is rank r's record (the same vector on every
/// rank), `rank` this rank, `what` the collective this rank called, `found_by` the path whose
/// agreement saw it; through throw_mismatch.
[[noreturn]] void throw_call_mismatch(const char* what, const std::vector<CallRecord>& by_rank, int rank,
                                      const char* found_by);

}  // namespace lockstep::detail
