// Non-finite gradients (DistributedOptimizer's skip_non_finite): the first NaN or Inf of a list
// of tensors, and the log line of a skipped step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/train/replicas.hpp"

namespace lockstep::detail {
namespace {

// Bit tests rather than std::isfinite: they vectorise, and -ffast-math cannot fold them away.
template <class Bits, Bits kExpMask>
std::int64_t first_bad_bits(const void* data, std::int64_t n) {
  const Bits* p = static_cast<const Bits*>(data);
  // Blocks of 1024: a branch-free OR over the block (vectorised), then a scan of a bad block only.
  for (std::int64_t start = 0; start < n; start += 1024) {
    const std::int64_t end = std::min(n, start + 1024);
    bool bad = false;
    for (std::int64_t i = start; i < end; ++i) bad |= (p[i] & kExpMask) == kExpMask;
    if (!bad) continue;
    for (std::int64_t i = start; i < end; ++i)
      if ((p[i] & kExpMask) == kExpMask) return i;
  }
  return -1;
}

std::int64_t first_bad(const Tensor& t) {
  switch (t.dtype()) {
    case DType::f32: return first_bad_bits<std::uint32_t, 0x7F800000u>(t.raw_data(), t.numel());
    case DType::f64: return first_bad_bits<std::uint64_t, 0x7FF0000000000000ull>(t.raw_data(), t.numel());
    case DType::f16: return first_bad_bits<std::uint16_t, 0x7C00u>(t.raw_data(), t.numel());
    case DType::bf16: return first_bad_bits<std::uint16_t, 0x7F80u>(t.raw_data(), t.numel());
    default: return -1;
  }
}

std::string value_text(const Tensor& t, std::int64_t i) {
  double v = 0;
  const char* p = static_cast<const char*>(t.raw_data()) + i * static_cast<std::int64_t>(size_of(t.dtype()));
  switch (t.dtype()) {
    case DType::f32: v = *reinterpret_cast<const float*>(p); break;
    case DType::f64: v = *reinterpret_cast<const double*>(p); break;
    case DType::f16: v = to_float(*reinterpret_cast<const half*>(p)); break;
    case DType::bf16: v = to_float(*reinterpret_cast<const bfloat16*>(p)); break;
    default: break;
  }
  return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf";
}

}  // namespace

std::size_t first_non_finite(const std::vector<Tensor*>& ts, std::int64_t* element, std::string* value) {
  for (std::size_t k = 0; k < ts.size(); ++k) {
    const Tensor* t = ts[k];
    if (t == nullptr || !is_floating(t->dtype())) continue;
    Tensor host;
    if (!t->device().is_cpu()) {
      host = t->to(Device::cpu());
      t = &host;
    }
    const std::int64_t i = first_bad(*t);
    if (i < 0) continue;
    if (element != nullptr) *element = i;
    if (value != nullptr) *value = value_text(*t, i);
    return k;
  }
  return ts.size();
}

}  // namespace lockstep::detail

namespace lockstep::detail {
void log_skipped_step(Backend& b, std::int64_t step, const std::string& local_bad, const std::string& reduced_path) {
  if (local_bad.empty() && b.rank() != 0) return;
  std::ostringstream os;
  os << "lockstep: rank " << b.rank() << ": optimizer step " << step << " skipped on every rank: ";
  if (!local_bad.empty())
    os << "this rank's gradient " << local_bad << " is not finite";
  else
    os << "the reduced gradient '" << reduced_path
       << "' is not finite (the NaN or Inf came from another rank, whose log names the tensor)";
  std::cerr << os.str() << std::endl;
}
}  // namespace lockstep::detail
