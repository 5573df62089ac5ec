// Unit tests of the tensor layer: dtypes, the 16-bit float conversions, Tensor and TensorView.
// Single process; the MPI-aware main still runs (as an MPI singleton).
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

namespace ls = lockstep;

// The compiler's _Float16 is the independent reference for f16 conversions: GCC 12 has it on
// x86-64; clang only from 15. Without it, the spot checks below still run.
#if defined(__FLT16_MANT_DIG__) && (!defined(__clang__) || __clang_major__ >= 15)
#define LSTEST_HAVE_FLOAT16 1
#else
#define LSTEST_HAVE_FLOAT16 0
#endif

namespace {

// Reference float -> bf16 rounding computed from the two neighbouring bf16 values in double
// arithmetic (independent of the bit trick in dtype.cpp): the nearer one, ties to even.
std::uint16_t reference_bf16(float f) {
  if (std::isinf(f)) return f > 0 ? 0x7f80 : 0xff80;
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  std::uint32_t lo = u & 0xffff0000u;
  std::uint32_t hi = lo + 0x10000u;
  double dl = std::abs(static_cast<double>(std::bit_cast<float>(lo)) - f);
  double dh = std::abs(static_cast<double>(std::bit_cast<float>(hi)) - f);
  if ((hi & 0x7f800000u) == 0x7f800000u) {
    // Above the largest finite bf16 the upper neighbour is inf; IEEE rounding treats it as
    // 2^128 when deciding which is nearer.
    dh = std::abs(std::ldexp(1.0, 128) * (f < 0 ? -1 : 1) - f);
  }
  std::uint32_t pick;
  if (dl < dh) pick = lo;
  else if (dh < dl) pick = hi;
  else pick = ((lo >> 16) & 1u) ? hi : lo;
  return static_cast<std::uint16_t>(pick >> 16);
}

bool is_nan_half(std::uint16_t b) { return (b & 0x7c00u) == 0x7c00u && (b & 0x3ffu) != 0; }
bool is_nan_bf16(std::uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; }

}  // namespace

TEST_CASE("dtype sizes, names and floating-ness") {
  using ls::DType;
  CHECK(ls::size_of(DType::f16) == 2);
  CHECK(ls::size_of(DType::bf16) == 2);
  CHECK(ls::size_of(DType::f32) == 4);
  CHECK(ls::size_of(DType::f64) == 8);
  CHECK(ls::size_of(DType::i32) == 4);
  CHECK(ls::size_of(DType::i64) == 8);
  CHECK(ls::size_of(DType::u8) == 1);
  CHECK(std::string(ls::name(DType::bf16)) == "bf16");
  CHECK(std::string(ls::name(DType::u8)) == "u8");
  CHECK(ls::is_floating(DType::f16));
  CHECK(ls::is_floating(DType::bf16));
  CHECK(ls::is_floating(DType::f64));
  CHECK_FALSE(ls::is_floating(DType::i32));
  CHECK_FALSE(ls::is_floating(DType::u8));
  CHECK(ls::dtype_of_v<const double> == DType::f64);
  CHECK(ls::dtype_of_v<std::int64_t> == DType::i64);
  CHECK(ls::dtype_of_v<ls::bfloat16> == DType::bf16);
  CHECK(ls::to_string(ls::Device::cpu()) == "cpu");
  CHECK(ls::to_string(ls::Device::cuda(3)) == "cuda:3");
  CHECK(ls::Device::cuda(1) != ls::Device::cuda(0));
}

TEST_CASE("f16: every half survives half -> float -> half") {
  int bad = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    ls::half h{static_cast<std::uint16_t>(b)};
    float f = ls::to_float(h);
    std::uint16_t back = ls::to_half(f).bits;
    if (is_nan_half(h.bits) ? !is_nan_half(back) : back != h.bits) ++bad;
  }
  CHECK(bad == 0);
}

#if LSTEST_HAVE_FLOAT16
TEST_CASE("f16: to_float agrees with the compiler's _Float16") {
  int bad = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    if (is_nan_half(static_cast<std::uint16_t>(b))) continue;
    std::uint16_t bits = static_cast<std::uint16_t>(b);
    _Float16 ref;
    std::memcpy(&ref, &bits, 2);
    float mine = ls::to_float(ls::half{bits});
    if (std::bit_cast<std::uint32_t>(mine) != std::bit_cast<std::uint32_t>(static_cast<float>(ref))) ++bad;
  }
  CHECK(bad == 0);
}

TEST_CASE("f16: float -> half rounds to nearest even like _Float16") {
  // Every 997th float bit pattern (both signs, all exponents) plus every exact halfway point
  // between neighbouring halves and its two float neighbours: libgcc's conversion is the
  // reference.
  int bad = 0;
  auto check = [&](float f) {
    if (std::isnan(f)) return;
    _Float16 ref = static_cast<_Float16>(f);
    std::uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    if (ls::to_half(f).bits != rb) ++bad;
  };
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 997) check(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  for (std::uint32_t b = 0; b < 0x7c00u; ++b) {
    float a = ls::to_float(ls::half{static_cast<std::uint16_t>(b)});
    float c = ls::to_float(ls::half{static_cast<std::uint16_t>(b + 1)});
    float mid = static_cast<float>((static_cast<double>(a) + c) / 2);  // exact in float
    check(mid);
    check(-mid);
    check(std::nextafter(mid, 0.0f));
    check(std::nextafter(mid, 1e30f));
  }
  CHECK(bad == 0);
}
#endif

TEST_CASE("f16: rounding spot values") {
  // Ties to even, overflow to inf, smallest subnormal, underflow to zero.
  CHECK(ls::to_half(1.0f).bits == 0x3c00);
  CHECK(ls::to_half(1.0f + 0.00048828125f).bits == 0x3c00);                 // tie, even stays
  CHECK(ls::to_half(1.0009765625f + 0.00048828125f).bits == 0x3c02);        // tie, odd rounds up
  CHECK(ls::to_half(65504.0f).bits == 0x7bff);
  CHECK(ls::to_half(65520.0f).bits == 0x7c00);
  CHECK(ls::to_half(-1e9f).bits == 0xfc00);
  CHECK(ls::to_half(std::ldexp(1.0f, -24)).bits == 0x0001);
  CHECK(ls::to_half(std::ldexp(1.0f, -25)).bits == 0x0000);
  CHECK(ls::to_half(std::ldexp(1.5f, -24)).bits == 0x0002);   // subnormal tie, odd rounds up
  CHECK(ls::to_half(std::ldexp(2.5f, -24)).bits == 0x0002);   // subnormal tie, even stays
  CHECK(ls::to_half(std::ldexp(0.75f, -24)).bits == 0x0001);
  CHECK(ls::to_half(65519.0f).bits == 0x7bff);                // just below the overflow tie
  CHECK(ls::to_half(std::ldexp(1.0f, -14)).bits == 0x0400);   // smallest normal
  CHECK(is_nan_half(ls::to_half(std::numeric_limits<float>::quiet_NaN()).bits));
}

TEST_CASE("bf16: round trips and rounding") {
  int bad_trip = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    ls::bfloat16 h{static_cast<std::uint16_t>(b)};
    std::uint16_t back = ls::to_bfloat16(ls::to_float(h)).bits;
    if (is_nan_bf16(h.bits) ? !is_nan_bf16(back) : back != h.bits) ++bad_trip;
    // bf16 -> float is exact: the upper half of the float's bits.
    if (std::bit_cast<std::uint32_t>(ls::to_float(h)) != (b << 16)) ++bad_trip;
  }
  CHECK(bad_trip == 0);
  int bad_round = 0;
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 991) {
    float f = std::bit_cast<float>(static_cast<std::uint32_t>(u));
    if (std::isnan(f)) continue;
    if (ls::to_bfloat16(f).bits != reference_bf16(f)) ++bad_round;
  }
  // Exact ties: x.5 ulp with an even and an odd lower neighbour.
  for (std::uint32_t hi : {0x3f800000u, 0x3f810000u, 0xc0490000u, 0x7f7f0000u}) {
    float f = std::bit_cast<float>(hi | 0x8000u);
    if (ls::to_bfloat16(f).bits != reference_bf16(f)) ++bad_round;
  }
  CHECK(bad_round == 0);
  CHECK(ls::to_bfloat16(std::bit_cast<float>(0x3f808000u)).bits == 0x3f80);  // tie, even stays
  CHECK(ls::to_bfloat16(std::bit_cast<float>(0x3f818000u)).bits == 0x3f82);  // tie, odd rounds up
  CHECK(ls::to_bfloat16(3.0e38f).bits == 0x7f62);
  CHECK(is_nan_bf16(ls::to_bfloat16(std::numeric_limits<float>::quiet_NaN()).bits));
}

TEST_CASE("Tensor factories fill every dtype") {
  using ls::DType;
  for (DType t : {DType::f16, DType::bf16, DType::f32, DType::f64, DType::i32, DType::i64, DType::u8}) {
    INFO("dtype " << ls::name(t));
    ls::Tensor z = ls::Tensor::zeros({3, 5}, t);
    CHECK(z.numel() == 15);
    CHECK(z.ndim() == 2);
    CHECK(z.dim(1) == 5);
    CHECK(z.dtype() == t);
    CHECK(z.device() == ls::Device::cpu());
    CHECK(z.nbytes() == 15 * ls::size_of(t));
    CHECK(z.owns_memory());
    const auto* zb = static_cast<const unsigned char*>(z.raw_data());
    bool all_zero = true;
    for (std::size_t i = 0; i < z.nbytes(); ++i) all_zero = all_zero && zb[i] == 0;
    CHECK(all_zero);

    ls::Tensor o = ls::Tensor::ones({7}, t);
    ls::Tensor f = ls::Tensor::full({7}, 3.0, t);
    auto as_double = [&](const ls::Tensor& x, std::int64_t i) -> double {
      switch (t) {
        case DType::f16: return ls::to_float(x.data<ls::half>()[i]);
        case DType::bf16: return ls::to_float(x.data<ls::bfloat16>()[i]);
        case DType::f32: return x.data<float>()[i];
        case DType::f64: return x.data<double>()[i];
        case DType::i32: return x.data<std::int32_t>()[i];
        case DType::i64: return static_cast<double>(x.data<std::int64_t>()[i]);
        case DType::u8: return x.data<std::uint8_t>()[i];
      }
      return -1;
    };
    for (std::int64_t i = 0; i < 7; ++i) {
      CHECK(as_double(o, i) == 1.0);
      CHECK(as_double(f, i) == 3.0);
    }
  }
  ls::Tensor def;
  CHECK(def.numel() == 0);
  CHECK(def.shape() == ls::Shape{0});
  ls::Tensor scalar = ls::Tensor::full({}, 2.5, ls::DType::f64);
  CHECK(scalar.numel() == 1);
  CHECK(scalar.data<double>()[0] == 2.5);
  ls::Tensor f16 = ls::Tensor::full({2}, 0.1, ls::DType::f16);
  CHECK(f16.data<ls::half>()[0].bits == ls::to_half(0.1f).bits);
}

TEST_CASE("Tensor memory is 64-byte aligned") {
  for (std::int64_t n : {0, 1, 3, 17, 1000, 4099}) {
    for (ls::DType t : {ls::DType::u8, ls::DType::f16, ls::DType::f64}) {
      ls::Tensor x = ls::Tensor::empty({n}, t);
      CHECK(reinterpret_cast<std::uintptr_t>(x.raw_data()) % 64 == 0);
      ls::Tensor c = ls::Tensor::zeros({n}, t).clone();
      CHECK(reinterpret_cast<std::uintptr_t>(c.raw_data()) % 64 == 0);
    }
  }
}

TEST_CASE("Tensor::from copies, borrow aliases, clone is deep") {
  std::vector<float> src{1, 2, 3, 4, 5, 6};
  ls::Tensor a = ls::Tensor::from(src, {2, 3});
  CHECK(a.shape() == ls::Shape{2, 3});
  CHECK(a.data<float>() != src.data());
  src[0] = 100;
  CHECK(a.data<float>()[0] == 1.0f);  // a copy, not a view
  ls::Tensor v = ls::Tensor::from(std::vector<std::int32_t>{4, 5, 6});
  CHECK(v.shape() == ls::Shape{3});
  CHECK(v.dtype() == ls::DType::i32);
  CHECK(v.data<std::int32_t>()[2] == 6);
  CHECK_THROWS_AS(ls::Tensor::from(src, {4, 2}), ls::InvalidArgument);

  ls::Tensor b = ls::Tensor::borrow(src.data(), {6}, ls::DType::f32);
  CHECK_FALSE(b.owns_memory());
  CHECK(b.data<float>() == src.data());
  src[1] = 42;
  CHECK(b.data<float>()[1] == 42.0f);

  ls::Tensor c = a.clone();
  CHECK(c.data<float>() != a.data<float>());
  CHECK(ls::bitwise_equal(a, c));
  c.data<float>()[5] = -1;
  CHECK(a.data<float>()[5] == 6.0f);
  CHECK_FALSE(ls::bitwise_equal(a, c));

  ls::Tensor d = ls::Tensor::zeros({6});
  d.copy_from(b.view());
  CHECK(d.data<float>()[1] == 42.0f);
  CHECK_THROWS_AS(d.copy_from(ls::Tensor::zeros({5}).view()), ls::InvalidArgument);
  CHECK_THROWS_AS(d.copy_from(ls::Tensor::zeros({6}, ls::DType::f64).view()), ls::InvalidArgument);
  d.zero_();
  CHECK(d.data<float>()[1] == 0.0f);

  ls::Tensor moved = std::move(d);
  CHECK(moved.numel() == 6);
}

TEST_CASE("reshape_view shares memory and keeps it alive") {
  ls::Tensor r;
  float* p = nullptr;
  {
    ls::Tensor a = ls::Tensor::full({2, 6}, 1.0);
    p = a.data<float>();
    r = a.reshape_view({3, 4});
    CHECK_THROWS_AS(a.reshape_view({5}), ls::InvalidArgument);
  }
  CHECK(r.shape() == ls::Shape{3, 4});
  CHECK(r.data<float>() == p);
  CHECK(r.data<float>()[11] == 1.0f);  // still readable after the original went away
}

TEST_CASE("TensorView: typed access, slices, view_of") {
  ls::Tensor a = ls::Tensor::from(std::vector<double>{0, 1, 2, 3, 4});
  ls::TensorView v = a.view();
  CHECK(v.numel == 5);
  CHECK(v.nbytes() == 40);
  CHECK(v.as<double>()[3] == 3.0);
  ls::TensorView s = v.slice(1, 3);
  CHECK(s.numel == 3);
  CHECK(s.as<double>()[0] == 1.0);
  CHECK(v.slice(5, 0).numel == 0);
  CHECK_THROWS_AS(v.slice(3, 3), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(-1, 1), ls::InvalidArgument);
  CHECK_THROWS_AS(v.as<float>(), ls::InvalidArgument);
  std::vector<std::int64_t> raw{7, 8};
  ls::TensorView w = ls::view_of(std::span<std::int64_t>(raw));
  CHECK(w.dtype == ls::DType::i64);
  CHECK(w.as<std::int64_t>() == raw.data());
}

TEST_CASE("data<T>() with the wrong type throws InvalidArgument naming both dtypes") {
  ls::Tensor a = ls::Tensor::zeros({4}, ls::DType::f32);
  CHECK_THROWS_AS(a.data<double>(), ls::InvalidArgument);
  CHECK_THROWS_AS(a.data<ls::half>(), ls::InvalidArgument);
  CHECK_THROWS_AS(a.span<std::int32_t>(), ls::InvalidArgument);
  const ls::Tensor& ca = a;
  CHECK_THROWS_AS(ca.data<std::uint8_t>(), ls::InvalidArgument);
  try {
    a.data<std::int64_t>();
    FAIL("no exception");
  } catch (const ls::InvalidArgument& e) {
    std::string msg = e.what();
    CHECK(msg.find("f32") != std::string::npos);
    CHECK(msg.find("i64") != std::string::npos);
    CHECK(msg.find("tensor.") != std::string::npos);  // file:line of the check
  }
  CHECK(a.span<float>().size() == 4);
}

TEST_CASE("bad shapes throw InvalidArgument") {
  CHECK_THROWS_AS(ls::Tensor::zeros({2, -1}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({std::int64_t{1} << 40, std::int64_t{1} << 40}), ls::InvalidArgument);
  CHECK(ls::numel_of({}) == 1);
  CHECK(ls::numel_of({0, std::int64_t{1} << 62, 4}) == 0);
  CHECK(ls::to_string(ls::Shape{2, 3}) == "[2, 3]");
}

#if !LOCKSTEP_HAS_CUDA
TEST_CASE("a cuda device throws NotCompiled in a build without CUDA") {
  const ls::Device gpu = ls::Device::cuda(0);
  CHECK_THROWS_AS(ls::Tensor::zeros({4}, ls::DType::f32, gpu), ls::NotCompiled);
  CHECK_THROWS_AS(ls::Tensor::empty({4}, ls::DType::f32, gpu), ls::NotCompiled);
  CHECK_THROWS_AS(ls::Tensor::full({4}, 1.0, ls::DType::f32, gpu), ls::NotCompiled);
  CHECK_THROWS_AS(ls::Tensor::ones({4}, ls::DType::f32, gpu), ls::NotCompiled);
  CHECK_THROWS_AS(ls::Tensor::zeros({4}).to(gpu), ls::NotCompiled);
  try {
    (void)ls::Tensor::zeros({1}, ls::DType::f32, gpu);
  } catch (const ls::NotCompiled& e) {
    CHECK(std::string(e.what()).find("LOCKSTEP_WITH_CUDA") != std::string::npos);
  }
  // NotCompiled is a lockstep::Error, so one catch covers every Lockstep failure.
  CHECK_THROWS_AS(ls::Tensor::zeros({4}, ls::DType::f32, gpu), ls::Error);
}
#endif

// ---- Moved-from tensors, overflow-proof bounds, aliasing (adversarial cases) ----------------

#if defined(__SANITIZE_ADDRESS__)
#define LSTEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LSTEST_ASAN 1
#endif
#endif
#ifndef LSTEST_ASAN
#define LSTEST_ASAN 0
#endif

namespace {

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();

using lstest::contains;
using lstest::self_move;

// The message of the InvalidArgument that f throws ("" and a failed check if it throws none).
template <class F>
std::string invalid_message(F&& f) {
  std::string m = lstest::error_message<ls::InvalidArgument>(std::forward<F>(f));
  if (m.empty()) FAIL_CHECK("no InvalidArgument thrown");
  return m;
}

// More than glibc's largest mmap threshold (32 MiB), so freeing it unmaps it and a read through
// a dangling pointer faults instead of finding the old bytes.
constexpr std::int64_t kUnmappedOnFree = std::int64_t{12} << 20;  // f32 elements: 48 MiB

}  // namespace

TEST_CASE("a moved-from Tensor is empty and every operation on it is safe", "[tensor][move]") {
  ls::Tensor a = ls::Tensor::full({2, 3}, 1.5, ls::DType::f64);
  const double* p = a.data<double>();
  ls::Tensor b = std::move(a);
  CHECK(b.numel() == 6);
  CHECK(b.data<double>() == p);
  CHECK(b.shape() == ls::Shape{2, 3});

  // The moved-from tensor is exactly a default-constructed one.
  CHECK(a.numel() == 0);
  CHECK(a.nbytes() == 0);
  CHECK(a.raw_data() == nullptr);
  CHECK(a.shape() == ls::Shape{0});
  CHECK(a.ndim() == 1);
  CHECK(a.dtype() == ls::DType::f32);
  CHECK(a.device() == ls::Device::cpu());
  CHECK_FALSE(a.owns_memory());
  CHECK(a.view().data == nullptr);
  CHECK(a.view().numel == 0);

  // The original defect: zero_() on the moved-from tensor wrote over b's memory.
  a.zero_();
  for (double v : b.span<double>()) CHECK(v == 1.5);

  // Every other operation is a no-op on an empty tensor or a clear InvalidArgument.
  CHECK(a.span<float>().empty());
  CHECK(a.data<float>() == nullptr);
  const std::string msg = invalid_message([&] { a.data<double>(); });
  CHECK(contains(msg, "empty"));
  CHECK(contains(msg, "moved from"));
  CHECK(a.clone().numel() == 0);
  CHECK(a.to(ls::Device::cpu()).numel() == 0);
  a.copy_from(ls::Tensor().view());
  CHECK_THROWS_AS(a.copy_from(b.view()), ls::InvalidArgument);
  CHECK_THROWS_AS(a.reshape_view({2, 3}), ls::InvalidArgument);
  CHECK(a.reshape_view({0}).numel() == 0);
  CHECK(a.view().slice(0, 0).numel == 0);
  CHECK_THROWS_AS(a.view().slice(0, 1), ls::InvalidArgument);
  CHECK(ls::bitwise_equal(a, ls::Tensor()));
  CHECK_THROWS_AS(b.copy_from(a.view()), ls::InvalidArgument);
  for (double v : b.span<double>()) CHECK(v == 1.5);

  // Moving a moved-from tensor moves an empty one; the moved-from tensor can be reused.
  ls::Tensor c = std::move(a);
  CHECK(c.numel() == 0);
  CHECK(c.raw_data() == nullptr);
  a = ls::Tensor::full({4}, 2.0);
  CHECK(a.numel() == 4);
  CHECK(a.data<float>()[3] == 2.0f);
}

TEST_CASE("move-assignment onto a live tensor and self-move keep tensors valid", "[tensor][move]") {
  ls::Tensor x = ls::Tensor::full({8}, 1.0);
  ls::Tensor y = ls::Tensor::full({2, 2}, 7.0, ls::DType::f64);
  const void* yp = y.raw_data();
  x = std::move(y);
  CHECK(x.raw_data() == yp);
  CHECK(x.shape() == ls::Shape{2, 2});
  CHECK(x.numel() == 4);
  CHECK(x.dtype() == ls::DType::f64);
  CHECK(x.data<double>()[3] == 7.0);
  CHECK(y.numel() == 0);
  CHECK(y.raw_data() == nullptr);
  CHECK(y.shape() == ls::Shape{0});
  y.zero_();
  CHECK(x.data<double>()[0] == 7.0);

  // A view keeps the old storage of a tensor that is assigned over.
  ls::Tensor big = ls::Tensor::full({kUnmappedOnFree}, 3.0);
  ls::Tensor alias = big.reshape_view({kUnmappedOnFree});
  big = ls::Tensor::zeros({1});
  CHECK(alias.data<float>()[kUnmappedOnFree - 1] == 3.0f);

  // Self-move leaves the tensor as it was (shape, element count, memory, contents).
  self_move(x);
  CHECK(x.raw_data() == yp);
  CHECK(x.shape() == ls::Shape{2, 2});
  CHECK(x.numel() == 4);
  CHECK(x.data<double>()[3] == 7.0);
  ls::Tensor e;
  self_move(e);
  CHECK(e.numel() == 0);
  CHECK(e.shape() == ls::Shape{0});

  // Borrowed tensors move the same way and never free the borrowed memory.
  std::vector<float> mem{1, 2, 3};
  ls::Tensor br = ls::Tensor::borrow(mem.data(), {3}, ls::DType::f32);
  ls::Tensor br2 = std::move(br);
  CHECK(br2.data<float>() == mem.data());
  CHECK(br.raw_data() == nullptr);
  br2 = ls::Tensor();
  CHECK(mem[2] == 3.0f);
  // Inside a vector that reallocates, tensors keep their memory.
  std::vector<ls::Tensor> v;
  v.push_back(ls::Tensor::full({2}, 5.0));
  const void* vp = v[0].raw_data();
  for (int i = 0; i < 64; ++i) v.push_back(ls::Tensor::zeros({1}));
  CHECK(v[0].raw_data() == vp);
  CHECK(v[0].data<float>()[1] == 5.0f);
}

TEST_CASE("slices are bounds-checked without overflow", "[tensor][bounds]") {
  ls::Tensor a = ls::Tensor::from(std::vector<double>{0, 1, 2, 3, 4});
  const ls::TensorView v = a.view();
  CHECK_THROWS_AS(v.slice(5, kMax), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(kMax, 2), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(kMax, kMax), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(1, kMax), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(kMin, 1), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(1, kMin), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(kMin, kMax), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(-1, 1), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(0, -1), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(6, 0), ls::InvalidArgument);
  CHECK_THROWS_AS(v.slice(0, 6), ls::InvalidArgument);
  CHECK(v.slice(5, 0).numel == 0);
  CHECK(v.slice(0, 5).numel == 5);
  CHECK(v.slice(4, 1).as<double>()[0] == 4.0);
  // The message names the offset and count as given (no wrapped sum).
  const std::string msg = invalid_message([&] { (void)v.slice(5, kMax); });
  CHECK(contains(msg, "offset 5"));
  CHECK(contains(msg, "count 9223372036854775807"));
  CHECK(contains(msg, "5 elements"));
  CHECK_FALSE(contains(msg, "-9223372036854775804"));

  // A hand-made view whose size cannot be real is refused, rather than offset * size wrapping.
  ls::TensorView lying{a.raw_data(), kMax, ls::DType::f64, ls::Device::cpu()};
  CHECK_THROWS_AS(lying.slice(kMax - 1, 1), ls::InvalidArgument);
  ls::TensorView negative{a.raw_data(), -5, ls::DType::f32, ls::Device::cpu()};
  CHECK_THROWS_AS(negative.slice(0, 0), ls::InvalidArgument);

  // slice_along: the same checks along a dimension.
  ls::Tensor m = ls::Tensor::zeros({4, 3});
  CHECK_THROWS_AS(ls::slice_along(m, 0, kMax, 2, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(m, 0, 2, kMax, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(m, 0, kMin, 1, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(m, 0, 1, kMin, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(m, 1, kMax, 2, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(m, 1, 2, kMax, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(m, 0, 4, 1, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(m, 2, 0, 1, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(m, -1, 0, 1, true), ls::InvalidArgument);
  CHECK(ls::slice_along(m, 0, 4, 0, true).numel() == 0);
  const std::string along = invalid_message([&] { (void)ls::slice_along(m, 0, kMax, 2, true); });
  CHECK(contains(along, "from 9223372036854775807"));
  CHECK(contains(along, "out of range"));
}

TEST_CASE("slice_along views keep the tensor they slice alive", "[tensor][lifetime]") {
  ls::Tensor rows;
  {
    ls::Tensor t = ls::Tensor::full({kUnmappedOnFree / 4, 4}, 9.0);
    rows = ls::slice_along(t, 0, kUnmappedOnFree / 4 - 2, 2, true);
    CHECK(rows.raw_data() == static_cast<const float*>(t.raw_data()) + (kUnmappedOnFree - 8));
  }
  REQUIRE(rows.shape() == ls::Shape{2, 4});
  CHECK(rows.data<float>()[7] == 9.0f);  // t is gone; its memory is not
  // Zero-size results of shapes whose extents multiply past int64 except for the zero.
  ls::Tensor z = ls::Tensor::empty({0, kMax, kMax});
  CHECK(z.numel() == 0);
  ls::Tensor zs = ls::slice_along(z, 0, 0, 0, true);
  CHECK(zs.shape() == ls::Shape{0, kMax, kMax});
  CHECK(zs.numel() == 0);
  CHECK(ls::slice_along(z, 2, kMax - 3, 3, true).shape() == ls::Shape{0, kMax, 3});
  CHECK(ls::slice_along(z, 1, 5, 1, false).shape() == ls::Shape{0, kMax});
}

TEST_CASE("shapes whose element count or byte size overflows are refused", "[tensor][bounds]") {
  // Element counts: negative extents, products past int64.
  CHECK_THROWS_AS(ls::numel_of({-1}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({kMin}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({2, kMin}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({-2, -3}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({3, -1, 0}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({0, -1}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({kMax, 2}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({2, kMax}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({std::int64_t{1} << 32, std::int64_t{1} << 31}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::numel_of({3037000500, 3037000500}), ls::InvalidArgument);  // just past 2^63
  CHECK(ls::numel_of({3037000499, 3037000499}) == 9223372030926249001);         // just below
  CHECK(ls::numel_of({kMax}) == kMax);
  CHECK(ls::numel_of({kMax, 1, 1}) == kMax);
  // A zero extent anywhere makes zero elements, whatever the other extents (order-independent).
  CHECK(ls::numel_of({kMax, kMax, 0}) == 0);
  CHECK(ls::numel_of({kMax, 0, kMax}) == 0);
  CHECK(ls::numel_of({0, kMax, kMax}) == 0);
  const std::string neg = invalid_message([] { (void)ls::numel_of({4, -2}); });
  CHECK(contains(neg, "[4, -2]"));
  CHECK(contains(neg, "negative"));

  // Byte sizes: element count times element size past what memory can address.
  using ls::DType;
  CHECK_THROWS_AS(ls::Tensor::zeros({kMax}, DType::f16), ls::InvalidArgument);       // 2^64 - 2 bytes
  CHECK_THROWS_AS(ls::Tensor::empty({(std::int64_t{1} << 61) + 1}, DType::f64), ls::InvalidArgument);  // wraps to 8
  CHECK_THROWS_AS(ls::Tensor::zeros({std::int64_t{1} << 61}, DType::f32), ls::InvalidArgument);  // 2^63 bytes
  CHECK_THROWS_AS(ls::Tensor::ones({kMax / 4, 2}, DType::i32), ls::InvalidArgument);  // 2^64 - 8 bytes
  CHECK_THROWS_AS(ls::Tensor::full({kMax}, 1.0, DType::i64), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::Tensor::zeros({kMax, kMax}), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::Tensor::zeros({kMin}), ls::InvalidArgument);
  const std::string big = invalid_message([] { (void)ls::Tensor::zeros({kMax}, DType::f16); });
  CHECK(contains(big, "[9223372036854775807]"));
  CHECK(contains(big, "f16"));
  CHECK(contains(big, "bytes"));
  CHECK(ls::nbytes_of(kMax, DType::u8) == static_cast<std::size_t>(kMax));
  CHECK(ls::nbytes_of(kMax / 8, DType::f64) == static_cast<std::size_t>(kMax / 8) * 8);
  CHECK_THROWS_AS(ls::nbytes_of(kMax / 8 + 1, DType::f64), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::nbytes_of(-1, DType::u8), ls::InvalidArgument);

  // borrow: the same limits, and a null pointer only for zero elements.
  std::vector<float> mem(4);
  CHECK_THROWS_AS(ls::Tensor::borrow(mem.data(), {kMax}, DType::f64), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::Tensor::borrow(mem.data(), {-4}, DType::f32), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::Tensor::borrow(nullptr, {4}, DType::f32), ls::InvalidArgument);
  CHECK(ls::Tensor::borrow(nullptr, {0, kMax}, DType::f32).numel() == 0);

  // reshape_view: products that overflow, negative extents whose product matches.
  ls::Tensor six = ls::Tensor::zeros({6});
  CHECK_THROWS_AS(six.reshape_view({kMax, 2}), ls::InvalidArgument);
  CHECK_THROWS_AS(six.reshape_view({-2, -3}), ls::InvalidArgument);
  CHECK_THROWS_AS(six.reshape_view({-1, 6}), ls::InvalidArgument);
  CHECK_THROWS_AS(six.reshape_view({kMin, kMin}), ls::InvalidArgument);
  CHECK_THROWS_AS(six.reshape_view({std::int64_t{1} << 62, 4, 0}), ls::InvalidArgument);
  CHECK(six.reshape_view({3, 2}).numel() == 6);

  // dim(i) out of range is InvalidArgument naming the shape, not std::out_of_range.
  ls::Tensor m = ls::Tensor::zeros({2, 3});
  CHECK(m.dim(1) == 3);
  const std::string dim = invalid_message([&] { (void)m.dim(2); });
  CHECK(contains(dim, "[2, 3]"));
  CHECK_THROWS_AS(m.dim(static_cast<std::size_t>(-1)), ls::InvalidArgument);
}

#if !LSTEST_ASAN  // ASan aborts on allocations it cannot serve instead of returning null
TEST_CASE("an allocation that cannot be served is a clear lockstep::Error naming the size", "[tensor][bounds]") {
  // 2^62 bytes: within what an int64 and a pointer difference can count, beyond any address
  // space, so the allocation fails whatever the overcommit setting.
  const ls::Shape huge{std::int64_t{1} << 60};
  try {
    (void)ls::Tensor::zeros(huge, ls::DType::f32);
    FAIL("no exception");
  } catch (const ls::Error& e) {
    const std::string msg = e.what();
    CHECK(contains(msg, "4611686018427387904 bytes"));
    CHECK(contains(msg, "[1152921504606846976]"));
    CHECK(contains(msg, "f32"));
    CHECK(contains(msg, "out of memory"));
  }
  CHECK_THROWS_AS(ls::Tensor::empty(huge, ls::DType::f32), ls::Error);
  CHECK_THROWS_AS(ls::Tensor::full(huge, 1.0, ls::DType::f32), ls::Error);
}
#endif

TEST_CASE("copies with null or overlapping sources", "[tensor][alias]") {
  // A null source with elements is refused (it was a memcpy from null).
  CHECK_THROWS_AS(ls::Tensor::from_bytes(nullptr, 4, ls::DType::f32, {4}), ls::InvalidArgument);
  CHECK(ls::Tensor::from_bytes(nullptr, 0, ls::DType::f32, {0}).numel() == 0);
  CHECK_THROWS_AS(ls::Tensor::from_bytes(nullptr, -1, ls::DType::f32, {4}), ls::InvalidArgument);
  ls::Tensor d = ls::Tensor::full({4}, 1.0);
  CHECK_THROWS_AS(d.copy_from(ls::TensorView{nullptr, 4, ls::DType::f32, ls::Device::cpu()}),
                  ls::InvalidArgument);
  CHECK(d.data<float>()[0] == 1.0f);

  // Copying a tensor onto itself, or between overlapping views of one buffer, behaves like
  // memmove (copying through a temporary).
  ls::Tensor a = ls::Tensor::from(std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7});
  a.copy_from(a.view());
  CHECK(a.data<float>()[7] == 7.0f);
  float* base = a.data<float>();
  ls::Tensor lo = ls::Tensor::borrow(base, {6}, ls::DType::f32);
  ls::Tensor hi = ls::Tensor::borrow(base + 2, {6}, ls::DType::f32);
  hi.copy_from(lo.view());  // destination after the source
  CHECK(std::vector<float>(base, base + 8) == std::vector<float>{0, 1, 0, 1, 2, 3, 4, 5});
  lo.copy_from(hi.view());  // destination before the source
  CHECK(std::vector<float>(base, base + 8) == std::vector<float>{0, 1, 2, 3, 4, 5, 4, 5});
}

namespace {
struct TwoLeaves {
  ls::Tensor w, b;
  float lr = 0.5f;
};
LOCKSTEP_FIELDS(TwoLeaves, w, b, lr)

TwoLeaves two_leaves(std::int64_t n) {
  TwoLeaves x;
  x.w = ls::Tensor::full({n}, 2.0);
  x.b = ls::Tensor::full({3}, 4.0);
  return x;
}

bool flat_intact(const ls::Flat<TwoLeaves>& f, std::int64_t n) {
  if (f.buffers().size() != 1) return false;
  const auto* base = static_cast<const float*>(f.buffers()[0].raw_data());
  return f->w.raw_data() == base && f->b.raw_data() == base + n && f->w.numel() == n &&
         f->w.data<float>()[n - 1] == 2.0f && f->b.data<float>()[2] == 4.0f;
}
}  // namespace

TEST_CASE("a moved-from Flat is empty; moves and self-moves keep the tensors valid", "[flat][move]") {
  const TwoLeaves model = two_leaves(5);
  ls::Flat<TwoLeaves> f = ls::flat_copy(model);
  REQUIRE(flat_intact(f, 5));
  ls::Flat<TwoLeaves> g = std::move(f);
  CHECK(flat_intact(g, 5));
  CHECK(f.buffers().empty());
  CHECK(f->w.numel() == 0);
  CHECK(f->w.raw_data() == nullptr);
  CHECK(f->b.raw_data() == nullptr);
  CHECK(ls::tensor_leaves(f).size() == 2);
  f->w.zero_();
  CHECK(flat_intact(g, 5));

  self_move(g);
  CHECK(flat_intact(g, 5));

  ls::Flat<TwoLeaves> h = ls::flat_copy(two_leaves(9));
  h = std::move(g);
  CHECK(flat_intact(h, 5));
  CHECK(g.buffers().empty());
  CHECK(g->w.raw_data() == nullptr);
  f = std::move(h);
  CHECK(flat_intact(f, 5));
}

TEST_CASE("the tensors of a Flat keep its allocations alive", "[flat][lifetime]") {
  const TwoLeaves model = two_leaves(kUnmappedOnFree);
  ls::Flat<TwoLeaves> f = ls::flat_copy(model);
  REQUIRE(flat_intact(f, kUnmappedOnFree));
  // Clearing the buffers, or destroying the Flat, leaves tensors moved out of it valid.
  f.buffers().clear();
  CHECK(f->w.data<float>()[kUnmappedOnFree - 1] == 2.0f);
  ls::Tensor w = std::move(f->w);
  f = ls::Flat<TwoLeaves>();
  CHECK(w.data<float>()[kUnmappedOnFree - 1] == 2.0f);
  // Same for flat_zeros_like.
  ls::Tensor b;
  {
    auto z = ls::flat_zeros_like(model);
    z->b.copy_from(model.b.view());
    b = std::move(z->b);
  }
  CHECK(b.data<float>()[2] == 4.0f);
}

TEST_CASE("invalid dtype values and fill values that an integer dtype cannot hold are refused",
          "[tensor][dtype]") {
  const auto bad = static_cast<ls::DType>(42);
  const std::string msg = invalid_message([&] { (void)ls::Tensor::zeros({2}, bad); });
  CHECK(contains(msg, "invalid DType value 42"));
  std::vector<float> mem(4);
  CHECK_THROWS_AS(ls::Tensor::borrow(mem.data(), {4}, bad), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::nbytes_of(4, bad), ls::InvalidArgument);
  CHECK_THROWS_AS((ls::TensorView{mem.data(), 4, bad, ls::Device::cpu()}.slice(0, 1)), ls::InvalidArgument);

  // Converting NaN, an infinity or an out-of-range double to an integer is undefined behaviour.
  using ls::DType;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (DType t : {DType::i32, DType::i64, DType::u8}) {
    INFO(ls::name(t));
    CHECK_THROWS_AS(ls::Tensor::full({2}, nan, t), ls::InvalidArgument);
    CHECK_THROWS_AS(ls::Tensor::full({2}, inf, t), ls::InvalidArgument);
    CHECK_THROWS_AS(ls::Tensor::full({2}, -inf, t), ls::InvalidArgument);
    CHECK_THROWS_AS(ls::Tensor::full({2}, 1e300, t), ls::InvalidArgument);
  }
  CHECK_THROWS_AS(ls::Tensor::full({1}, 2147483648.0, DType::i32), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::Tensor::full({1}, -2147483649.0, DType::i32), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::Tensor::full({1}, 9223372036854775808.0, DType::i64), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::Tensor::full({1}, -1.0, DType::u8), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::Tensor::full({1}, 256.0, DType::u8), ls::InvalidArgument);
  const std::string fill = invalid_message([] { (void)ls::Tensor::full({1}, 300.0, DType::u8); });
  CHECK(contains(fill, "300"));
  CHECK(contains(fill, "u8"));
  // The extremes that fit, and truncation toward zero as static_cast does.
  CHECK(ls::Tensor::full({1}, 2147483647.0, DType::i32).data<std::int32_t>()[0] == 2147483647);
  CHECK(ls::Tensor::full({1}, -2147483648.9, DType::i32).data<std::int32_t>()[0] == -2147483647 - 1);
  CHECK(ls::Tensor::full({1}, -9223372036854775808.0, DType::i64).data<std::int64_t>()[0] == kMin);
  CHECK(ls::Tensor::full({1}, 255.9, DType::u8).data<std::uint8_t>()[0] == 255);
  CHECK(ls::Tensor::full({1}, -0.9, DType::u8).data<std::uint8_t>()[0] == 0);
  // Floating dtypes take NaN and infinities as values.
  CHECK(std::isnan(ls::Tensor::full({1}, nan, DType::f32).data<float>()[0]));
  CHECK(std::isinf(ls::Tensor::full({1}, inf, DType::f64).data<double>()[0]));
}

TEST_CASE("memory_overlaps: views on one device sharing a byte", "[tensor][alias]") {
  std::vector<float> mem(8);
  auto v = [&](std::int64_t off, std::int64_t n) {
    return ls::TensorView{mem.data() + off, n, ls::DType::f32, ls::Device::cpu()};
  };
  CHECK(ls::memory_overlaps(v(0, 4), v(3, 2)));
  CHECK(ls::memory_overlaps(v(3, 2), v(0, 4)));
  CHECK(ls::memory_overlaps(v(0, 8), v(0, 8)));
  CHECK_FALSE(ls::memory_overlaps(v(0, 4), v(4, 4)));
  CHECK_FALSE(ls::memory_overlaps(v(4, 4), v(0, 4)));
  CHECK_FALSE(ls::memory_overlaps(v(2, 0), v(0, 8)));  // empty views share nothing
  ls::TensorView other_device = v(0, 4);
  other_device.device = ls::Device::cuda(0);
  CHECK_FALSE(ls::memory_overlaps(v(0, 4), other_device));
  // A hand-made view claiming almost all of memory: no wrap-around in the comparison.
  ls::TensorView huge{mem.data(), kMax, ls::DType::f64, ls::Device::cpu()};
  CHECK(ls::memory_overlaps(huge, v(7, 1)));
}

TEST_CASE("flat allocations whose element counts add up past int64 are refused", "[flat][bounds]") {
  // Borrowed tensors can claim any size that fits in addressable memory; two of 2^62 bytes
  // each are 2^63 elements of u8 together: the sum used to overflow (signed: undefined).
  std::vector<std::uint8_t> mem(16);
  std::vector<ls::Tensor> lying;
  lying.push_back(ls::Tensor::borrow(mem.data(), {std::int64_t{1} << 62}, ls::DType::u8));
  lying.push_back(ls::Tensor::borrow(mem.data(), {std::int64_t{1} << 62}, ls::DType::u8));
  const std::string msg = invalid_message([&] { (void)ls::flat_zeros_like(lying); });
  CHECK(contains(msg, "flat allocation"));
  CHECK(contains(msg, "more elements than an int64 can count"));
  CHECK_THROWS_AS(ls::flat_copy(lying), ls::InvalidArgument);
}
