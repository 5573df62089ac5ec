// GradientReducer: the bucketed, overlapped gradient reduction behind DistributedOptimizer, for
// code that keeps its own optimizer (LibTorch's torch::optim, a hand-written CUDA trainer).
//
//   std::vector<ls::Tensor> grads = ...;                 // or any traversable structure
//   ls::GradientReducer red(backend, grads);             // collective: ranks must agree
//   for (...) {
//     backward(..., [&](ls::Tensor& g) { red.grad_ready(g); });  // optional: overlap with backward
//     if (red.reduce()) my_optimizer.step(grads);        // grads now hold the average
//   }
//
// Buckets: the trainable (floating-point) gradients, taken from the last one backwards (the
// order backward produces them), are grouped into buckets of at most options.bucket_bytes (a
// tensor larger than that is a bucket of its own, reduced in slices of bucket_bytes, never smaller
// than kMinSliceBytes; dtype or device changes start a new bucket). Bucket 0 holds the last
// tensors. Buckets are launched strictly in index order on every rank, whatever order grad_ready()
// reports come in, so the collectives always match across ranks. A bucket that grad_ready() completes
// starts as nonblocking allreduces (overlapping the rest of backward), or is handed to the
// reducer's communication thread (DistributedOptions::comm_thread); reduce() launches the rest,
// blocking, in order.
// A bucket whose tensors lie back to back in memory is reduced in place (zero copy); otherwise
// it is packed into a staging buffer and unpacked after its reduction. When the ranks span
// machines (Backend::local_size() < size()), a host bucket of several tensors that holds tensors
// of 1 MiB or more reduces each of those where it lies, with calls of its own, and packs only its
// smaller tensors, together, into one call, whatever the memory layout (the calls follow from the
// tensors' sizes alone, so that every rank makes the same ones).
//
// Device (cuda) gradients: buckets of options.device_bucket_bytes (25 MiB), packed and unpacked
// with one copy launch per bucket (DeviceRuntime::copy_many), never sliced; the buckets reduce()
// launches itself go to the backend in one iallreduce_many (NCCLBackend: one NCCL group). The
// gradients are taken as written on the current stream of their device (as PyTorch's DDP takes
// them): the reduction is ordered after that stream, not after the whole device, so a gradient
// written on another stream must be waited for first (an event, or a StreamGuard around the
// backward). At one rank device buckets are not communicated at all (the sum, and the mean, of
// one rank is its gradient). Sharded (shard_optimizer_state), each device bucket is instead
// reduce-scattered through Backend::reduce_scatter (NCCLBackend: ncclReduceScatter), blocking,
// and only this rank's piece is unpacked (one copy launch).
//
// Of DistributedOptions the reducer uses bucket_bytes, op and accumulation_steps; skip_non_finite
// and check_replicas_every act on parameters and rule state, which only an optimizer has
// (DistributedOptimizer, lockstep::torch's DistributedOptimizer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/train/rules.hpp"
#include "lockstep/train/synchronize.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep {

/// Default bucket size in bytes, chosen by measurement on the CI machine (see docs/training.md).
inline constexpr std::size_t kDefaultBucketBytes = std::size_t{1} << 20;
/// Default bucket size of host gradients when the ranks span machines (Backend::local_size() <
/// size()): every collective then crosses a network, where each call pays message round trips
/// that a shared-memory call does not (docs/performance/across-hosts.md, "Across hosts").
inline constexpr std::size_t kDefaultNetworkBucketBytes = std::size_t{16} << 20;
/// Default bucket size of device (cuda) gradients: PyTorch DDP's bucket_cap_mb (25 MiB).
inline constexpr std::size_t kDefaultDeviceBucketBytes = std::size_t{25} << 20;
/// Smallest slice a host tensor larger than bucket_bytes is reduced in: the slice is
/// max(bucket_bytes, kMinSliceBytes), so that a step issues at most one collective per bucket
/// plus one per 64 KiB of gradients whatever bucket_bytes is. (Slices of bucket_bytes = 12 cut a
/// 4 MiB tensor into 349,526 allreduces a step: seconds through shared memory, minutes over MPI.)
inline constexpr std::size_t kMinSliceBytes = std::size_t{64} << 10;

/// Options of DistributedOptimizer and GradientReducer.
struct DistributedOptions {
  /// Largest bucket of host gradients, in bytes (a larger tensor is a bucket of its own, reduced
  /// in slices of bucket_bytes so that each slice's reduction works in cache; slices are never
  /// smaller than kMinSliceBytes). 0: one bucket per tensor, each reduced whole. A value set
  /// is always used as given. Unset (the default), the size follows the path
  /// (host_bucket_bytes): kDefaultBucketBytes (1 MiB, the shared-memory path's best) while every
  /// rank is on one machine, kDefaultNetworkBucketBytes (16 MiB) when the ranks span machines.
  std::optional<std::size_t> bucket_bytes = std::nullopt;
  /// Largest bucket of device (cuda) gradients, in bytes (DDP's 25 MiB by default; a larger
  /// tensor is a bucket of its own, reduced whole). 0: one bucket per tensor. The device
  /// buckets that update() reduces go to the backend together, in one iallreduce_many (one
  /// NCCL group); packing and unpacking a bucket is one copy launch each.
  std::size_t device_bucket_bytes = kDefaultDeviceBucketBytes;
  /// ReduceOp::avg (default: mean over ranks) or ReduceOp::sum.
  ReduceOp op = ReduceOp::avg;
  /// Micro-batches per optimizer step (1: no accumulation).
  int accumulation_steps = 1;
  /// If a gradient holds a NaN or an infinity on any rank, every rank skips the step (the
  /// parameters and the rule's state are left as they were); counted by
  /// DistributedState::skipped_steps(), and the rank it came from logs the tensor. No extra
  /// collective: a NaN or Inf on any rank makes the reduced gradient non-finite on every rank,
  /// so the decision is taken on the reduced values (see docs/reliability.md).
  bool skip_non_finite = false;
  /// Run check_replicas on the model and the optimizer state every K optimizer steps (0: never).
  int check_replicas_every = 0;
  /// Host buckets that ready reports complete during backward are reduced on a communication
  /// thread, with the backend's blocking collectives (MPIBackend: its shared-memory path on one
  /// machine), while backward goes on; false: nonblocking collectives (MPI_Iallreduce), which
  /// Open MPI progresses only when the program calls into it. Used only where the backend allows
  /// collectives from another thread (Backend::concurrent_collectives); any other collective on
  /// the backend first waits for the thread's queue, so every rank keeps one order.
  bool comm_thread = true;
  /// ZeRO stage 1 (DistributedOptimizer only): every bucket is cut into size() contiguous pieces
  /// of numel / size() elements (the last rank's piece also takes the numel % size() left over)
  /// and rank r owns piece r of every bucket: its shard, interleaved by bucket as in FSDP and
  /// llm.c (GradientReducer::shard_ranges). Each bucket's gradients are reduce-scattered (every
  /// rank reduces its own piece, all at once), each rank applies the rule to its shard and keeps
  /// rule state only for it, and each bucket's updated parameters are all-gathered. Needs an
  /// elementwise rule (R::elementwise, true for SGD and Adam) and trainable tensors of one dtype
  /// (f32 or f64) on one device: the CPU, or one cuda device (25 MiB device buckets, each
  /// reduce-scattered and all-gathered through the Backend, NCCLBackend's ncclReduceScatter and
  /// ncclAllGather included; the rule runs on the shard's pieces in one multi-tensor launch).
  /// After update() only this rank's shard of the gradients holds the reduced values.
  bool shard_optimizer_state = false;
  /// With shard_optimizer_state: at the end of every applied step each rank also keeps a copy
  /// of another rank's shard (its parameters and rule state), the buddy copy, so that one lost
  /// host never loses a shard (docs/reliability.md, "Rescue state"). The buddy of a rank is on
  /// another host, from the world's host map (ranks ordered by host, each shard copied to the
  /// rank as many places further on as the largest host has ranks); a host with more than half
  /// of the ranks is an InvalidArgument at setup, and with every rank on one host the copy goes
  /// to the next rank (it then survives a lost rank, not a lost host; rank 0 says so once).
  /// Holds 2/N of the state per rank instead of 1/N (4/N with the exchange's spares); costs one
  /// allgather of one block (the largest shard, in chunks of 4 MiB per rank) per step. write_rescue_state then writes this rank's shard and its buddy's
  /// copy, and resume_freshest assembles the whole state from the survivors' files. Host
  /// (cpu) tensors only.
  bool rescue_buddy = false;
  /// Send f32 gradients as bf16 or f16 (half the bytes), through Backend::allreduce_wire16 and
  /// reduce_scatter_wire16. Each gradient is rounded once into the wire dtype; the sum is
  /// accumulated in f32 where the path allows it (the shared-memory path, where rounding, sum and
  /// widening are one pass; Open MPI's reductions round each partial sum to the wire dtype), and
  /// the division by the number of ranks happens in f32 after the sum: the rule always sees f32.
  /// These collectives are blocking: without the communication thread, buckets are reduced
  /// where they are launched, as sharded ones are. Host f32 gradients only; any other dtype is an
  /// InvalidArgument.
  std::optional<DType> wire_dtype = std::nullopt;
  /// Deterministic mode (docs/training.md, "Deterministic training"): the gradients of every
  /// micro-batch of every rank are summed exactly (an order-independent integer sum), so the
  /// reduced gradient, and the parameters after every step, are the same bits at any number of
  /// ranks, any placement on machines, any bucket size and after any restart. Each rank passes
  /// each of its micro-batches' gradients to accumulate() (any number per rank, zero included)
  /// and ends the step with apply_accumulated() (or update(), which accumulates its own
  /// gradients first); the mean divides by the total number of micro-batches. f32 gradients
  /// (cuda ones are copied to the host for the integer work, and the result back); not with
  /// shard_optimizer_state or wire_dtype (an InvalidArgument at setup on every rank). Costs, per
  /// step over all gradients together, a 2-byte agreement and then: with one micro-batch on
  /// every rank of one machine (MPIBackend's shared-memory path), one pass of the f32 values
  /// through shared memory with the exact sum folded into it; otherwise two collectives (one
  /// byte per 64 elements, then 8 bytes per element). The result is written into the bound
  /// host gradients (in place). Host memory per element: none more for that common step (one
  /// micro-batch per rank, on one machine); 17 bytes once a rank sums several micro-batches
  /// (the exact counters), 4 for a rank's first micro-batch given to accumulate() (its copy), 4
  /// for apply_accumulated's or cuda gradients' result, 8 on the int64 path (its words).
  bool deterministic = false;
};

/// An element range [begin, end) of the flat index space of a reducer's trainable tensors (the
/// tensors in traversal order, back to back).
struct FlatRange {
  std::int64_t begin = 0, end = 0;
};

/// The host bucket size `o` gives on `backend`: o.bucket_bytes where set; unset,
/// kDefaultBucketBytes while every rank is on one machine and kDefaultNetworkBucketBytes when
/// the ranks span machines (Backend::local_size() < size(), the same verdict on every rank).
std::size_t host_bucket_bytes(const DistributedOptions& o, const Backend& backend);

namespace detail {
/// `o` with bucket_bytes set to host_bucket_bytes(o, backend): what the reducer uses, and what
/// the ranks compare at setup (an explicit 1 MiB and the default on one machine agree).
DistributedOptions resolved_options(const DistributedOptions& o, const Backend& backend);

/// What the reducer knows of one trainable gradient.
struct GradLeaf {
  std::int64_t numel = 0;
  DType dtype = DType::f32;
  Device device = Device::cpu();
  Shape shape{};  // empty where only the element count is known
};

/// The problem with these options for these leaves, or "" (checked on every rank before the
/// ranks agree: wire_dtype 16-bit and gradients f32 on the host; sharding needs one float dtype
/// on one device).
std::string check_options(const DistributedOptions& o, const std::vector<GradLeaf>& leaves,
                          const std::vector<std::string>& paths);

/// Signature of a reducer setup, for the cross-rank agreement check at setup: the options and,
/// per trainable leaf in order, its name, dtype, shape (or element count) and device kind
/// (`cpu` or `cuda`: each rank may drive its own GPU). Everything that decides which numbers of
/// one rank meet which of another is in it, so ranks that list the same tensors under other
/// names, in another order, or with other shapes get MismatchError instead of averaging
/// unrelated gradients.
std::string reducer_signature(const DistributedOptions& o, const std::vector<GradLeaf>& leaves,
                              const std::vector<std::string>& names);
/// One leaf as the structure check's explanation names it.
std::string describe_leaf(const GradLeaf& l);
/// The entries the structure check explains a mismatch with: the options, then each leaf.
std::vector<StructureEntry> reducer_entries(const DistributedOptions& o, const std::vector<GradLeaf>& leaves,
                                            const std::vector<std::string>& names);

struct ReducerSteps;
}  // namespace detail

/// The bucketed, overlapped gradient reduction (see the top of this file). Not copyable or
/// movable (backward hooks hold its address); one per set of gradients.
class GradientReducer {
 public:
  /// Collective: a reducer for the trainable tensors of `grads` (any structure Lockstep
  /// traverses: a Tensor, a std::vector, a LOCKSTEP_FIELDS struct...). Every rank must pass the
  /// same structure (names, dtypes, sizes, devices) and options: MismatchError on every rank
  /// naming the first difference otherwise. The tensors are used in place, every step: they
  /// must stay where they are, with the same sizes, while the reducer lives (checked before each
  /// bucket is read).
  template <class G>
  GradientReducer(Backend& backend, G& grads, DistributedOptions options = {},
                  std::source_location loc = std::source_location::current())
      : GradientReducer(backend, trainable_leaves(grads), detail::trainable_paths(grads), options,
                        loc) {}
  /// The same for explicit tensors and their names (as messages and checks name them).
  GradientReducer(Backend& backend, std::vector<Tensor*> grads, std::vector<std::string> names,
                  DistributedOptions options = {},
                  std::source_location loc = std::source_location::current());
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // --- the cycle -------------------------------------------------------------------------------

  /// Reports gradient `g` (one of the reducer's tensors, the same object) as final for this
  /// step: a bucket whose tensors are all final starts reducing at once, in bucket order.
  /// InvalidArgument for a tensor that is not one of them, or one reported twice in a step.
  /// (DistributedState::grad_ready is the same report through an optimizer's state.)
  void grad_ready(const Tensor& g);
  /// The 0.2 names of grad_ready, kept for one release.
  [[deprecated("use grad_ready")]] void ready(const Tensor& g) { grad_ready(g); }
  [[deprecated("use grad_ready")]] void mark_ready(const Tensor& g) { grad_ready(g); }
  /// Launches what grad_ready() did not, waits for everything, and leaves the reduced values in
  /// the gradients; returns true. With accumulation_steps = k, the first k-1 calls of a cycle only
  /// add the gradients into an accumulator (no communication; the gradients are left as they
  /// are) and return false; the k-th reduces the accumulated sum once (divided by k as well as
  /// by the ranks with ReduceOp::avg) and writes it into the gradients. Collective.
  bool reduce();

  // --- what it did ------------------------------------------------------------------------------

  /// Sharded mode (DistributedOptions::shard_optimizer_state): the ranges of the flat index
  /// space of the trainable tensors that `rank` owns, piece `rank` of every bucket, in flat order
  /// (empty pieces left out). Not sharded: the whole space. InvalidArgument for a rank outside
  /// [0, size()).
  std::vector<FlatRange> shard_ranges(int rank) const;
  /// This rank's ranges, and the number of elements in them.
  const std::vector<FlatRange>& shard_ranges() const noexcept;
  std::int64_t shard_numel() const noexcept;
  /// Elements of all trainable tensors together, and where each one starts in the flat space.
  std::int64_t total_numel() const noexcept;
  const std::vector<std::int64_t>& leaf_offsets() const noexcept;

  std::size_t bucket_count() const noexcept;
  /// Number of buckets reduced in place (zero copy) by the last reduction.
  std::size_t zero_copy_buckets() const noexcept;
  /// Number of micro-batches accumulated and not yet reduced.
  int accumulated() const noexcept;
  /// The names of the reducer's gradients, in order.
  const std::vector<std::string>& names() const noexcept;
  Backend& backend() const noexcept;

 private:
  // The step-by-step use by DistributedOptimizer and lockstep::torch, through
  // detail::ReducerSteps (not for users: they call grad_ready and reduce).
  friend struct detail::ReducerSteps;
  // A reducer for gradients of these sizes, set up by an optimizer that has checked that the
  // ranks agree; bound step by step with bind().
  GradientReducer(Backend& backend, const DistributedOptions& options, std::vector<detail::GradLeaf> leaves,
                  std::vector<std::string> paths);
  // Binds this step's gradients (validated against the plan) and arms ready reports.
  void bind(const std::vector<Tensor*>& grads);
  // True if bind() was called with exactly these tensors and the step is not finished.
  bool bound_to(const std::vector<Tensor*>& grads) const noexcept;
  // True if the next reduction completes an optimizer step (not an accumulate-only micro-step).
  bool final_micro_step() const noexcept;
  // Adds the bound gradients into the accumulator (no communication) and unbinds.
  void accumulate();
  // Launches what is not yet in flight, waits for everything and returns the reduced
  // gradients (the bound tensors, or the accumulator's). Unbinds.
  const std::vector<Tensor*>& reduce_bound();
  // Deterministic mode: reduces what accumulate() added on every rank (nothing bound) and
  // returns the reduced gradients (the reducer's own tensors). Collective.
  const std::vector<Tensor*>& reduce_accumulated();
  // Sharded: all-gathers every rank's shard of `params` (tensors of the reducer's sizes, on the
  // reducer's device) into every rank's, one bucket at a time. Nothing when not sharded.
  // Collective.
  void gather_shards(const std::vector<Tensor*>& params);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<Tensor*> own_;  // the gradients of a reducer made from gradients
};

namespace detail {
/// The step-by-step use of a GradientReducer: DistributedOptimizer's setup, update and
/// accumulate, and lockstep::torch. Not for users, who call grad_ready and reduce.
struct ReducerSteps {
  /// A reducer for gradients of these sizes (the caller has checked that the ranks agree).
  static std::unique_ptr<GradientReducer> make(Backend& backend, const DistributedOptions& options,
                                               std::vector<GradLeaf> leaves, std::vector<std::string> paths) {
    return std::unique_ptr<GradientReducer>(new GradientReducer(backend, options, std::move(leaves), std::move(paths)));
  }
  static void bind(GradientReducer& r, const std::vector<Tensor*>& grads) { r.bind(grads); }
  static bool bound_to(const GradientReducer& r, const std::vector<Tensor*>& grads) noexcept {
    return r.bound_to(grads);
  }
  static bool final_micro_step(const GradientReducer& r) noexcept { return r.final_micro_step(); }
  static void accumulate(GradientReducer& r) { r.accumulate(); }
  static const std::vector<Tensor*>& reduce_bound(GradientReducer& r) { return r.reduce_bound(); }
  static const std::vector<Tensor*>& reduce_accumulated(GradientReducer& r) { return r.reduce_accumulated(); }
  static void gather_shards(GradientReducer& r, const std::vector<Tensor*>& params) { r.gather_shards(params); }
};
}  // namespace detail

}  // namespace lockstep
