// Remote calls after TorchOpt's driver/worker model (torchopt.distributed): one rank (the
// driver, rank 0) runs the training loop and sends work to the others.
//
//   float loss_on(const Model& m, const ls::Tensor& batch);
//   LOCKSTEP_REMOTE(loss_on)                          // namespace scope: callable remotely
//   ls::run_driver(backend, [&] {                     // rank 0 runs this, the others serve
//     ls::Future<float> f = ls::remote_async_call(backend, 2, loss_on, model, batch);
//     float l = f.wait();
//     float m = ls::remote_sync_call(backend, ls::batch_partitioner, ls::mean_reducer,
//                                    loss_on, model, batch);     // split, call, combine
//   });
//
// Calls travel over their own duplicate of the backend's communicator (never mixed with the
// collectives of training), served by a progress thread per rank (this needs
// MPI_THREAD_MULTIPLE, which initialize<MPIBackend>() asks for). Who runs a call on the rank it
// is sent to: the thread inside run_driver/serve, any thread of that rank waiting on a future,
// and, in a RemoteSession with RemoteOptions::background, a background executor thread at any
// time (so a rank busy in its own SPMD code still answers). See docs/remote.md.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/train/data.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/core/traverse.hpp"
#include "lockstep/mpi/mpi_backend.hpp"
#include "lockstep/mpi/world.hpp"

#define LOCKSTEP_DETAIL_CAT2(a, b) a##b
#define LOCKSTEP_DETAIL_CAT(a, b) LOCKSTEP_DETAIL_CAT2(a, b)

/// Makes the function `fn` callable on other ranks, under the name written ("loss_on",
/// "ns::loss_on"). At namespace scope; `fn` must name one function (not an overload set), whose
/// parameters and result are serializable (see remote.hpp). Every rank that should run it must
/// register it (a program built from the same code does).
#define LOCKSTEP_REMOTE(fn)                                                             \
  [[maybe_unused]] static const bool LOCKSTEP_DETAIL_CAT(lockstep_remote_registered_,  \
                                                         __COUNTER__) =                 \
      ::lockstep::detail::remote::register_static(#fn, &fn);

namespace lockstep {

/// Settings of a remote session (same on every rank; checked when the session is created).
struct RemoteOptions {
  /// Also run incoming calls on a background thread, at any time (not only while this rank is in
  /// run_driver/serve or waiting on a future). Remote functions then run concurrently with this
  /// rank's own code: they must not touch what that code uses unguarded.
  bool background = false;
  /// Default deadline of a call, in seconds (< 0: lockstep::timeout(), i.e. LOCKSTEP_TIMEOUT,
  /// default 600 s; 0: none). Also bounds the session's own collectives and how long a serving
  /// rank waits without hearing from the driver.
  double timeout = -1.0;
  /// Bytes of received-tensor memory this rank keeps for reuse (0: none). A tensor of 64 KiB or
  /// more that a call or reply brings is received into a buffer of the session; once the last
  /// Tensor over it is released, the buffer is kept (up to this many bytes, the least recently
  /// returned given up first) and a later message of about its size is received into it, which
  /// saves the page faults of fresh memory. A buffer is reused only when nothing refers to it.
  /// Local to each rank (need not agree); the kept memory is freed when the session ends.
  std::size_t receive_cache_bytes = std::size_t{512} << 20;
};

/// Options of one call.
struct CallOptions {
  double timeout = -1.0;  ///< seconds; < 0: the session's default; 0: none
};

namespace detail::remote {

/// Arguments that do not decode (thrown on the rank that decodes; sent back as RemoteError).
class DecodeError : public Error {
 public:
  using Error::Error;
};

// Wire tags of the serialized values (one byte before every value; checked when decoding).
enum : std::uint8_t {
  k_bool = 0x01,
  k_sint = 0x10,   // | sizeof
  k_uint = 0x20,   // | sizeof
  k_float = 0x30,  // | sizeof
  k_string = 0x40,
  k_vector = 0x41,
  k_map = 0x42,
  k_optional = 0x43,
  k_tuple = 0x44,
  k_array = 0x45,
  k_struct = 0x46,
  k_tensor = 0x47,
  k_done = 0x48,
  k_scalar_vector = 0x49,
};

template <class T>
constexpr std::uint8_t scalar_tag() {
  static_assert(sizeof(T) <= 8, "lockstep remote: scalars of more than 8 bytes (long double) cannot be sent");
  if constexpr (std::is_same_v<T, bool>) return k_bool;
  else if constexpr (std::is_floating_point_v<T>) return static_cast<std::uint8_t>(k_float | sizeof(T));
  else if constexpr (std::is_signed_v<T>) return static_cast<std::uint8_t>(k_sint | sizeof(T));
  else return static_cast<std::uint8_t>(k_uint | sizeof(T));
}

/// A message being built: a fixed header (written when it is sent), the function's name, the
/// serialized values, and the tensors, which are sent from their own memory (host tensors are
/// referenced, not copied; device tensors are staged to the host once).
class Encoder {
 public:
  Encoder();
  void put(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    bytes_.insert(bytes_.end(), b, b + n);
  }
  void u8(std::uint8_t v) { put(&v, 1); }
  void u32(std::uint32_t v) { put(&v, 4); }
  void u64(std::uint64_t v) { put(&v, 8); }
  void tensor(const Tensor& t);

  std::vector<std::byte>& bytes() noexcept { return bytes_; }
  std::vector<Tensor>& tensors() noexcept { return tensors_; }

 private:
  std::vector<std::byte> bytes_;
  std::vector<Tensor> tensors_;
};

/// Reads a message's values; every read is checked (DecodeError on a wrong tag or a short
/// message). Tensors are moved out of the received ones (no copy).
class Decoder {
 public:
  Decoder(const std::byte* p, std::size_t n, std::vector<Tensor>* tensors)
      : p_(p), n_(n), tensors_(tensors) {}
  void get(void* out, std::size_t n);
  std::uint8_t u8() { std::uint8_t v; get(&v, 1); return v; }
  std::uint32_t u32() { std::uint32_t v; get(&v, 4); return v; }
  std::uint64_t u64() { std::uint64_t v; get(&v, 8); return v; }
  /// Reads a tag and checks it is `want` (`what` names the expected value).
  void expect(std::uint8_t want, const char* what);
  /// A count that cannot be more than the bytes left (each element takes at least `min_each`).
  std::uint64_t count(std::size_t min_each);
  Tensor tensor();
  /// Checks that every byte and tensor was read.
  void finish();
  [[noreturn]] void fail(const std::string& what) const;
  std::size_t pos() const noexcept { return pos_; }

 private:
  const std::byte* p_;
  std::size_t n_, pos_ = 0;
  std::vector<Tensor>* tensors_;
  std::size_t next_tensor_ = 0;
};

template <class T>
void encode(Encoder& e, const T& x);
template <class T>
void decode(Decoder& d, T& x);

template <class T>
void encode(Encoder& e, const T& x) {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, bool>) {
    e.u8(k_bool);
    e.u8(x ? 1 : 0);
  } else if constexpr (std::is_arithmetic_v<U>) {
    e.u8(scalar_tag<U>());
    e.put(&x, sizeof(U));
  } else if constexpr (std::is_same_v<U, std::string>) {
    e.u8(k_string);
    e.u64(x.size());
    e.put(x.data(), x.size());
  } else if constexpr (std::is_same_v<U, Tensor>) {
    e.u8(k_tensor);
    e.tensor(x);
  } else if constexpr (std::is_same_v<U, Done>) {
    e.u8(k_done);
  } else if constexpr (lockstep::detail::is_std_vector<U>::value) {
    using E = typename U::value_type;
    if constexpr (std::is_arithmetic_v<E> && !std::is_same_v<E, bool>) {
      e.u8(k_scalar_vector);
      e.u8(scalar_tag<E>());
      e.u64(x.size());
      e.put(x.data(), x.size() * sizeof(E));
    } else {
      e.u8(k_vector);
      e.u64(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        if constexpr (std::is_same_v<E, bool>) {
          const bool b = x[i];
          encode(e, b);
        } else {
          encode(e, x[i]);
        }
      }
    }
  } else if constexpr (lockstep::detail::is_std_array<U>::value) {
    e.u8(k_array);
    e.u64(x.size());
    for (const auto& v : x) encode(e, v);
  } else if constexpr (lockstep::detail::is_std_tuple<U>::value) {
    e.u8(k_tuple);
    e.u32(static_cast<std::uint32_t>(std::tuple_size_v<U>));
    std::apply([&](const auto&... v) { (encode(e, v), ...); }, x);
  } else if constexpr (lockstep::detail::is_std_map<U>::value) {
    e.u8(k_map);
    e.u64(x.size());
    for (const auto& [k, v] : x) {
      encode(e, k);
      encode(e, v);
    }
  } else if constexpr (lockstep::detail::is_std_optional<U>::value) {
    e.u8(k_optional);
    e.u8(x.has_value() ? 1 : 0);
    if (x.has_value()) encode(e, *x);
  } else if constexpr (lockstep::detail::HasLockstepFields<U>) {
    std::uint32_t n = 0;
    lockstep_visit_fields(x, [&](const char*, const auto&) { ++n; });
    e.u8(k_struct);
    e.u32(n);
    lockstep_visit_fields(x, [&](const char*, const auto& f) { encode(e, f); });
  } else {
    static_assert(lockstep::detail::always_false_v<U>,
                  "lockstep remote: this type cannot be sent. Supported: Tensor, arithmetic "
                  "scalars, std::string, std::vector, std::array, std::tuple, std::pair, "
                  "std::map, std::optional of those, and types with LOCKSTEP_FIELDS.");
  }
}

template <class T>
void decode(Decoder& d, T& x) {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, bool>) {
    d.expect(k_bool, "a bool");
    x = d.u8() != 0;
  } else if constexpr (std::is_arithmetic_v<U>) {
    d.expect(scalar_tag<U>(), typeid(U).name());
    d.get(&x, sizeof(U));
  } else if constexpr (std::is_same_v<U, std::string>) {
    d.expect(k_string, "a string");
    const auto n = d.count(1);
    x.resize(n);
    d.get(x.data(), n);
  } else if constexpr (std::is_same_v<U, Tensor>) {
    d.expect(k_tensor, "a tensor");
    x = d.tensor();
  } else if constexpr (std::is_same_v<U, Done>) {
    d.expect(k_done, "no value (a void function's result)");
  } else if constexpr (lockstep::detail::is_std_vector<U>::value) {
    using E = typename U::value_type;
    if constexpr (std::is_arithmetic_v<E> && !std::is_same_v<E, bool>) {
      d.expect(k_scalar_vector, "a vector of scalars");
      d.expect(scalar_tag<E>(), typeid(E).name());
      const auto n = d.count(sizeof(E));
      x.resize(n);
      d.get(x.data(), n * sizeof(E));
    } else {
      d.expect(k_vector, "a vector");
      const auto n = d.count(1);
      x.clear();
      x.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        if constexpr (std::is_same_v<E, bool>) {
          bool b = false;
          decode(d, b);
          x[i] = b;
        } else {
          decode(d, x[i]);
        }
      }
    }
  } else if constexpr (lockstep::detail::is_std_array<U>::value) {
    d.expect(k_array, "an array");
    if (d.u64() != x.size()) d.fail("an array of another size");
    for (auto& v : x) decode(d, v);
  } else if constexpr (lockstep::detail::is_std_tuple<U>::value) {
    d.expect(k_tuple, "a tuple");
    if (d.u32() != std::tuple_size_v<U>) d.fail("a tuple of another size");
    std::apply([&](auto&... v) { (decode(d, v), ...); }, x);
  } else if constexpr (lockstep::detail::is_std_map<U>::value) {
    d.expect(k_map, "a map");
    const auto n = d.count(2);
    x.clear();
    for (std::uint64_t i = 0; i < n; ++i) {
      typename U::key_type k{};
      decode(d, k);
      decode(d, x[k]);
    }
  } else if constexpr (lockstep::detail::is_std_optional<U>::value) {
    d.expect(k_optional, "an optional");
    x.reset();
    if (d.u8() != 0) {
      x.emplace();
      decode(d, *x);
    }
  } else if constexpr (lockstep::detail::HasLockstepFields<U>) {
    std::uint32_t n = 0;
    lockstep_visit_fields(x, [&](const char*, auto&) { ++n; });
    d.expect(k_struct, "a struct");
    if (d.u32() != n) d.fail("a struct with another number of fields");
    lockstep_visit_fields(x, [&](const char*, auto& f) { decode(d, f); });
  } else {
    static_assert(lockstep::detail::always_false_v<U>, "lockstep remote: this type cannot be received");
  }
}

/// The rank-side handler of one registered function: decodes the arguments, calls, encodes.
using Invoke = void (*)(const void* fn, Decoder& in, Encoder& out);

struct FnInfo {
  std::string name;
  std::string sig;  ///< the function type, as the compiler names it
  const void* fn = nullptr;
  Invoke invoke = nullptr;
};

/// Registers (name -> function). The same name again with the same function is a no-op;
/// another function under a registered name is InvalidArgument.
void register_fn(const std::string& name, std::string sig, const void* fn, Invoke invoke);
/// Removes the name (returns whether it was registered).
bool unregister_fn(const std::string& name);
/// The registration of a function pointer, if any.
std::optional<FnInfo> find_fn(const void* fn);

template <class P, class V>
decltype(auto) pass_arg(V& v) {
  if constexpr (std::is_lvalue_reference_v<P>) return (v);
  else return std::move(v);
}

template <class R, class... A>
void invoke_fn(const void* p, Decoder& in, Encoder& out) {
  auto fn = reinterpret_cast<R (*)(A...)>(const_cast<void*>(p));
  std::tuple<std::decay_t<A>...> args;
  std::apply([&](auto&... a) { (decode(in, a), ...); }, args);
  in.finish();
  auto call = [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
    return fn(pass_arg<A>(std::get<I>(args))...);
  };
  if constexpr (std::is_void_v<R>) {
    call(std::index_sequence_for<A...>{});
    encode(out, Done{});
  } else {
    const std::decay_t<R> r = call(std::index_sequence_for<A...>{});
    encode(out, r);
  }
}

template <class R, class... A>
std::string signature_of() {
  return typeid(R(std::decay_t<A>...)).name();
}

template <class R, class... A>
bool register_static(const char* name, R (*fn)(A...)) {
  register_fn(name, signature_of<R, A...>(), reinterpret_cast<const void*>(fn), &invoke_fn<R, A...>);
  return true;
}

/// What the session's receive cache (RemoteOptions::receive_cache_bytes) did on this rank.
struct ReceiveCacheStats {
  std::uint64_t hits = 0;     ///< tensors received into a kept buffer
  std::uint64_t misses = 0;   ///< tensors of the cached sizes received into new memory
  std::size_t kept_bytes = 0; ///< memory kept for reuse now
  std::size_t kept_buffers = 0;
};
/// The receive cache of b's session; InvalidArgument when b has no session.
ReceiveCacheStats receive_cache_stats(const Backend& b);

/// Test hooks (test/remote/): the conditions the tests need, made on purpose. Not for programs.
struct TestHooks {
  /// Sessions created from now on use at most this many data tags (0: all that MPI_TAG_UB
  /// allows), so that the tags of calls wrap after a few calls. Every rank must set the same.
  std::atomic<int> tag_span{0};
  /// Sessions created from now on wait this long for the tensor messages of a header they
  /// received (< 0: the session's timeout).
  std::atomic<double> data_timeout{-1.0};
  /// The next this many tensors this rank receives find no memory (as if the allocation failed).
  std::atomic<int> fail_allocations{0};
  /// Messages whose non-tensor part is over this many bytes are refused before they are sent,
  /// as those over 2 GiB are (0: 2 GiB).
  std::atomic<std::size_t> max_message_bytes{0};
  /// The next this many replies this rank sends without tensors go out malformed: the lengths
  /// in their header do not add up (as from a sender of another version), so that the caller
  /// drops them.
  std::atomic<int> malformed_replies{0};
};
TestHooks& test_hooks();
/// Called by a remote function: the tensor messages of its reply are sent `seconds` after the
/// reply's header (on the thread that runs it, for this call only).
void delay_reply_tensors_for_test(double seconds);

/// A call in flight (defined in remote.cpp).
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

}  // namespace detail::remote

/// Registers fn under `name` at run time (what LOCKSTEP_REMOTE does at start-up).
template <class R, class... A>
void register_remote(const std::string& name, R (*fn)(A...)) {
  detail::remote::register_fn(name, detail::remote::signature_of<R, A...>(),
                              reinterpret_cast<const void*>(fn), &detail::remote::invoke_fn<R, A...>);
}
/// Removes a registration on this rank (calls of it from other ranks then fail with
/// RemoteError). Returns whether the name was registered.
inline bool unregister_remote(const std::string& name) { return detail::remote::unregister_fn(name); }

/// The result of a remote call (or of a combination of calls), to be waited for. Move-only; a
/// moved-from or waited-for Future is empty (valid() false; wait/ready/then throw
/// InvalidArgument). Dropping a pending Future abandons the call (its reply is discarded).
template <class R>
class Future {
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

namespace detail::remote {

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

/// What run_driver and serve share (defined in remote.cpp).
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

}  // namespace detail::remote

/// A remote session on a backend: the duplicated communicator and the progress thread. Collective
/// to create and to close (the destructor closes it if close() was not called). run_driver
/// creates one for its duration when none exists; create one yourself for background serving
/// or to keep the session across several run_driver calls. Needs MPI_THREAD_MULTIPLE.
class RemoteSession {
 public:
  explicit RemoteSession(Backend& b, RemoteOptions options = {});
  ~RemoteSession();
  RemoteSession(const RemoteSession&) = delete;
  RemoteSession& operator=(const RemoteSession&) = delete;
  /// Collective, graceful: this rank serves calls (on this thread, or the background one) until
  /// every rank has closed the session and every call made on it has been answered, then frees
  /// it. A rank that hears nothing from another for the session's timeout meanwhile (stopped,
  /// hung, or never closing) throws TimeoutError naming it.
  void close();

 private:
  Backend* backend_ = nullptr;
};

// ---- calls ----

/// Calls fn(args...) on `rank` and returns a Future of its result (void functions: ls::Done).
/// The arguments are serialized and sent before this returns (they may be changed then); the
/// call runs on `rank` (see remote.hpp for which thread). Calls to this rank itself work.
template <class Fn, class... Args>
  requires detail::remote::FnOfArity<Fn, sizeof...(Args)>
auto remote_async_call(Backend& b, int rank, Fn fn, const Args&... args) {
  return detail::remote::async_one(b, CallOptions{}, rank, fn, args...);
}
template <class Fn, class... Args>
  requires detail::remote::FnOfArity<Fn, sizeof...(Args)>
auto remote_async_call(Backend& b, const CallOptions& o, int rank, Fn fn, const Args&... args) {
  return detail::remote::async_one(b, o, rank, fn, args...);
}
/// The partitioned form (TorchOpt's remote_async_call with partitioner and reducer): the
/// partitioner (dim_partitioner(d), batch_partitioner, exclusive_batch_partitioner, a
/// std::vector<int> of ranks, one rank, or a callable returning a vector of (rank, tuple of
/// arguments)) makes the calls; the reducer (mean_reducer, weighted by partition size,
/// sum_reducer, or a callable taking std::vector<R>) combines their results.
template <class P, class Red, class Fn, class... Args>
  requires(detail::remote::FnOfArity<Fn, sizeof...(Args)> && !detail::remote::FnPtr<Red> &&
           !std::is_same_v<std::decay_t<P>, CallOptions>)
auto remote_async_call(Backend& b, const P& p, Red red, Fn fn, const Args&... args) {
  return detail::remote::async_parts(b, CallOptions{}, p, std::move(red), fn, args...);
}
template <class P, class Red, class Fn, class... Args>
  requires(detail::remote::FnOfArity<Fn, sizeof...(Args)> && !detail::remote::FnPtr<Red>)
auto remote_async_call(Backend& b, const CallOptions& o, const P& p, Red red, Fn fn, const Args&... args) {
  return detail::remote::async_parts(b, o, p, std::move(red), fn, args...);
}
/// remote_async_call(...).wait().
template <class... T>
auto remote_sync_call(Backend& b, T&&... t) {
  return remote_async_call(b, std::forward<T>(t)...).wait();
}

/// TorchOpt's parallelize_async: a callable (args...) -> Future of the reduced result, running
/// fn on the partitions of its arguments. Distinct from the SPMD ls::parallelize (data.hpp).
template <class P, class Red, class Fn>
  requires detail::remote::FnPtr<Fn>
auto parallelize_async(Backend& b, P partitioner, Red reducer, Fn fn, CallOptions o = {}) {
  return [&b, partitioner, reducer, fn, o](const auto&... args) {
    return remote_async_call(b, o, partitioner, reducer, fn, args...);
  };
}
/// TorchOpt's parallelize_sync (= parallelize): the same, waiting for the result.
template <class P, class Red, class Fn>
  requires detail::remote::FnPtr<Fn>
auto parallelize_sync(Backend& b, P partitioner, Red reducer, Fn fn, CallOptions o = {}) {
  return [&b, partitioner, reducer, fn, o](const auto&... args) {
    return remote_async_call(b, o, partitioner, reducer, fn, args...).wait();
  };
}

/// Collective. Rank 0 (the driver) runs f; every other rank serves calls until f returns. Every
/// rank returns f's result (sent to the others; it must be serializable), or throws f's error
/// (the driver its own exception, the others the same type and message). A rank that hears
/// nothing from the driver for the session's timeout throws TimeoutError.
template <class F>
auto run_driver(Backend& b, F&& f) {
  using R0 = std::invoke_result_t<F&>;
  using R = std::conditional_t<std::is_void_v<R0>, Done, std::decay_t<R0>>;
  detail::remote::DriverRun run(b, false, typeid(R).name());
  if (run.is_driver()) {
    try {
      if constexpr (std::is_void_v<R0>) {
        f();
        detail::remote::Encoder e;
        detail::remote::encode(e, Done{});
        run.finish_ok(std::move(e));
        return;
      } else {
        R r = f();
        detail::remote::Encoder e;
        detail::remote::encode(e, r);
        run.finish_ok(std::move(e));
        return r;
      }
    } catch (...) {
      run.finish_error(std::current_exception());
      throw;
    }
  } else {
    auto d = run.serve_until_done();
    if constexpr (std::is_void_v<R0>) {
      return;
    } else {
      R r{};
      detail::remote::decode(d, r);
      return r;
    }
  }
}

/// Collective with run_driver on rank 0: a rank other than 0 serves calls until the driver's
/// run_driver returns (then returns, or throws the driver's error). InvalidArgument-like
/// MismatchError on every rank if rank 0 calls serve.
void serve(Backend& b);

namespace detail::remote {
/// Collective on b's session: the ranks whose `failed` is true (taking the passes while it
/// waits; TimeoutError past the session's timeout).
std::vector<int> session_agree_failed(Backend& b, bool failed, const char* what);
}  // namespace detail::remote

/// TorchOpt's auto_init_rpc: `auto_init_rpc(worker_init, options)(func)` is func wrapped so that
/// calling it, on every rank, initialises MPIBackend (when not yet), opens a RemoteSession on it,
/// runs worker_init() (if given), waits until every rank has (when it threw on some rank, every
/// rank throws: that rank its exception, the others an Error naming it), runs func(args...), and
/// closes the session gracefully: a rank whose func returned serves the calls of the others until every
/// rank's func has returned and every call is answered (TorchOpt's graceful rpc.shutdown). Each
/// rank returns its own func's result. Typical: func drives on rank 0 (`ls::rank_zero_only`) and
/// returns at once on the others, which then serve. An exception in func closes the session the
/// same way (serving) and goes on. Collective; the remote calls inside func name the backend
/// `ls::get_distributed_backend<ls::MPIBackend>()`.
template <class Init = std::nullptr_t>
auto auto_init_rpc(Init worker_init = nullptr, RemoteOptions options = {}) {
  static_assert(std::is_null_pointer_v<Init> || std::is_invocable_v<Init&>,
                "auto_init_rpc: worker_init must be callable with no arguments");
  return [worker_init = std::move(worker_init), options](auto func) {
    return [worker_init, options, func = std::move(func)](auto&&... args) mutable -> decltype(auto) {
      initialize<MPIBackend>();
      auto& b = get_distributed_backend<MPIBackend>();
      RemoteSession session(b, options);
      std::exception_ptr init_error;
      if constexpr (!std::is_null_pointer_v<Init>) {
        try {
          worker_init();
        } catch (...) {
          init_error = std::current_exception();
        }
      }
      // The ranks agree before any func starts: a worker_init that threw on one rank ends
      // auto_init_rpc on every rank, each closing the session in step.
      const auto failed = detail::remote::session_agree_failed(b, init_error != nullptr, "auto_init_rpc (after worker_init)");
      if (init_error) std::rethrow_exception(init_error);
      if (!failed.empty()) {
        std::string ranks;
        for (std::size_t i = 0; i < failed.size() && i < 8; ++i) ranks += (i ? ", " : "") + std::to_string(failed[i]);
        if (failed.size() > 8) ranks += ", ...";
        throw Error("auto_init_rpc: worker_init threw on rank" + std::string(failed.size() > 1 ? "s " : " ") + ranks +
                    " (its error is reported there); func did not run on any rank");
      }
      using R = decltype(func(std::forward<decltype(args)>(args)...));
      if constexpr (std::is_void_v<R>) {
        func(std::forward<decltype(args)>(args)...);
        session.close();
      } else {
        R r = func(std::forward<decltype(args)>(args)...);
        session.close();
        return r;
      }
    };
  };
}

}  // namespace lockstep
