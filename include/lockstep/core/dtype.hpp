// Element types and devices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace lockstep {

/// Element type of a tensor.
enum class DType : std::uint8_t { f16, bf16, f32, f64, i32, i64, u8 };

/// IEEE half-precision storage (arithmetic happens in float).
struct half {
  std::uint16_t bits = 0;
};
/// bfloat16 storage (the upper 16 bits of an IEEE float).
struct bfloat16 {
  std::uint16_t bits = 0;
};

/// Size of one element in bytes.
[[nodiscard]] constexpr std::size_t size_of(DType t) noexcept {
  switch (t) {
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}

/// True for f16, bf16, f32, f64.
[[nodiscard]] constexpr bool is_floating(DType t) noexcept {
  return t == DType::f16 || t == DType::bf16 || t == DType::f32 || t == DType::f64;
}

/// Short name: "f32", "bf16", ...
[[nodiscard]] const char* name(DType t) noexcept;

/// dtype_of<T>: the DType for a C++ element type.
template <class T>
struct dtype_of;
template <> struct dtype_of<half> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bfloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<std::uint8_t> { static constexpr DType value = DType::u8; };
template <class T>
inline constexpr DType dtype_of_v = dtype_of<std::remove_cv_t<T>>::value;

/// Conversions between the 16-bit float formats and float (round to nearest even).
[[nodiscard]] float to_float(half h) noexcept;
[[nodiscard]] float to_float(bfloat16 b) noexcept;
[[nodiscard]] half to_half(float f) noexcept;
[[nodiscard]] bfloat16 to_bfloat16(float f) noexcept;

/// Where a tensor's memory lives.
struct Device {
  enum class Kind : std::uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static constexpr Device cpu() noexcept { return {Kind::cpu, 0}; }
  static constexpr Device cuda(int index = 0) noexcept { return {Kind::cuda, index}; }
  constexpr bool is_cpu() const noexcept { return kind == Kind::cpu; }
  constexpr bool is_cuda() const noexcept { return kind == Kind::cuda; }
  friend constexpr bool operator==(Device, Device) = default;
};

/// "cpu" or "cuda:N".
[[nodiscard]] std::string to_string(Device d);

}  // namespace lockstep
