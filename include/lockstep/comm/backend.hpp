// The Backend interface: the collectives every communication library behind Lockstep provides.
// Training code depends on Backend& only, so MPI and NCCL are interchangeable at run time.
#pragma once

#include <cstdint>
#include <functional>
#include <exception>
#include <memory>
#include <vector>
#include <source_location>
#include <span>
#include <string>

#include "lockstep/core/tensor.hpp"

namespace lockstep {

/// Reduction operator. avg is sum followed by division by the number of ranks (floating types only).
enum class ReduceOp : std::uint8_t { sum, prod, min, max, avg };

/// "sum", "prod", ...
const char* name(ReduceOp op) noexcept;

/// Throws InvalidArgument if `op` is not defined for `dtype` (avg on integers, for example).
void check_op_for_dtype(ReduceOp op, DType dtype);

namespace detail {
class ExactSum;         // deterministic mode's exact sum (internal)
struct ExactSumCall;    // one of its reductions across ranks, as do_exact_sum sees it (internal)
/// What a backend implements for one nonblocking operation.
class RequestImpl {
 public:
  virtual ~RequestImpl() = default;
  /// Blocks until the operation completed, then finishes it (avg scaling, unstaging).
  virtual void wait() = 0;
  /// True once complete (and finished); never blocks.
  virtual bool test() = 0;
};
}  // namespace detail

/// Handle of a nonblocking collective. Move-only; the destructor waits if still pending
/// (errors there are reported to stderr, never thrown). [[nodiscard]]: a Request dropped where
/// it is returned waits at once, which makes the nonblocking call a blocking one.
class [[nodiscard("a dropped Request waits at once in its destructor: keep it, and wait() when the buffer is needed")]] Request {
 public:
  Request() = default;
  explicit Request(std::unique_ptr<detail::RequestImpl> impl) : impl_(std::move(impl)) {}
  Request(Request&&) noexcept = default;
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();

  /// Blocks until the operation completed; the buffer may then be read. Idempotent.
  void wait();
  /// True if the operation completed (then the buffer may be read); never blocks.
  bool test();
  /// True while the request refers to an operation not yet waited for.
  [[nodiscard]] bool pending() const noexcept { return static_cast<bool>(impl_); }
  /// Keeps `owner` (what owns the operation's buffer, e.g. Tensor::owner()) alive until the
  /// operation completes. If its wait or test fails (a deadline, a peer lost), the operation may
  /// still write into the buffer later, so `owner` is then kept for the life of the process: the
  /// memory is never freed under it. Returns *this.
  Request& keep(std::shared_ptr<void> owner);

 private:
  void abandon() noexcept;  // the operation failed while pending: keep the owners for good
  std::unique_ptr<detail::RequestImpl> impl_;
  std::vector<std::shared_ptr<void>> kept_;  // emptied when the request completes
};



class Backend;

/// A reference to a Backend that knows when the backend is gone: get() is the backend while it
/// exists and nullptr once it was destroyed (finalize<B>() destroys the global one; a backend the
/// caller made ends with its scope). For what keeps a backend beyond a call whose end it does not
/// control (autograd's saved state of lockstep::torch::SyncBatchNorm): checked, a use after the
/// end is an error instead of a use of freed memory. A check, not a lock: destroying the backend
/// on another thread while it is in use stays the caller's race.
class BackendRef {
 public:
  BackendRef() = default;
  /// The backend, or nullptr once it was destroyed (or for a default-constructed reference).
  [[nodiscard]] Backend* get() const noexcept {
    const auto alive = alive_.lock();
    return alive ? *alive : nullptr;
  }

 private:
  friend class Backend;
  explicit BackendRef(std::weak_ptr<Backend* const> alive) noexcept : alive_(std::move(alive)) {}
  std::weak_ptr<Backend* const> alive_;
};

/// Abstract communication backend. All collectives are blocking unless named i...; all
/// element counts are in elements of the view's dtype.
///
/// The public collectives are a non-virtual front end (the same for every backend: MPIBackend,
/// NCCLBackend, a user's own): it records the call site (the defaulted `loc`, which fingerprint
/// mismatches, stall reports and MPI errors name), validates the arguments once (roots, counts,
/// dtypes, devices, overlap), makes rank-asymmetric checks agree across ranks (the recv of an
/// out-of-place reduce exists only on root: root's verdict is broadcast before any data moves),
/// and then calls the backend's protected do_* hook. A subclass implements the hooks and may
/// assume valid arguments. When a rank's arguments fail a check that its peers may pass, the
/// front end calls abandon() before throwing, so that a backend can tell its peers (MPIBackend:
/// at a checked call every rank throws the same MismatchError; otherwise the peers are told and
/// the communicator is marked unusable, see docs/reliability.md).
class Backend {
 public:
  Backend() = default;
  /// A copy or a move is another backend: it gets a reference of its own (ref()), and the
  /// references to the source stay the source's.
  Backend(const Backend&) : Backend() {}
  Backend& operator=(const Backend&) noexcept { return *this; }
  virtual ~Backend() = default;

  /// A reference that becomes empty when this backend is destroyed (BackendRef).
  [[nodiscard]] BackendRef ref() const noexcept { return BackendRef(self_); }

  /// "mpi", "nccl".
  [[nodiscard]] virtual std::string name() const = 0;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  /// Rank among the processes on this node, and their number.
  [[nodiscard]] virtual int local_rank() const = 0;
  [[nodiscard]] virtual int local_size() const = 0;
  /// True if collectives may be called from a thread other than the one that created the
  /// backend (one thread at a time). GradientReducer then reduces the buckets that backward
  /// completes on a communication thread of its own (MPIBackend: when MPI provides
  /// MPI_THREAD_MULTIPLE). Default false.
  virtual bool concurrent_collectives() const { return false; }

  using Loc = std::source_location;

  // Roots: every function of the library that takes a root (these, the free collectives,
  // synchronize, the checkpoint functions) defaults it to 0, the rank that drives
  // (rank_zero_only, run_driver), and refuses one outside [0, size()) with an InvalidArgument
  // naming it, before anything is sent.

  /// Copies root's buffer into every rank's buffer.
  void broadcast(TensorView buf, int root = 0, Loc loc = Loc::current());
  /// In place: buf becomes the reduction of every rank's buf.
  void allreduce(TensorView buf, ReduceOp op, Loc loc = Loc::current());
  /// Out of place: recv becomes the reduction of every rank's send (same dtype and numel).
  void allreduce(TensorView send, TensorView recv, ReduceOp op, Loc loc = Loc::current());
  /// In place on root; other ranks' buf is left unchanged. Each rank may call either form of
  /// reduce whatever the others call (both issue the same collectives, verdict broadcast included).
  void reduce(TensorView buf, ReduceOp op, int root = 0, Loc loc = Loc::current());
  /// Out of place; recv is only written on root (other ranks may pass an empty view). Root's
  /// recv is checked on root and the verdict broadcast first (one small broadcast), so a bad
  /// recv is the same InvalidArgument on every rank and no contribution is left in flight.
  void reduce(TensorView send, TensorView recv, ReduceOp op, int root = 0, Loc loc = Loc::current());
  /// recv (numel = size() * send.numel) receives every rank's send, in rank order. In place:
  /// send is this rank's block of recv (any other overlap is an InvalidArgument).
  void allgather(TensorView send, TensorView recv, Loc loc = Loc::current());
  /// send (numel = size() * recv.numel) is reduced elementwise; rank r receives block r. In
  /// place: recv is this rank's block of send; the other blocks of send are then undefined.
  void reduce_scatter(TensorView send, TensorView recv, ReduceOp op, Loc loc = Loc::current());
  /// Blocks until every rank entered the barrier.
  void barrier(Loc loc = Loc::current());

  /// In place, compressed: buf (f32, host memory) becomes op (sum or avg) over every rank's buf,
  /// with the data on the wire in `wire` (bf16 or f16: half the bytes). Every value is rounded
  /// once to `wire`, the values are summed in f32 where the path can (see below), the sum is
  /// rounded once to `wire` and widened back to f32, and divided by size() for avg. The result is
  /// the same on every rank. The default runs three passes: round into a 16-bit buffer,
  /// allreduce it with ReduceOp::sum, widen it into buf with the division; a backend may fuse
  /// them (MPIBackend's shared-memory path does, for the same bits). What a 16-bit sum costs in
  /// precision depends on the backend's 16-bit allreduce: MPIBackend sums in f32 in rank order
  /// on one machine and rounds each partial sum over MPI (docs/training.md, "Scale").
  void allreduce_wire16(TensorView buf, DType wire, ReduceOp op, Loc loc = Loc::current());
  /// reduce_scatter, compressed as allreduce_wire16: send (f32, size() x recv.numel, host)
  /// is rounded to `wire` and reduce-scattered; recv (f32) receives block rank() of the sum,
  /// rounded once and widened (/ size() for avg). In place: recv is this rank's block of send
  /// (the other blocks are then undefined). The default: three passes over a 16-bit copy of send.
  void reduce_scatter_wire16(TensorView send, TensorView recv, DType wire, ReduceOp op, Loc loc = Loc::current());

  /// Nonblocking in-place allreduce; buf must stay alive and untouched until wait().
  Request iallreduce(TensorView buf, ReduceOp op, Loc loc = Loc::current());
  /// Nonblocking broadcast.
  Request ibroadcast(TensorView buf, int root = 0, Loc loc = Loc::current());
  /// Nonblocking in-place allreduce of several buffers (gradient buckets; any dtypes, buffers
  /// that do not overlap), one Request for all: NCCLBackend issues them in one NCCL group
  /// (ncclGroupStart/End), other backends one iallreduce after another in order.
  Request iallreduce_many(std::span<const TensorView> bufs, ReduceOp op, Loc loc = Loc::current());

  /// Collective: `bytes` of zeroed host memory (64-byte aligned) for a buffer that is reduced in
  /// place again and again, such as gradient buckets. Every rank calls it with the same `bytes`,
  /// in the same order (an InvalidArgument on every rank names the sizes when they differ).
  /// MPIBackend with its shared-memory path (every rank on one machine) returns memory that
  /// every rank maps: an in-place allreduce of a buffer at the same offset of such an allocation
  /// on every rank then reads the peers' buffers where they lie, each rank reducing its share of
  /// the elements into every rank's buffer, instead of copying every buffer through the path's
  /// slots (the same bits; about half the memory traffic). Otherwise, and by default, ordinary
  /// memory. The memory lives as long as the returned pointer, which may outlive the backend;
  /// 0 bytes gives an empty pointer.
  [[nodiscard]] std::shared_ptr<void> allocate_reduce_buffer(std::size_t bytes, Loc loc = Loc::current());

 protected:
  // The hooks a backend implements; the front end above has validated the arguments.
  virtual void do_broadcast(TensorView buf, int root) = 0;
  virtual void do_allreduce(TensorView buf, ReduceOp op) = 0;
  /// send and recv do not overlap (the same buffer twice goes to the in-place hook).
  virtual void do_allreduce(TensorView send, TensorView recv, ReduceOp op) = 0;
  virtual void do_reduce(TensorView buf, ReduceOp op, int root) = 0;
  /// recv is empty on ranks other than root.
  virtual void do_reduce(TensorView send, TensorView recv, ReduceOp op, int root) = 0;
  virtual void do_allgather(TensorView send, TensorView recv) = 0;
  virtual void do_reduce_scatter(TensorView send, TensorView recv, ReduceOp op) = 0;
  virtual void do_barrier() = 0;
  virtual Request do_iallreduce(TensorView buf, ReduceOp op) = 0;
  virtual Request do_ibroadcast(TensorView buf, int root) = 0;
  /// The default calls do_iallreduce for each buffer in order and returns one Request that
  /// waits for all of them.
  virtual Request do_iallreduce_many(std::span<const TensorView> bufs, ReduceOp op);
  /// The defaults run the three passes over a 16-bit buffer of this thread (kept for its next
  /// call) with do_allreduce / do_reduce_scatter and ReduceOp::sum. buf, send and recv are f32
  /// host views, wire is bf16 or f16, op sum or avg (checked by the front end).
  virtual void do_allreduce_wire16(TensorView buf, DType wire, ReduceOp op);
  virtual void do_reduce_scatter_wire16(TensorView send, TensorView recv, DType wire, ReduceOp op);
  /// `bytes` > 0, the same on every rank (checked by the front end). The default: ordinary
  /// zeroed memory, 64-byte aligned.
  virtual std::shared_ptr<void> do_allocate_reduce_buffer(std::size_t bytes);
  /// Deterministic mode's exact sum of one value per rank (DistributedOptions::deterministic;
  /// internal: called by the exact sum only, once every rank agreed that every rank takes this
  /// form). Collective. A backend that can fold the values into its own reduction does so and
  /// returns true, having written the result, the same bits as the exact sum's int64 path; it
  /// returns false, on every rank alike and before anything is written, when it has no such path
  /// for the call, and the caller then runs the int64 path. The default returns false.
  virtual bool do_exact_sum(const detail::ExactSumCall& call);
  friend class detail::ExactSum;

  /// What a collective is, for abandon(): the operation's name and what must agree.
  struct CallInfo {
    const char* op;        ///< "allreduce", "broadcast", ...
    std::int64_t count;    ///< element count
    int dtype;             ///< static_cast<int>(DType), -1 if none
    int reduce_op;         ///< static_cast<int>(ReduceOp), -1 if none
    int root;              ///< -1 if none
  };
  /// Called by the front end on a rank whose arguments failed a check, before the error is
  /// thrown. May throw an error of its own instead (for example the MismatchError every rank
  /// throws at a checked call). The default does nothing.
  virtual void abandon(const CallInfo& call, const std::exception& error);
  /// For a backend that forwards to another one (a wrapper): passes a refusal on to `inner`, so
  /// that the ranks of inner's communicator are told. A wrapper overrides abandon() to call it.
  static void forward_abandon(Backend& inner, const CallInfo& call, const std::exception& error) {
    inner.abandon(call, error);
  }
  /// Throws lockstep::Error if this backend cannot be used (for example a moved-from one). The
  /// default does nothing.
  virtual void check_usable() const {}

 private:
  // Owned by this object alone (a copy or a move makes its own), so that the references ref()
  // gives expire exactly when it is destroyed.
  std::shared_ptr<Backend* const> self_ = std::make_shared<Backend* const>(this);
};

}  // namespace lockstep
