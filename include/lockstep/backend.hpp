// The Backend interface: the collectives every communication library behind Lockstep provides.
// Training code depends on Backend& only, so MPI and NCCL are interchangeable at run time.
#pragma once

#include <memory>
#include <string>

#include "lockstep/tensor.hpp"

namespace lockstep {

/// Reduction operator. avg is sum followed by division by the number of ranks (floating types only).
enum class ReduceOp : std::uint8_t { sum, prod, min, max, avg };

/// "sum", "prod", ...
const char* name(ReduceOp op) noexcept;

/// Throws InvalidArgument if `op` is not defined for `dtype` (avg on integers, for example).
void check_op_for_dtype(ReduceOp op, DType dtype);

namespace detail {
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
/// (errors there are reported to stderr, never thrown).
class Request {
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
  bool pending() const noexcept { return static_cast<bool>(impl_); }

 private:
  std::unique_ptr<detail::RequestImpl> impl_;
};

/// Abstract communication backend. All collectives are blocking unless named i...; all
/// element counts are in elements of the view's dtype.
class Backend {
 public:
  virtual ~Backend() = default;

  /// "mpi", "nccl".
  virtual std::string name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Rank among the processes on this node, and their number.
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;

  /// Copies root's buffer into every rank's buffer.
  virtual void broadcast(TensorView buf, int root) = 0;
  /// In place: buf becomes the reduction of every rank's buf.
  virtual void allreduce(TensorView buf, ReduceOp op) = 0;
  /// Out of place: recv becomes the reduction of every rank's send (same dtype and numel).
  virtual void allreduce(TensorView send, TensorView recv, ReduceOp op) = 0;
  /// In place on root; other ranks' buf is left unchanged.
  virtual void reduce(TensorView buf, ReduceOp op, int root) = 0;
  /// Out of place; recv is only written on root (other ranks may pass an empty view).
  virtual void reduce(TensorView send, TensorView recv, ReduceOp op, int root) = 0;
  /// recv (numel = size() * send.numel) receives every rank's send, in rank order.
  virtual void allgather(TensorView send, TensorView recv) = 0;
  /// send (numel = size() * recv.numel) is reduced elementwise; rank r receives block r.
  virtual void reduce_scatter(TensorView send, TensorView recv, ReduceOp op) = 0;
  /// Blocks until every rank entered the barrier.
  virtual void barrier() = 0;

  /// Nonblocking in-place allreduce; buf must stay alive and untouched until wait().
  virtual Request iallreduce(TensorView buf, ReduceOp op) = 0;
  /// Nonblocking broadcast.
  virtual Request ibroadcast(TensorView buf, int root) = 0;
};

}  // namespace lockstep
