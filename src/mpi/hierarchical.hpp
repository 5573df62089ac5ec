// Collectives that know the topology: for communicators whose ranks span several machines with
// the same number of ranks (two or more) on each. Used by MPIBackend for blocking host allreduce,
// broadcast, reduce-scatter, all-gather and the 16-bit wire's allreduce and reduce-scatter (the
// others below; the allreduce described here).
//
// The 16-bit wire allreduce (allreduce_wire16) runs the same three stages with f32 in shared
// memory and 16-bit values only between the machines (below).
//
// Why: between machines every byte of a flat allreduce goes over the network, and Open MPI's
// algorithms do not tell the ranks on one machine apart from the others. Here a call runs in three
// stages, chunk by chunk:
//   1. node-local reduce-scatter through shared memory (a ShmCollectives over the ranks of this
//      machine): local rank j ends with the machine's sum of block j of the chunk;
//   2. inter-host allreduce of that block among the ranks with the same local rank (one rank per
//      machine, a communicator split by local rank), nonblocking, over the network;
//   3. node-local all-gather through shared memory of the finished blocks.
// Each machine then sends 1/L of the data per rank (L ranks per machine) over the network instead
// of all of it, and the network part of chunk k overlaps the shared-memory reduce-scatter of
// chunk k+1 (the wait hook of the node's ShmCollectives tests the pending request while it waits).
//
// The ranks agree before they act: while this object exists, every blocking collective of the
// backend (those that may take this path, and reduce and barrier, which never do) first
// exchanges its call (call number, count, dtype, op or root, memory) with every rank, as a max
// over the ranks of the fields and of their complements (one small MPI allreduce among the
// ranks of this local rank, then one shared-memory allreduce among the ranks of this machine:
// every rank ends with the same global verdict). Only then is the path chosen, from the agreed
// fields: a call whose size is above the threshold on one rank and below it on another is a
// MismatchError on every rank naming the ranks and their values, never ranks on two paths. Every
// wait is bounded: the MPI requests are polled with the collective's wait point (deadline, stall
// notices), the shared-memory waits poll the same hook. Every MPI request targets memory this
// object owns (InFlight), kept for the process when a call throws with a request pending.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"
#include "mpi/shm/shm_collectives.hpp"

namespace lockstep::detail {

class HierarchicalAllreduce {
 public:
  /// How the backend reduces over MPI and divides for avg (its own helpers).
  struct MpiOps {
    MPI_Datatype (*type)(DType);
    MPI_Op (*op)(ReduceOp, DType);
    void (*scale)(TensorView, int);  // divides every element by n (host memory)
  };

  /// Collective over `comm`. `node` is this rank's machine (a communicator over its ranks, which
  /// this object takes over and frees). Returns nullptr on every rank alike unless the ranks span
  /// two or more machines, every machine holds the same number of ranks, at least two, and the
  /// shared-memory segment of every machine could be created (and `enabled` on every rank).
  /// `chunk_bytes`: the pipeline's chunk (0: the default, 4 MiB); `min_bytes`: smaller calls go
  /// flat (negative: the default, 64 KiB). `monitor`: the backend's CommMonitor (wait_point).
  static std::unique_ptr<HierarchicalAllreduce> create(MPI_Comm comm, MPI_Comm node, bool enabled, MpiOps ops,
                                                       void* monitor, std::size_t chunk_bytes, std::int64_t min_bytes);
  ~HierarchicalAllreduce();
  HierarchicalAllreduce(const HierarchicalAllreduce&) = delete;
  HierarchicalAllreduce& operator=(const HierarchicalAllreduce&) = delete;

  /// Agrees on the call with every rank (MismatchError on every rank when the calls differ), then
  /// returns false, having moved nothing, when the call goes over the flat communicator (decided
  /// from the agreed fields, so the same answer on every rank): dtypes other than f32/f64/i32/i64
  /// (bf16/f16 with sum or avg only), device memory, no elements, fewer than min_bytes().
  /// Otherwise computes recv = op over ranks of send (send may equal recv) and returns true.
  bool allreduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, bool host);

  /// Broadcast of buf from `root` (a rank of comm) the same way: the call is agreed as above
  /// (count, dtype, root, memory, call number), then, chunk by chunk, the rank on the root's
  /// machine with the root's local rank sends the chunk once to each other machine (MPI_Ibcast
  /// among the ranks with that local rank), and each machine spreads it through shared memory,
  /// while the next chunk crosses the network. Each machine receives the data once over the
  /// network, as the link bound allows, where a flat broadcast's tree may send it to several
  /// ranks of one machine. Returns false after the agreement, having moved nothing, for the calls
  /// allreduce() sends flat (device memory, no elements, fewer than min_bytes()); any dtype.
  bool broadcast(void* buf, std::int64_t numel, DType dtype, int root, bool host);

  /// Reduce-scatter (the sharded optimizer's gradient step): recv (`numel` elements) = op over
  /// the ranks of block rank() of send (size() x numel elements); recv may be that very block (in
  /// place). Slice by slice (a slice is the same part of every rank's block, about chunk_bytes()
  /// of send in all): (1) each rank copies the slice of every block into a scratch ordered by
  /// the owner's local rank, then by its machine, and a node-local reduce-scatter through shared
  /// memory leaves local rank j with its machine's sum of the slice of every block owned by a
  /// rank of local rank j; (2) among the ranks of local rank j (one per machine), point to
  /// point and nonblocking, each sends every other its piece of those sums and sums the pieces
  /// it receives (in machine order, MPI_Reduce_local) into its own block's slice in recv, while
  /// the next slice runs its stage 1. Each machine sends (H-1)/H of the buffer over its link, once,
  /// where a flat ring over all N ranks sends (N-1)/N of it across each machine boundary. Any
  /// placement of the ranks on the machines (the copy reorders). The sum's order: each
  /// machine sums its ranks in local rank order (the shared-memory reduce-scatter's order, as the
  /// hierarchical allreduce), then the machines in machine order: at two machines bitwise the
  /// hierarchical allreduce's result, and within float rounding of the flat path's. The dtypes,
  /// ops and sizes of allreduce() (size: of send); false, having done nothing, otherwise.
  bool reduce_scatter(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, bool host);
  /// The same with a 16-bit wire on the inter-host part only (op: sum or avg; send and recv f32):
  /// the node-local sums stay f32; each machine's sum of a slice is rounded once to `wire`, the
  /// machines' values are summed in 16-bit (the backend's operator: each addition rounded to
  /// `wire`), and the
  /// result is widened into recv (divided by size() for avg). False for calls allreduce() would
  /// send flat by size.
  bool reduce_scatter_wire16(const float* send, float* recv, std::int64_t numel, DType wire, ReduceOp op);
  /// It agrees first, like every call, and returns false after the agreement for calls below
  /// one element or min_bytes() of send (the caller then runs them another way).
  /// Allreduce with the 16-bit wire on the inter-host part only (Backend::allreduce_wire16, the
  /// replicated optimizer's wire_dtype): buf (`numel` f32, host memory) becomes op (sum or avg)
  /// over the ranks of buf, in place. Chunk by chunk (about chunk_bytes() of buf, a multiple of
  /// size() elements): (1) a node-local reduce-scatter in f32 through shared memory leaves local
  /// rank j with its machine's f32 sum of block j of the chunk, which it rounds once to `wire`;
  /// (2) among the ranks of local rank j (one per machine), the 16-bit block is reduce-scattered
  /// point to point as reduce_scatter_wire16's pieces are (each machine's rank sends every
  /// other the piece it owns and sums the H pieces of its own in machine order with the
  /// backend's 16-bit operator, each addition rounded to `wire`), then all-gathered
  /// (MPI_Iallgather), still 16-bit; (3) the block is widened (divided by size() for avg) and
  /// a node-local all-gather in f32 through shared memory gives every rank of the machine the
  /// whole chunk. Chunk k+1's stage 1 runs while chunk k's pieces cross the network. The result
  /// of an element: its machines' f32 sums (local rank order), each rounded once, summed in
  /// 16-bit in machine order: the same bits on every rank, and bitwise reduce_scatter_wire16's
  /// block of the same data at any number of machines. The call is agreed like the others
  /// (MismatchError on every rank); false after the agreement, having moved nothing, for calls
  /// below min_bytes() (the caller runs them another way), and for an op other than sum and avg.
  bool allreduce_wire16(float* buf, std::int64_t numel, DType wire, ReduceOp op);
  /// All-gather (the sharded optimizer's parameter step): recv (size() x numel) = every rank's
  /// send in rank order; send may be block rank() of recv (in place). Slice by slice: (1) a
  /// nonblocking MPI all-gather among the ranks of this local rank (one per machine) of the
  /// slice of send, (2) a node-local all-gather through shared memory of what those brought,
  /// copied to its places in recv, while the next slice crosses the network. Each rank's bytes
  /// cross to each other machine once. Any dtype; host memory; from min_bytes() of recv; false,
  /// having done nothing, otherwise. Bitwise the flat result (nothing is computed).
  bool allgather(const void* send, void* recv, std::int64_t numel, DType dtype, bool host);

  /// The agreement alone, for the collectives that never take this path (reduce, barrier): a
  /// rank in one of them while another is in a call of this path gets MismatchError, on every
  /// rank, instead of two communicators waiting for each other.
  void agree_reduce(std::int64_t numel, DType dtype, ReduceOp op, int root, bool host);
  void agree_barrier();

  int hosts() const noexcept { return hosts_; }
  int ranks_per_host() const noexcept { return local_size_; }
  std::size_t min_bytes() const noexcept { return min_bytes_; }
  std::size_t chunk_bytes() const noexcept { return chunk_bytes_; }

  /// Called by the node ShmCollectives' waits (set as its wait hook).
  static void hook(void* self);

 private:
  HierarchicalAllreduce() = default;
  bool handles(std::int64_t numel, DType dtype, ReduceOp op, bool host) const noexcept;
  // Every call's first step (see the top of this file). what: the collective; arg: its tag with
  // the op or the root (arg_name says which). MismatchError on every rank, naming the ranks and
  // their values, when the calls differ.
  void agree(const char* what, std::int64_t numel, DType dtype, std::int64_t arg, const char* arg_name, bool host);
  void wait(MPI_Request* req);
  void progress() noexcept;
  // wire (run, run_reduce_scatter): DType::f32 for the plain form (the dtype is then `dtype`),
  // bf16/f16 for the 16-bit wire between the machines (dtype f32, op sum or avg).
  void run(const char* in, char* out, std::size_t n, DType dtype, ReduceOp op, DType wire);
  void run_broadcast(char* buf, std::size_t n, DType dtype, int root);
  void run_reduce_scatter(const char* send, char* recv, std::size_t q, DType dtype, ReduceOp op, DType wire);
  void run_allgather(const char* send, char* recv, std::size_t q, DType dtype);
  // The inter-host reduce-scatter of the reduce-scatter and of the 16-bit allreduce, among the
  // ranks of this local rank, point to point: `pieces` holds H pieces of c elements of `ps`
  // bytes, piece h for machine h. post_exchange sends each other machine its piece and receives
  // this machine's piece from every other (into the slot's inbox; requests in the slot's p2p);
  // fold_exchange waits for them and sums the H pieces of this machine in machine order
  // (acc = piece 0, then acc = piece h op acc, MPI_Reduce_local with dt and mop) into `acc`
  // (nullptr: the inbox's own place, which is free) and returns it.
  void post_exchange(const char* pieces, std::size_t c, std::size_t ps, int slot);
  char* fold_exchange(const char* pieces, std::size_t c, std::size_t ps, int slot, MPI_Datatype dt, MPI_Op mop,
                      char* acc);
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
  MpiOps ops_{};
  void* monitor_ = nullptr;  // the backend's CommMonitor (wait_point)
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
