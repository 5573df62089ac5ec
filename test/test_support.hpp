// Test support shared by the tests of every layer (and the scenario programs that run_trust.sh
// drives): the global MPI backend, a pass flag combined across ranks, an exception's kind and
// text as a string (so that a rank records it and goes on to the next collective instead of
// stopping between two), and a Backend that forwards to another one, as a user's own Backend
// subclass would.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "lockstep/lockstep.hpp"

namespace lstest {

namespace ls = lockstep;

/// The global MPIBackend, initialised on first use.
inline ls::MPIBackend& world_backend() {
  ls::initialize<ls::MPIBackend>();
  return ls::get_distributed_backend<ls::MPIBackend>();
}

/// True on every rank if `ok` is true on every rank (collective; use instead of REQUIRE between
/// collectives).
inline bool all_ranks(ls::Backend& b, bool ok) {
  std::int32_t v = ok ? 1 : 0;
  b.allreduce(ls::TensorView{&v, 1, ls::DType::i32, ls::Device::cpu()}, ls::ReduceOp::min);
  return v == 1;
}

/// True on every rank of MPI_COMM_WORLD when the bytes hash alike on every rank (FNV-1a; the
/// MIN and the MAX of the hashes agreed). Collective.
inline bool same_on_every_rank(const void* p, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  std::uint64_t lo = h, hi = h;
  MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

/// "TimeoutError", "MismatchError", ... for an exception of Lockstep (the most derived class
/// among them), "std::exception" otherwise.
inline const char* error_kind(const std::exception& e) {
  if (dynamic_cast<const ls::TimeoutError*>(&e)) return "TimeoutError";
  if (dynamic_cast<const ls::MismatchError*>(&e)) return "MismatchError";
  if (dynamic_cast<const ls::InvalidArgument*>(&e)) return "InvalidArgument";
  if (dynamic_cast<const ls::MpiError*>(&e)) return "MpiError";
  if (dynamic_cast<const ls::Error*>(&e)) return "Error";
  return "std::exception";
}

/// Runs f: the message of the E it threw, or nullopt if it threw none (another exception goes
/// on).
template <class E, class F>
std::optional<std::string> caught(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

/// Runs f: "ok: <what>" if it threw an E, "wrong exception: <what>" for another exception,
/// "no exception" otherwise.
template <class E, class F>
std::string expect_throw(F&& f) {
  try {
    if (auto m = caught<E>(std::forward<F>(f))) return "ok: " + *m;
  } catch (const std::exception& e) {
    return std::string("wrong exception: ") + e.what();
  }
  return "no exception";
}

/// The message of the E that f throws, or "" if it throws none (another exception goes on).
template <class E, class F>
std::string error_message(F&& f) {
  return caught<E>(std::forward<F>(f)).value_or("");
}

/// What a call that the ranks must refuse did to its buffer: `call(x)` on x, count + 1 floats
/// holding rank * 1000 + i % 1000; whether it threw MismatchError, its text, and how many
/// elements of x changed (none may: the disagreement is seen before anything is written).
struct Refusal {
  bool threw = false;
  std::string text;
  std::int64_t changed = 0;
};
template <class Call>
Refusal refusal_on_marked_buffer(int rank, std::int64_t count, Call&& call) {
  ls::Tensor x(ls::Shape{count + 1});
  auto mark = [rank](std::int64_t i) { return static_cast<float>(rank * 1000 + i % 1000); };
  for (std::int64_t i = 0; i <= count; ++i) x.data<float>()[i] = mark(i);
  Refusal r;
  if (auto m = caught<ls::MismatchError>([&] { call(x); })) {
    r.threw = true;
    r.text = *m;
  }
  for (std::int64_t i = 0; i <= count; ++i) r.changed += x.data<float>()[i] == mark(i) ? 0 : 1;
  return r;
}

/// Whether s contains part.
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// x = std::move(x) through a reference, so that the compiler sees no self-move to warn about.
template <class T>
void self_move(T& x) {
  T& alias = x;
  x = std::move(alias);
}

/// Whether an expect_throw() result is the expected exception.
inline bool is_ok(const std::string& s) { return s.rfind("ok: ", 0) == 0; }

/// Runs f: "no exception", or "exception: <what>".
template <class F>
std::string outcome(F&& f) {
  const auto m = caught<std::exception>(std::forward<F>(f));
  return m ? "exception: " + *m : "no exception";
}

/// A user's Backend over another one: every collective goes through this backend's front end
/// (its checks and call sites), then on_call(), then the inner backend's front end. Derived
/// classes count calls in on_call() or override a hook; a refusal by this front end is not
/// forwarded unless a derived class overrides abandon() (with forward_abandon, as a wrapper
/// should).
class ForwardingBackend : public ls::Backend {
 public:
  /// The collectives on_call() tells apart.
  enum class Call { broadcast, allreduce, reduce, allgather, reduce_scatter, barrier, iallreduce, ibroadcast };

  explicit ForwardingBackend(ls::Backend& inner) : inner_(inner) {}
  std::string name() const override { return inner_.name(); }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int local_rank() const override { return inner_.local_rank(); }
  int local_size() const override { return inner_.local_size(); }
  ls::Backend& inner() { return inner_; }

 protected:
  /// Called before each collective is forwarded; `result` is the buffer that holds the result
  /// (the receive buffer of an out-of-place form; empty for a barrier).
  virtual void on_call(Call /*call*/, const ls::TensorView& /*result*/) {}

  void do_broadcast(ls::TensorView buf, int root) override {
    on_call(Call::broadcast, buf);
    inner_.broadcast(buf, root);
  }
  void do_allreduce(ls::TensorView buf, ls::ReduceOp op) override {
    on_call(Call::allreduce, buf);
    inner_.allreduce(buf, op);
  }
  void do_allreduce(ls::TensorView s, ls::TensorView r, ls::ReduceOp op) override {
    on_call(Call::allreduce, r);
    inner_.allreduce(s, r, op);
  }
  void do_reduce(ls::TensorView buf, ls::ReduceOp op, int root) override {
    on_call(Call::reduce, buf);
    inner_.reduce(buf, op, root);
  }
  void do_reduce(ls::TensorView s, ls::TensorView r, ls::ReduceOp op, int root) override {
    on_call(Call::reduce, r);
    inner_.reduce(s, r, op, root);
  }
  void do_allgather(ls::TensorView s, ls::TensorView r) override {
    on_call(Call::allgather, r);
    inner_.allgather(s, r);
  }
  void do_reduce_scatter(ls::TensorView s, ls::TensorView r, ls::ReduceOp op) override {
    on_call(Call::reduce_scatter, r);
    inner_.reduce_scatter(s, r, op);
  }
  void do_barrier() override {
    on_call(Call::barrier, ls::TensorView{});
    inner_.barrier();
  }
  ls::Request do_iallreduce(ls::TensorView buf, ls::ReduceOp op) override {
    on_call(Call::iallreduce, buf);
    return inner_.iallreduce(buf, op);
  }
  ls::Request do_ibroadcast(ls::TensorView buf, int root) override {
    on_call(Call::ibroadcast, buf);
    return inner_.ibroadcast(buf, root);
  }

 private:
  ls::Backend& inner_;
};

}  // namespace lstest
