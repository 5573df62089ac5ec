// Remote calls: the Future of a call's result, and wait_all.
#pragma once

#include <exception>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/errors.hpp"
#include "lockstep/mpi/world.hpp"

namespace lockstep {

/// The result of a remote call (or of a combination of calls), to be waited for. Move-only; a
/// moved-from or waited-for Future is empty (valid() false; wait/ready/then throw
/// InvalidArgument). Dropping a pending Future abandons the call (its reply is discarded), hence
/// [[nodiscard]].
template <class R>
class [[nodiscard("a dropped Future abandons the call: its result and its error are lost")]] Future {
 public:
  using value_type = R;
  struct State {
    virtual ~State() = default;
    virtual bool ready() = 0;
    virtual R get() = 0;
  };

  Future() = default;
  explicit Future(std::unique_ptr<State> s) : s_(std::move(s)) {}
  Future(Future&& o) noexcept : s_(std::move(o.s_)) {}
  Future& operator=(Future&& o) noexcept {
    if (this != &o) s_ = std::move(o.s_);
    return *this;
  }
  Future(const Future&) = delete;
  Future& operator=(const Future&) = delete;

  bool valid() const noexcept { return static_cast<bool>(s_); }
  /// True once wait() would not block (the result or the error has arrived).
  bool ready() const {
    check();
    return s_->ready();
  }
  /// Blocks until the result is there (within the call's deadline) and returns it; throws
  /// RemoteError, TimeoutError, ... The Future is empty afterwards.
  R wait() {
    check();
    auto s = std::move(s_);
    return s->get();
  }
  /// A Future of f(result), computed when that Future is waited for; f is not called if this
  /// call fails (the error passes on). Consumes this Future.
  template <class F>
  auto then(F f) {
    check();
    using U0 = std::invoke_result_t<F&, R&&>;
    using U = std::conditional_t<std::is_void_v<U0>, Done, std::decay_t<U0>>;
    struct Then : Future<U>::State {
      std::unique_ptr<State> parent;
      F f;
      Then(std::unique_ptr<State> p, F fn) : parent(std::move(p)), f(std::move(fn)) {}
      bool ready() override { return parent->ready(); }
      U get() override {
        if constexpr (std::is_void_v<U0>) {
          f(parent->get());
          return Done{};
        } else {
          return f(parent->get());
        }
      }
    };
    return Future<U>(std::make_unique<Then>(std::move(s_), std::move(f)));
  }

 private:
  void check() const {
    LOCKSTEP_CHECK_ARG(s_ != nullptr, "an empty ls::Future (moved from, or already waited for)");
  }
  std::unique_ptr<State> s_;
};

/// Waits for every future (all of them, even after one fails) and returns their results in
/// order; rethrows the first error. The futures are empty afterwards.
template <class R>
std::vector<R> wait_all(std::vector<Future<R>>& fs) {
  std::vector<R> out;
  out.reserve(fs.size());
  std::exception_ptr first;
  for (auto& f : fs) {
    try {
      out.push_back(f.wait());
    } catch (...) {
      if (!first) first = std::current_exception();
      out.emplace_back();
    }
  }
  if (first) std::rethrow_exception(first);
  return out;
}
template <class R>
std::vector<R> wait_all(std::vector<Future<R>>&& fs) {
  return wait_all(fs);
}

}  // namespace lockstep
