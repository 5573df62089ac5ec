// Node-local collectives through a shared-memory segment, for communicators whose ranks all run
// on one machine. Used by MPIBackend for large host-memory allreduce and broadcast; everything
// else goes through MPI.
//
// Why: between ranks on one machine, Open MPI's allreduce moves data through its shared-memory
// transport in a way that leaves most of the memory bandwidth unused (2-4.5 GB/s algbw at 2
// ranks on a machine whose memcpy reaches ~20 GB/s; docs/performance.md). Here each rank copies
// a slice of its buffer into its own slot of a shared segment, waits until every rank has done
// the same, and computes the reduction of that slice itself, reading every rank's slot in rank
// order and writing the result straight into its own buffer. Slices are small enough to stay in
// cache, and two slots per rank let the copy of slice k+1 overlap the peers' reading of slice k.
// Every rank sums in the same order, so all ranks get bitwise identical results.
//
// Each slot carries the caller's count, dtype and op; a rank whose call differs from a peer's
// throws MismatchError at the first slice, on every rank, instead of exchanging garbage.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "lockstep/backend.hpp"
#include "lockstep/tensor.hpp"

namespace lockstep::detail {

class ShmCollectives {
 public:
  /// Collective over `comm`; `node_size` is the number of its ranks on this machine (from
  /// MPI_Comm_split_type). Returns nullptr (on every rank) when the ranks are not all on one
  /// machine, when there is only one rank, when there are more than kMaxRanks ranks, when the
  /// segment cannot be created, or when LOCKSTEP_SHM=0 on any rank.
  static std::unique_ptr<ShmCollectives> create(MPI_Comm comm, int node_size);
  ~ShmCollectives();
  ShmCollectives(const ShmCollectives&) = delete;
  ShmCollectives& operator=(const ShmCollectives&) = delete;

  static constexpr int kMaxRanks = 8;

  /// Whether allreduce() handles this call (same answer on every rank for the same arguments).
  bool handles_allreduce(std::int64_t numel, DType dtype, ReduceOp op) const noexcept;
  /// Whether broadcast() handles this call (from one slice up).
  bool handles_broadcast(std::int64_t numel, DType dtype) const noexcept;

  /// recv = op over ranks of send (send may equal recv: in place). avg divides the sum by the
  /// rank count. Host memory only.
  void allreduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op);
  /// buf on every rank = buf on root. Host memory only.
  void broadcast(void* buf, std::int64_t numel, DType dtype, int root);

  std::size_t slice_bytes() const noexcept { return slice_bytes_; }
  std::size_t min_bytes() const noexcept { return min_bytes_; }

 private:
  ShmCollectives() = default;
  struct Control;
  struct SliceHeader;
  void wait_written(int peer, std::uint64_t k);
  void wait_done_all(std::uint64_t k);
  SliceHeader* header(int peer, std::uint64_t k) const;
  char* slot(int peer, std::uint64_t k) const;
  std::string mismatch_message(int peer, const SliceHeader& mine, const char* what) const;
  template <class Fill, class Use>
  void run(const SliceHeader& mine, std::size_t total, std::size_t per, const char* what, Fill&& fill,
           Use&& use);

  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  int rank_ = 0, size_ = 1;
  std::size_t slice_bytes_ = 0, min_bytes_ = 0;
  char* base_[kMaxRanks] = {};  // each rank's segment, mapped into this process
  std::uint64_t next_ = 0;      // slices completed so far, the same on every rank
  std::uint64_t calls_ = 0;     // calls so far, the same on every rank
};

}  // namespace lockstep::detail
