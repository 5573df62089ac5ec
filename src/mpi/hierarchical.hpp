// The collectives that know the topology: MPIBackend's path for blocking host allreduce,
// broadcast, reduce-scatter, all-gather and the 16-bit wire's allreduce and reduce-scatter when
// the ranks span two or more machines with the same number of ranks (two or more) on each.
//
// Why: between machines every byte of a flat collective crosses the network, and Open MPI's
// algorithms do not group the ranks by machine. Here each call runs in slices through a two-slot
// pipeline: a shared-memory stage among the ranks of one machine (a ShmCollectives over them)
// and a nonblocking MPI stage among the ranks with the same local rank (one per machine), so
// each machine sends its share over its link once, and the network part of slice k overlaps the
// memory part of slice k+1. docs/architecture/hierarchical.md ("Hierarchical allreduce, broadcast,
// reduce-scatter and all-gather across machines") gives each collective's stages and sum order.
//
// Invariants:
// - The ranks agree before they act. While this object exists, every blocking collective of the
//   backend (reduce and barrier too, which never take this path) first exchanges its call (a
//   CallRecord, agreement.hpp) as a max over the ranks of each field and of its complement (a
//   small MPI allreduce among the ranks of this local rank, then a shared-memory one within the
//   machine): every rank gets the same verdict. Only then is the path chosen, from the agreed
//   call, so no two ranks take two paths; calls that differ are a MismatchError on every rank
//   naming the ranks and their values (throw_call_mismatch), before any buffer is written.
// - Every wait is bounded: the MPI requests are polled with the collective's wait point
//   (deadline, stall notices), and the shared-memory waits poll the same hook.
// - Every MPI request targets memory this object owns (InFlight), never the caller's buffers or
//   the stack; when a call throws with a request pending, that memory is kept for the process.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"
#include "mpi/agreement.hpp"
#include "mpi/collective_path.hpp"
#include "mpi/shm/shm_collectives.hpp"
#include "mpi/wait_hook.hpp"

namespace lockstep::detail {

class CommMonitor;

// A CollectivePath (collective_path.hpp). Of the shared-memory path's waits it is the WaitHook
// (private: only its ShmCollectives calls it).
class HierarchicalCollectives final : public CollectivePath, private WaitHook {
 public:
  /// Collective over `comm`. `node` is this rank's machine (a communicator over its ranks, which
  /// this object takes over and frees). Returns nullptr on every rank alike unless the ranks span
  /// two or more machines, every machine holds the same number of ranks, at least two, and the
  /// shared-memory segment of every machine could be created (and `enabled` on every rank).
  /// `chunk_bytes`: the pipeline's chunk (0: the default, 4 MiB); `min_bytes`: smaller calls go
  /// flat (negative: the default, 64 KiB). `monitor`: the backend's CommMonitor, whose wait
  /// point every wait here polls; it outlives this object.
  static std::unique_ptr<HierarchicalCollectives> create(MPI_Comm comm, MPI_Comm node, bool enabled,
                                                         CommMonitor* monitor, std::size_t chunk_bytes,
                                                         std::int64_t min_bytes);
  ~HierarchicalCollectives();
  HierarchicalCollectives(const HierarchicalCollectives&) = delete;
  HierarchicalCollectives& operator=(const HierarchicalCollectives&) = delete;

  // Every collective below first agrees on the call (see the top of this file). It then returns
  // false, having moved nothing, when the agreed call goes another way (the same answer on every
  // rank; the caller runs it flat): device memory, no elements, fewer than min_bytes(), or a
  // dtype and op it does not take. Otherwise it runs the call here and returns true.

  /// recv = op over the ranks of send (send may equal recv). f32/f64/i32/i64 with any op,
  /// bf16/f16 with sum or avg (16-bit on the network, summed in f32 within a machine). Integer
  /// ops, min and max are bitwise the flat result; floating sums within rounding of it.
  bool allreduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, bool host) override;

  /// Broadcast of buf from `root` (a rank of comm), any dtype: each machine receives the data
  /// once over the network (a flat broadcast's tree may send it to several ranks of a machine).
  bool broadcast(void* buf, std::int64_t numel, DType dtype, int root, bool host) override;

  /// Reduce-scatter (the sharded optimizer's gradient step): recv (`numel` elements) = op over
  /// the ranks of block rank() of send (size() x numel elements); recv may be that very block.
  /// Any placement of the ranks on the machines. Sums each machine's ranks in local rank order,
  /// then the machines in machine order: at two machines bitwise allreduce()'s result. The
  /// dtypes and ops of allreduce(); min_bytes() counts send.
  bool reduce_scatter(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op,
                      bool host) override;
  /// The same with the 16-bit wire on the inter-host part only (op sum or avg; send and recv
  /// f32): each machine's f32 sum is rounded once to `wire`, the machines' values are summed in
  /// 16-bit in machine order (each addition rounded to `wire`) and widened into recv (divided by
  /// size() for avg).
  bool reduce_scatter_wire16(const float* send, float* recv, std::int64_t numel, DType wire,
                             ReduceOp op) override;
  /// Allreduce with the 16-bit wire on the inter-host part only (Backend::allreduce_wire16, the
  /// replicated optimizer's wire_dtype): buf (`numel` f32, host memory) becomes op (sum or avg)
  /// over the ranks, in place. An element's result is reduce_scatter_wire16's for the same data,
  /// bit for bit, at any number of machines (the replicated and sharded steps agree), and the
  /// same bits on every rank. An op other than sum and avg: false, after agreeing (so for
  /// reduce_scatter_wire16).
  bool allreduce_wire16(float* buf, std::int64_t numel, DType wire, ReduceOp op) override;
  /// All-gather (the sharded optimizer's parameter step): recv (size() x numel) = every rank's
  /// send in rank order; send may be block rank() of recv. Any dtype; min_bytes() counts recv.
  /// Bitwise the flat result (nothing is computed).
  bool allgather(const void* send, void* recv, std::int64_t numel, DType dtype, bool host) override;

  /// The agreement alone, for the collectives that never take this path: a rank in one of them
  /// while another is in a call of this path gets MismatchError, on every rank, instead of two
  /// communicators waiting for each other. reduce always returns false (flat MPI); it agrees on
  /// host memory whatever `host` says, since a reduce's memory may differ by rank.
  bool reduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, int root,
              bool host) override;
  void barrier() override;

  int hosts() const noexcept { return hosts_; }
  int ranks_per_host() const noexcept { return local_size_; }
  std::size_t min_bytes() const noexcept { return min_bytes_; }
  std::size_t chunk_bytes() const noexcept { return chunk_bytes_; }

 private:
  HierarchicalCollectives() = default;
  // The node ShmCollectives' waits: the monitor's wait point, then this object's requests.
  void at_wait() override;
  bool drives_progress() const noexcept override { return true; }
  bool handles(std::int64_t numel, DType dtype, ReduceOp op, bool host) const noexcept;
  // Every call's first step (see the top of this file): MismatchError on every rank, naming the
  // ranks and their values (throw_call_mismatch), when the calls differ.
  void agree(const CallRecord& mine, const char* what);
  void wait(MPI_Request* req);
  void progress() noexcept;
  // wire (run, run_reduce_scatter): DType::f32 for the plain form (the dtype is then `dtype`),
  // bf16/f16 for the 16-bit wire between the machines (dtype f32, op sum or avg). block_numel:
  // the elements of each rank's block of a reduce-scatter or all-gather.
  void run(const char* in, char* out, std::size_t total, DType dtype, ReduceOp op, DType wire);
  void run_broadcast(char* buf, std::size_t total, DType dtype, int root);
  void run_reduce_scatter(const char* send, char* recv, std::size_t block_numel, DType dtype, ReduceOp op,
                          DType wire);
  void run_allgather(const char* send, char* recv, std::size_t block_numel, DType dtype);
  // The inter-host reduce-scatter of the reduce-scatter and of the 16-bit allreduce, among the
  // ranks of this local rank, point to point: `pieces` holds hosts() pieces of piece_numel
  // elements of elem_bytes bytes, piece h for machine h. post_exchange sends each other machine
  // its piece and receives this machine's piece from every other (into the slot's inbox;
  // requests in the slot's p2p); fold_exchange waits for them and sums the pieces of this
  // machine in machine order (acc = piece 0, then acc = piece h op acc, MPI_Reduce_local with
  // mpi_dtype and mpi_reduce) into `acc` (nullptr: the inbox's own place, which is free) and
  // returns it.
  void post_exchange(const char* pieces, std::size_t piece_numel, std::size_t elem_bytes, int slot);
  char* fold_exchange(const char* pieces, std::size_t piece_numel, std::size_t elem_bytes, int slot,
                      MPI_Datatype mpi_dtype, MPI_Op mpi_reduce, char* acc);
  // Runs a call's stages; if one throws, what a request still in flight may read or write is
  // kept for the life of the process (abandon) before the exception leaves.
  template <class Stages>
  void guarded(Stages&& stages);
  void abandon() noexcept;
  // Scratch kept between calls (grown, never shrunk).
  static char* scratch(std::vector<char>& v, std::size_t bytes) {
    if (v.size() < bytes) v.resize(bytes);
    return v.data();
  }

  struct InFlight;  // every buffer and request an MPI request of this object may target (.cpp)
  MPI_Comm comm_ = MPI_COMM_NULL, node_ = MPI_COMM_NULL, cross_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, hosts_ = 1;
  std::unique_ptr<ShmCollectives> shm_;  // over node_
  CommMonitor* monitor_ = nullptr;  // the backend's (wait_point, exchange_point)
  std::size_t min_bytes_ = 0, chunk_bytes_ = 0;
  std::uint64_t calls_ = 0;
  std::vector<int> local_of_, host_of_;  // every rank's local rank and machine (its rank in cross_)
  std::vector<int> rank_at_;  // rank_at_[c * local_size_ + j]: the rank of local rank j on machine c
  // Invariant: every MPI request this object starts targets memory in *live_ only (never the
  // caller's buffers, never the stack), and *live_ is freed only when no request is pending;
  // a call that throws with one pending hands it to keep_for_process (a late delivery from a
  // slow host lands in memory nobody else uses).
  std::shared_ptr<InFlight> live_;
  int error_ = MPI_SUCCESS;  // an error a test in the wait hook saw
  bool failed_ = false;      // a call threw with a request pending: the communicators are leaked
};

}  // namespace lockstep::detail
