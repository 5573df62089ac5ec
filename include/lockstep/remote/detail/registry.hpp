// Remote calls, for LOCKSTEP_REMOTE and register_remote (not for programs): the registration of
// a function under a name, and the rank-side invoker that decodes its arguments, calls it and
// encodes its result.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>

#include "lockstep/remote/detail/codec.hpp"

namespace lockstep::detail::remote {

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
}  // namespace lockstep::detail::remote
