// Helpers shared by the collective tests: element access by dtype, the integer-valued inputs
// every rank contributes, and the expected results computed independently of MPI (by looping
// over the ranks that a run simulates). Integer values keep every sum and product exact in
// every dtype, so results compare bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"

namespace lstest {

namespace ls = lockstep;

inline const std::vector<ls::DType> kAllDTypes = {ls::DType::f16, ls::DType::bf16, ls::DType::f32,
                                                  ls::DType::f64, ls::DType::i32,  ls::DType::i64,
                                                  ls::DType::u8};
inline const std::vector<ls::ReduceOp> kAllOps = {ls::ReduceOp::sum, ls::ReduceOp::prod,
                                                  ls::ReduceOp::min, ls::ReduceOp::max,
                                                  ls::ReduceOp::avg};
inline const std::vector<std::int64_t> kSizes = {0, 1, 7, 1000003};

inline bool op_valid(ls::ReduceOp op, ls::DType t) { return op != ls::ReduceOp::avg || ls::is_floating(t); }
inline bool is_signed(ls::DType t) { return t != ls::DType::u8; }

/// Element i of v as a double.
inline double get(const ls::TensorView& v, std::int64_t i) {
  switch (v.dtype) {
    case ls::DType::f16: return ls::to_float(static_cast<const ls::half*>(v.data)[i]);
    case ls::DType::bf16: return ls::to_float(static_cast<const ls::bfloat16*>(v.data)[i]);
    case ls::DType::f32: return static_cast<const float*>(v.data)[i];
    case ls::DType::f64: return static_cast<const double*>(v.data)[i];
    case ls::DType::i32: return static_cast<const std::int32_t*>(v.data)[i];
    case ls::DType::i64: return static_cast<double>(static_cast<const std::int64_t*>(v.data)[i]);
    case ls::DType::u8: return static_cast<const std::uint8_t*>(v.data)[i];
  }
  return 0;
}

/// Sets element i of v to x (x must be representable in v's dtype).
inline void set(const ls::TensorView& v, std::int64_t i, double x) {
  switch (v.dtype) {
    case ls::DType::f16: static_cast<ls::half*>(v.data)[i] = ls::to_half(static_cast<float>(x)); break;
    case ls::DType::bf16: static_cast<ls::bfloat16*>(v.data)[i] = ls::to_bfloat16(static_cast<float>(x)); break;
    case ls::DType::f32: static_cast<float*>(v.data)[i] = static_cast<float>(x); break;
    case ls::DType::f64: static_cast<double*>(v.data)[i] = x; break;
    case ls::DType::i32: static_cast<std::int32_t*>(v.data)[i] = static_cast<std::int32_t>(x); break;
    case ls::DType::i64: static_cast<std::int64_t*>(v.data)[i] = static_cast<std::int64_t>(x); break;
    case ls::DType::u8: static_cast<std::uint8_t*>(v.data)[i] = static_cast<std::uint8_t>(x); break;
  }
}

/// What rank r contributes at element i for a reduction with op: small integers, so that the
/// combination over up to 4 ranks is exact in every dtype (u8 and bf16 included), and negative
/// values where the dtype has them, so a signed/unsigned mix-up shows in min and max.
inline double input(ls::ReduceOp op, ls::DType t, int r, std::int64_t i) {
  switch (op) {
    case ls::ReduceOp::sum:
    case ls::ReduceOp::avg: return static_cast<double>(i % 5 + r);
    case ls::ReduceOp::prod: return static_cast<double>(1 + (i + r) % 2);
    case ls::ReduceOp::min:
    case ls::ReduceOp::max: return static_cast<double>((i * 7 + r * 3) % 11) - (is_signed(t) ? 5 : 0);
  }
  return 0;
}

/// The reduction of input(op, t, r, i) over r = 0..n-1, computed here rather than by MPI.
inline double expected(ls::ReduceOp op, ls::DType t, int n, std::int64_t i) {
  double acc = input(op, t, 0, i);
  for (int r = 1; r < n; ++r) {
    double x = input(op, t, r, i);
    switch (op) {
      case ls::ReduceOp::sum:
      case ls::ReduceOp::avg: acc += x; break;
      case ls::ReduceOp::prod: acc *= x; break;
      case ls::ReduceOp::min: acc = x < acc ? x : acc; break;
      case ls::ReduceOp::max: acc = x > acc ? x : acc; break;
    }
  }
  return op == ls::ReduceOp::avg ? acc / n : acc;
}

/// What a broadcast root holds at element i (fits u8 and is exact in bf16).
inline double bcast_value(int root, std::int64_t i) { return static_cast<double>((i * 13 + root * 7) % 100); }
/// A value other ranks hold before a broadcast or that must survive untouched.
inline double sentinel(int r, std::int64_t i) { return static_cast<double>(101 + (i + r) % 50); }

/// Collects mismatches of one run; reports the first few.
class Failures {
 public:
  /// Compares v[i] with want(i) for every i; records the first mismatch under `what`.
  template <class Want>
  void expect(const std::string& what, const ls::TensorView& v, Want&& want) {
    std::int64_t bad = 0, first = -1;
    double got_first = 0, want_first = 0;
    for (std::int64_t i = 0; i < v.numel; ++i) {
      double g = get(v, i), w = want(i);
      if (g != w) {
        if (bad++ == 0) {
          first = i;
          got_first = g;
          want_first = w;
        }
      }
    }
    ++checked_;
    if (bad != 0) {
      std::ostringstream os;
      os << what << ": " << bad << " of " << v.numel << " elements wrong; first at " << first
         << ": got " << got_first << ", expected " << want_first;
      messages_.push_back(os.str());
    }
  }
  /// Bitwise comparison of got with want (same dtype and numel); on a mismatch, the
  /// element-wise report of expect(). Exact results make bitwise comparison the right one.
  void expect_same(const std::string& what, const ls::TensorView& got, const ls::TensorView& want) {
    if (got.numel != want.numel || got.dtype != want.dtype) {
      fail(what + ": wrong numel or dtype");
      return;
    }
    if (got.nbytes() == 0 || std::memcmp(got.data, want.data, got.nbytes()) == 0) {
      ++checked_;
      return;
    }
    expect(what, got, [&](std::int64_t i) { return get(want, i); });
  }
  void fail(const std::string& msg) { messages_.push_back(msg); }
  bool ok() const { return messages_.empty(); }
  int checked() const { return checked_; }
  std::string report() const {
    std::ostringstream os;
    os << messages_.size() << " failures";
    for (std::size_t k = 0; k < messages_.size() && k < 10; ++k) os << "\n  " << messages_[k];
    return os.str();
  }

 private:
  std::vector<std::string> messages_;
  int checked_ = 0;
};

/// A tensor of n elements of dtype t with element i = value(i).
template <class Value>
ls::Tensor make(ls::DType t, std::int64_t n, Value&& value) {
  ls::Tensor x({n}, t);
  for (std::int64_t i = 0; i < n; ++i) set(x, i, value(i));
  return x;
}

/// Like make(), for a value(i) periodic in i with the given period: computes one period and
/// copies it (doubling), which keeps building the million-element cases cheap next to the
/// collectives under test.
template <class Value>
ls::Tensor make_periodic(ls::DType t, std::int64_t n, std::int64_t period, Value&& value) {
  ls::Tensor x({n}, t);
  const std::int64_t first = n < period ? n : period;
  for (std::int64_t i = 0; i < first; ++i) set(x, i, value(i));
  auto* p = static_cast<char*>(x.raw_data());
  const std::size_t es = ls::size_of(t);
  // [0, filled) always holds whole periods, so copying its start continues the pattern.
  for (std::int64_t filled = first; filled < n;) {
    const std::int64_t c = filled < n - filled ? filled : n - filled;
    std::memcpy(p + filled * es, p, static_cast<std::size_t>(c) * es);
    filled += c;
  }
  return x;
}
/// input() and expected() repeat every kInputPeriod elements (5, 2 and 11 divide it);
/// bcast_value() every 100, sentinel() every 50.
inline constexpr std::int64_t kInputPeriod = 110;
inline constexpr std::int64_t kBcastPeriod = 100;
inline constexpr std::int64_t kSentinelPeriod = 50;

/// "allreduce f16 sum n=7 in-place".
inline std::string label(const char* coll, ls::DType t, const char* op, std::int64_t n, const char* mode) {
  std::ostringstream os;
  os << coll << " " << ls::name(t) << " " << op << " n=" << n << " " << mode;
  return os.str();
}

}  // namespace lstest
