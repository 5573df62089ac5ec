// Node-local collectives through a shared-memory segment, for communicators whose ranks all run
// on one machine. Used by MPIBackend for host-memory allreduce, reduce, reduce_scatter, allgather and
// broadcast; everything else goes through MPI.
//
// Why: between ranks on one machine, Open MPI's allreduce moves data through its shared-memory
// transport in a way that leaves most of the memory bandwidth unused (docs/performance/rounds.md has the
// figures). Here each rank copies a slice of its buffer into its own slot of a shared segment,
// waits until every rank has done the same, and computes the reduction of that slice itself,
// reading every rank's slot in rank order and writing the result straight into its own buffer. The
// copy into the slot uses streaming stores, so the peers read it from memory rather than out of the
// writer's cache, and two slots per rank let the copy of slice k+1 overlap the peers' reading of
// slice k. Every rank sums in the same order, so all ranks get bitwise identical results.
//
// The ranks agree before they choose a path: every blocking allreduce, reduce, reduce_scatter,
// allgather and broadcast on such a communicator, whatever its size, dtype or memory, first
// publishes its call (a CallRecord, agreement.hpp) in its slot; only when every rank published the
// same call does any rank act, and then all of them take the same path (this one, or MPI after
// the header-only exchange). Calls that differ are the same MismatchError on every rank
// (throw_call_mismatch, from every rank's header), before any buffer is written. Every wait
// polls a hook (stall notices, the collective's deadline), so no wait here is unbounded.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/exact_sum_call.hpp"
#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"
#include "mpi/agreement.hpp"
#include "mpi/collective_path.hpp"
#include "mpi/wait_hook.hpp"

namespace lockstep::detail {

/// Copies into a slot as the collectives here do (streaming stores, then a fence): for the
/// collectives defined in other files.
void shm_copy_to_slot(void* dst, const void* src, std::size_t bytes);

class ShmCollectives final : public CollectivePath {
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

  /// Whether allreduce() moves this call's data itself (same answer on every rank for the same
  /// arguments): host memory, f32/f64/i32/i64 (and bf16/f16 for sum and avg, summed in f32), at
  /// least min_bytes().
  bool handles_allreduce(std::int64_t numel, DType dtype, ReduceOp op, bool host) const noexcept;
  /// Whether broadcast() moves this call's data itself (host memory, from one slice up).
  bool handles_broadcast(std::int64_t numel, DType dtype, bool host) const noexcept;

  /// Agrees on the call with every rank, then, if handles_allreduce(), computes recv = op over
  /// ranks of send (send may equal recv: in place; avg divides the sum by the rank count) and
  /// returns true; returns false (on every rank alike) when the caller must run it over MPI.
  /// Throws MismatchError on every rank when the ranks' calls differ.
  bool allreduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, bool host) override;
  /// The same for reduce: root's recv = op over ranks of send (recv unused elsewhere); the
  /// dtypes and sizes of allreduce. Every rank copies its slice into its slot and only root
  /// reads them, so a sharded gradient reduction moves each byte once.
  bool reduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, int root,
              bool host) override;
  /// The same for allgather: recv (size() x numel) = every rank's send in rank order; any dtype,
  /// host memory, from min_bytes() of recv up.
  bool allgather(const void* send, void* recv, std::int64_t numel, DType dtype, bool host) override;
  /// The same for reduce_scatter: recv (numel elements) = op over ranks of block rank() of send
  /// (size() x numel elements); recv may be that very block (in place). The dtypes and ops of
  /// allreduce. Slice by slice, every rank copies the other ranks' blocks of the slice into its
  /// slot and reduces only its own block, reading the slots in rank order: the same sum, bit
  /// for bit, as allreduce's, with each rank doing 1/size() of the arithmetic.
  bool reduce_scatter(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op,
                      bool host) override;
  /// The same for broadcast: buf on every rank = buf on root.
  bool broadcast(void* buf, std::int64_t numel, DType dtype, int root, bool host) override;

  /// Allreduce of host f32 data with a 16-bit wire dtype (bf16 or f16; Backend::allreduce_wire16),
  /// in place, the three passes of a compressed allreduce fused into one: slice by slice, every
  /// rank rounds its f32 values straight into its slot (no 16-bit copy in private memory), then
  /// computes the whole slice itself from every rank's slot in rank order (its own values
  /// rounded again from its buffer, still in cache: the same bits as its slot), summing in f32;
  /// the sum is rounded once to `wire` and written back into buf as f32, divided by the rank
  /// count for avg. Bitwise what the three passes give (round, 16-bit allreduce with sum,
  /// widen and divide), and the same on every rank. op: sum or avg. Returns false (every rank
  /// alike, after agreeing on the call) when the caller must run it another way: no elements,
  /// or fewer bytes than min_bytes().
  bool allreduce_wire16(float* buf, std::int64_t numel, DType wire, ReduceOp op) override;
  /// Whether allreduce_wire16 / reduce_scatter_wire16 (numel: recv's count) move a call's data
  /// themselves (the same answer on every rank for the same call): from one element and
  /// min_bytes() of f32 up.
  bool handles_wire16(std::int64_t numel) const noexcept {
    return numel > 0 && static_cast<std::size_t>(numel) * sizeof(float) >= min_bytes_;
  }
  /// The same for reduce_scatter: recv (numel f32) = op over ranks of block rank() of send
  /// (size() x numel f32), with block rank() of the 16-bit reduce-scatter's rounding; recv may be
  /// that very block. Each rank rounds the other ranks' blocks of the slice into its slot and
  /// reduces its own block: the same bits as allreduce_wire16 of the whole of send.
  bool reduce_scatter_wire16(const float* send, float* recv, std::int64_t numel, DType wire,
                             ReduceOp op) override;

  /// A barrier: the agreement's header-only slice (every rank waits for every peer's header).
  void barrier() override;
  /// Deterministic mode's exact sum of one f32 value per rank (Backend::do_exact_sum,
  /// comm/exact_sum_call.hpp), fused into this path's reduction (shm_exact.cpp): slice by slice
  /// (whole blocks), every rank copies its values into its slot as allreduce does, then reduces
  /// its share of the slice from every rank's slot: each block's top from every rank's values
  /// (unless call.block_top gives the agreed ones), each value folded at its block's window,
  /// the folds summed exactly (no order can change it), converted once to f32 and divided as
  /// the int64 path does, into call.out and after the values in its slot, from which the other
  /// ranks copy it while the next slice is reduced. The same bits as the int64 path, on every
  /// rank. Returns false (every rank alike, after agreeing on the call)
  /// when the caller must run the int64 path: no elements, or slices under one block.
  bool exact_sum(const ExactSumCall& call);
  /// Calls of exact_sum that took this path, so far (what the tests check the path by).
  std::uint64_t exact_sums() const noexcept { return exact_sums_.load(std::memory_order_relaxed); }

  /// Memory every rank of this machine maps (MPIBackend::allocate_reduce_buffer): region
  /// `id` is the `id`-th allocation on this communicator (allocations are collective, so the
  /// same index on every rank), `base[p]` rank p's segment as mapped into this process. The
  /// segments are unmapped when the last shared_ptr goes: the buffer handed to the caller
  /// holds one, the registry only a weak one, so memory may outlive the communicator.
  struct Region {
    std::uint64_t id = 0;
    std::size_t bytes = 0;
    int size = 0;
    char* base[kMaxRanks] = {};
    ~Region();
  };
  /// Creates this rank's segment of `bytes` (zeroed, page-aligned) and writes its name into
  /// `name` (kSegmentNameBytes); nullptr (and an empty name) when it cannot be made. Local.
  static constexpr std::size_t kSegmentNameBytes = 48;
  static char* create_segment(std::size_t bytes, char* name);
  /// Maps the peers' segments named in `names` (size() names of kSegmentNameBytes, in rank
  /// order; this rank's own is `own`, already mapped). Local: the caller exchanged the names and
  /// agrees with the peers on the outcome. nullptr when one cannot be mapped (`own` is then
  /// unmapped too). The region's id is the next one; the caller registers it with add_region
  /// once every rank has mapped everything.
  std::shared_ptr<Region> map_region(char* own, std::size_t bytes, const char* names);
  /// Registers a region mapped on every rank: from now on an in-place allreduce of a buffer at
  /// the same offset of it on every rank reduces the buffers where they lie.
  void add_region(const std::shared_ptr<Region>& region);
  /// In-place allreduces that read the peers' buffers in place (no copy through the slots), so
  /// far: what the tests check the path by.
  std::uint64_t in_place_calls() const noexcept { return in_place_calls_.load(std::memory_order_relaxed); }

  /// Called every few thousand polls of every wait (null: none); it may throw to end the wait.
  /// It must outlive this object.
  void set_wait_hook(WaitHook* hook) noexcept { wait_hook_ = hook; }

  std::size_t slice_bytes() const noexcept { return slice_bytes_; }
  std::size_t min_bytes() const noexcept { return min_bytes_; }

 private:
  ShmCollectives() = default;
  struct Control;
  struct SliceHeader;
  void wait_written(int peer, std::uint64_t k);
  void wait_done_all(std::uint64_t k);
  void spin_until(const std::atomic<std::uint64_t>& a, std::uint64_t v);
  void agree(const SliceHeader& mine, const char* what);
  SliceHeader* header(int peer, std::uint64_t k) const;
  char* slot(int peer, std::uint64_t k) const;
  // Every rank's record of the slice being agreed (this rank's is `mine`).
  std::vector<CallRecord> records(const SliceHeader& mine) const;
  template <class Fill, class Use>
  void run(const SliceHeader& mine, std::size_t total, std::size_t per, const char* what, Fill&& fill,
           Use&& use);
  // run() for the collectives defined in other files (shm_exact.cpp): `record` in the header.
  using SliceFill = std::function<void(char* slot, std::size_t off, std::size_t m)>;
  using SliceUse = std::function<void(std::size_t off, std::size_t m)>;
  void run_call(const CallRecord& record, std::size_t total, std::size_t per, const char* what, const SliceFill& fill,
                const SliceUse& use);

  // The registered region holding [p, p + bytes) on this rank (kept alive by the returned
  // pointer), and p's offset in it; null when none does.
  std::shared_ptr<Region> find_region(const void* p, std::size_t bytes, std::size_t* offset);
  // The in-place allreduce over registered regions: this rank's share of the elements, reduced
  // from every rank's buffer and written into every rank's buffer.
  void reduce_in_place_share(const Region& r, std::size_t offset, std::int64_t numel, DType dtype,
                             ReduceOp op);

  std::mutex regions_mutex_;
  std::vector<std::weak_ptr<Region>> regions_;  // registered, in order of id
  std::atomic<bool> any_region_{false};
  std::uint64_t next_region_ = 0;   // regions allocated so far, the same on every rank
  std::atomic<std::uint64_t> in_place_calls_{0};
  std::atomic<std::uint64_t> exact_sums_{0};
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  int rank_ = 0, size_ = 1;
  // Broadcasts up to this size ride in the agreement slice (see handles_broadcast).
  static constexpr std::size_t kSmallBroadcastBytes = 8192;
  std::size_t slice_bytes_ = 0, min_bytes_ = 0;
  char* base_[kMaxRanks] = {};  // each rank's segment, mapped into this process
  std::uint64_t next_ = 0;      // slices completed so far, the same on every rank
  std::uint64_t calls_ = 0;     // calls so far, the same on every rank
  WaitHook* wait_hook_ = nullptr;
};

}  // namespace lockstep::detail
