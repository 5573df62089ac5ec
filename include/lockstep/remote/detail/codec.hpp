// Remote calls, for the templates of remote.hpp (not for programs): the serialization of
// arguments and results. Every value is one wire-tag byte then its bytes; tensors go in a table
// and travel from their own memory. Decoding checks every tag and length (DecodeError).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "lockstep/core/errors.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/core/traverse.hpp"
#include "lockstep/mpi/world.hpp"

namespace lockstep::detail::remote {

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
}  // namespace lockstep::detail::remote
