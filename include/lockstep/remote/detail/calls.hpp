// Remote calls, for the templates of remote.hpp (not for programs): starting a call and decoding
// its result, the partitioned forms (planning the calls, combining their results), and what
// run_driver and serve share (DriverRun, defined in src/remote/driver_run.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/remote/detail/codec.hpp"
#include "lockstep/remote/detail/registry.hpp"
#include "lockstep/remote/future.hpp"
#include "lockstep/remote/options.hpp"
#include "lockstep/train/data.hpp"

namespace lockstep::detail::remote {

/// A call in flight (defined in src/remote/engine.hpp).
struct Call;
/// Sends a call of `fn` to `rank`; returns once the arguments are sent (their memory may be
/// reused then). Throws InvalidArgument (no session, rank outside the world) or TimeoutError.
std::shared_ptr<Call> start_call(Backend& b, int rank, const FnInfo& fn, Encoder&& args,
                                 const CallOptions& opts);
bool call_ready(Call& c);
/// Waits (serving calls meanwhile where this thread may); throws RemoteError or TimeoutError.
/// Then returns a decoder of the result, valid while `c` lives.
Decoder call_result(Call& c);

template <class F>
struct fn_traits;
template <class R, class... A>
struct fn_traits<R (*)(A...)> {
  using result = std::conditional_t<std::is_void_v<R>, Done, std::decay_t<R>>;
  using params = std::tuple<A...>;
  static constexpr std::size_t arity = sizeof...(A);
};

/// Encodes `arg` as parameter type P (converted when it is another type).
template <class P, class Arg>
void encode_as(Encoder& e, const Arg& arg) {
  using D = std::decay_t<P>;
  if constexpr (std::is_same_v<std::decay_t<Arg>, D>) {
    encode(e, arg);
  } else if constexpr (std::is_same_v<std::decay_t<Arg>, std::reference_wrapper<const D>> ||
                       std::is_same_v<std::decay_t<Arg>, std::reference_wrapper<D>>) {
    encode(e, arg.get());
  } else {
    static_assert(std::is_convertible_v<const Arg&, D>,
                  "lockstep remote: an argument does not convert to the parameter's type");
    const D converted = arg;
    encode(e, converted);
  }
}

template <class Fn, class... Args>
Encoder encode_args(const Args&... args) {
  using Params = typename fn_traits<Fn>::params;
  static_assert(std::tuple_size_v<Params> == sizeof...(Args),
                "lockstep remote: wrong number of arguments for the function");
  Encoder e;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (encode_as<std::tuple_element_t<I, Params>>(e, args), ...);
  }(std::index_sequence_for<Args...>{});
  return e;
}

template <class Fn>
FnInfo info_of(Fn fn) {
  auto info = find_fn(reinterpret_cast<const void*>(fn));
  LOCKSTEP_CHECK_ARG(info.has_value(),
                     "remote call of a function that is not registered on this rank: add "
                     "LOCKSTEP_REMOTE(fn) at namespace scope (or call register_remote)");
  return std::move(*info);
}

template <class R>
struct CallState : Future<R>::State {
  std::shared_ptr<Call> call;
  explicit CallState(std::shared_ptr<Call> c) : call(std::move(c)) {}
  bool ready() override { return call_ready(*call); }
  R get() override {
    Decoder d = call_result(*call);
    R r{};
    decode(d, r);
    d.finish();
    return r;
  }
};

template <class Fn, class... Args>
auto async_one(Backend& b, const CallOptions& o, int rank, Fn fn, const Args&... args) {
  using R = typename fn_traits<Fn>::result;
  static_assert(std::is_default_constructible_v<R>, "lockstep remote: the result type must be default-constructible");
  FnInfo info = info_of(fn);
  auto call = start_call(b, rank, info, encode_args<Fn>(args...), o);
  return Future<R>(std::make_unique<CallState<R>>(std::move(call)));
}

/// One call of a partitioned form: its rank, its weight for mean_reducer, its arguments.
struct Piece {
  int rank;
  double weight;
  Encoder args;
};

template <class T> struct is_int_vector : std::false_type {};
template <class A> struct is_int_vector<std::vector<int, A>> : std::true_type {};

template <class Fn, class P, class... Args>
std::vector<Piece> plan(Backend& b, const P& p, const Args&... args) {
  std::vector<Piece> out;
  if constexpr (std::is_same_v<P, DimPartitioner>) {
    std::int64_t batch = -1;
    bool consistent = true;
    (
        [&](const auto& a) {
          const auto bs = lockstep::detail::batch_size_of(a, p.dim);
          if (bs < 0) return;
          if (batch >= 0 && bs != batch) consistent = false;
          if (batch < 0) batch = bs;
        }(args),
        ...);
    LOCKSTEP_CHECK_ARG(batch >= 0, "remote call with a dim_partitioner: no Tensor argument to partition");
    LOCKSTEP_CHECK_ARG(consistent, "remote call with a dim_partitioner: Tensor arguments differ in size along dimension ", p.dim);
    LOCKSTEP_CHECK_ARG(batch > 0, "remote call with a dim_partitioner: empty batch");
    for (const auto& part : p.partitions(batch, b.size()))
      out.push_back(Piece{part.rank, static_cast<double>(part.count),
                          encode_args<Fn>(lockstep::detail::slice_arg(args, p, part)...)});
  } else if constexpr (std::is_integral_v<P>) {
    out.push_back(Piece{static_cast<int>(p), 1.0, encode_args<Fn>(args...)});
  } else if constexpr (is_int_vector<P>::value) {
    LOCKSTEP_CHECK_ARG(!p.empty(), "remote call with an empty list of ranks");
    for (int r : p) out.push_back(Piece{r, 1.0, encode_args<Fn>(args...)});
  } else {
    // A user's partitioner: returns a vector of (rank, tuple of arguments).
    auto parts = p(args...);
    LOCKSTEP_CHECK_ARG(!parts.empty(), "remote call: the partitioner returned no partition");
    for (auto& [rank, tup] : parts)
      out.push_back(Piece{static_cast<int>(rank), 1.0,
                          std::apply([](const auto&... a) { return encode_args<Fn>(a...); }, tup)});
  }
  return out;
}

template <class R, class Red>
auto reduce_results(std::vector<R>&& rs, const std::vector<double>& w, Red& red) {
  constexpr bool kMean = std::is_same_v<Red, MeanReducer>;
  if constexpr (kMean || std::is_same_v<Red, SumReducer>) {
    // mean_reducer's rule is parallelize's: floating-point results only (data.hpp).
    if constexpr (kMean)
      for (const R& r : rs) lockstep::detail::check_mean_results(r, "remote call");
    double total = 0;
    for (double x : w) total += x;
    auto coef = [&](std::size_t i) { return kMean ? w[i] / total : 1.0; };
    if constexpr (std::is_arithmetic_v<R>) {
      double acc = 0;
      for (std::size_t i = 0; i < rs.size(); ++i) acc += coef(i) * static_cast<double>(rs[i]);
      return static_cast<R>(acc);
    } else {
      R acc = clone_tree(rs[0]);
      for (std::size_t i = 0; i < rs.size(); ++i) lockstep::detail::scale_into(acc, rs[i], coef(i), i == 0);
      return acc;
    }
  } else {
    return red(std::move(rs));
  }
}

template <class R, class Red>
struct reduced {
  using type = std::decay_t<std::invoke_result_t<Red&, std::vector<R>&&>>;
};
template <class R>
struct reduced<R, MeanReducer> {
  using type = R;
};
template <class R>
struct reduced<R, SumReducer> {
  using type = R;
};
template <class R, class Red>
using reduced_t = typename reduced<R, Red>::type;

template <class R, class Red>
struct ReduceState : Future<reduced_t<R, Red>>::State {
  std::vector<Future<R>> parts;
  std::vector<double> weights;
  Red red;
  ReduceState(std::vector<Future<R>> p, std::vector<double> w, Red r)
      : parts(std::move(p)), weights(std::move(w)), red(std::move(r)) {}
  bool ready() override {
    for (auto& f : parts)
      if (!f.ready()) return false;
    return true;
  }
  reduced_t<R, Red> get() override { return reduce_results<R>(wait_all(parts), weights, red); }
};

template <class P, class Red, class Fn, class... Args>
auto async_parts(Backend& b, const CallOptions& o, const P& p, Red red, Fn fn, const Args&... args) {
  using R = typename fn_traits<Fn>::result;
  FnInfo info = info_of(fn);
  std::vector<Piece> pieces = plan<Fn>(b, p, args...);
  std::vector<Future<R>> futures;
  std::vector<double> weights;
  for (auto& piece : pieces) {
    futures.emplace_back(std::make_unique<CallState<R>>(start_call(b, piece.rank, info, std::move(piece.args), o)));
    weights.push_back(piece.weight);
  }
  using Out = reduced_t<R, Red>;
  return Future<Out>(std::make_unique<ReduceState<R, Red>>(std::move(futures), std::move(weights), std::move(red)));
}

template <class T>
concept FnPtr = std::is_pointer_v<T> && std::is_function_v<std::remove_pointer_t<T>>;

template <class Fn, std::size_t N>
concept FnOfArity = FnPtr<Fn> && fn_traits<Fn>::arity == N;

/// What run_driver and serve share (defined in src/remote/driver_run.cpp).
class DriverRun {
 public:
  /// Collective: makes sure a session exists and that every rank entered run_driver (rank 0)
  /// or run_driver/serve (the others) with the same result type.
  DriverRun(Backend& b, bool serve_only, const std::string& result_sig);
  ~DriverRun();
  DriverRun(const DriverRun&) = delete;
  DriverRun& operator=(const DriverRun&) = delete;
  bool is_driver() const noexcept { return driver_; }
  /// Driver: tells the others that f returned (with its result) and ends the run.
  void finish_ok(Encoder&& result);
  /// Driver: tells the others that f threw (the exception in flight) and ends the run.
  void finish_error(std::exception_ptr e);
  /// Others: serves calls until the driver finishes; rethrows the driver's error (same type
  /// and message), or returns a decoder of its result.
  Decoder serve_until_done();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool driver_ = false;
};

/// Collective on b's session: the ranks whose `failed` is true (taking the passes while it
/// waits; TimeoutError past the session's timeout).
std::vector<int> session_agree_failed(Backend& b, bool failed, const char* what);

}  // namespace lockstep::detail::remote
