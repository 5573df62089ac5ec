// check_replicas (replicas.hpp): the hashes and descriptions of leaves, and the comparison of
// every leaf's hash across the ranks, naming the first leaf that differs and the odd ranks out.
#include "lockstep/train/replicas.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "comm/rank_list.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep::detail {
namespace {

// The description of a leaf that each rank sends (longer ones are cut).
constexpr int kTextBytes = 480;

void copy_text(char (&dst)[kTextBytes], const std::string& s) {
  std::size_t n = std::min(s.size(), static_cast<std::size_t>(kTextBytes - 1));
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

}  // namespace


std::uint64_t hash_leaf(const Tensor& t) {
  if (!t.device().is_cpu()) return hash_leaf(t.to(Device::cpu()));
  std::uint64_t h = hash_bytes(t.raw_data(), t.nbytes());
  const auto& shape = t.shape();
  h ^= hash_bytes(shape.data(), shape.size() * sizeof(shape[0])) * 31;
  return h ^ (static_cast<std::uint64_t>(t.dtype()) + 1) * 0x9E3779B97F4A7C15ull;
}

std::string describe_scalar(double v, bool floating, std::size_t bytes) {
  std::ostringstream os;
  os << (floating ? "f" : "i") << bytes * 8 << " scalar = " << std::setprecision(17) << v;
  return os.str();
}

std::string describe_long_double(long double v) {
  std::ostringstream os;
  os << "long double scalar = " << std::setprecision(std::numeric_limits<long double>::max_digits10) << v;
  return os.str();
}

std::string describe_leaf(const Tensor& t) {
  if (!t.device().is_cpu()) return describe_leaf(t.to(Device::cpu())) + " (on " + to_string(t.device()) + ")";
  std::ostringstream os;
  os << name(t.dtype()) << " " << to_string(t.shape());
  const std::int64_t shown = std::min<std::int64_t>(t.numel(), 4);
  if (shown > 0) os << " = ";
  os << std::setprecision(9);
  for (std::int64_t i = 0; i < shown; ++i) {
    if (i) os << ", ";
    const void* p = static_cast<const char*>(t.raw_data()) + i * static_cast<std::int64_t>(size_of(t.dtype()));
    switch (t.dtype()) {
      case DType::f32: os << *static_cast<const float*>(p); break;
      case DType::f64: os << *static_cast<const double*>(p); break;
      case DType::f16: os << to_float(*static_cast<const half*>(p)); break;
      case DType::bf16: os << to_float(*static_cast<const bfloat16*>(p)); break;
      case DType::i32: os << *static_cast<const std::int32_t*>(p); break;
      case DType::i64: os << *static_cast<const std::int64_t*>(p); break;
      case DType::u8: os << static_cast<int>(*static_cast<const std::uint8_t*>(p)); break;
    }
  }
  if (t.numel() > shown) os << ", ...";
  return os.str();
}

void compare_replica_hashes(Backend& b, const std::vector<std::uint64_t>& hashes,
                            const std::function<std::string(std::size_t)>& path_of,
                            const std::function<std::string(std::size_t)>& describe) {
  const std::size_t n = hashes.size();
  if (n == 0) return;  // the structure check already agreed that every rank has no leaves
  // Max of each hash and of its complement: min h = ~max ~h, so a leaf agrees iff max == min.
  std::vector<std::int64_t> buf(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    buf[i] = static_cast<std::int64_t>(hashes[i]);
    buf[n + i] = ~static_cast<std::int64_t>(hashes[i]);
  }
  b.allreduce(TensorView{buf.data(), static_cast<std::int64_t>(2 * n), DType::i64, Device::cpu()},
              ReduceOp::max);
  std::size_t first = n, differing = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (buf[i] != ~buf[n + i]) {
      ++differing;
      if (first == n) first = i;
    }
  }
  if (first == n) return;

  // Every rank takes this path. Gather the first differing leaf's hash and description.
  const int size = b.size();
  std::int64_t mine = static_cast<std::int64_t>(hashes[first]);
  std::vector<std::int64_t> all(static_cast<std::size_t>(size));
  b.allgather(TensorView{&mine, 1, DType::i64, Device::cpu()},
              TensorView{all.data(), size, DType::i64, Device::cpu()});
  char text[kTextBytes] = {};
  copy_text(text, describe(first));
  std::vector<char> texts(static_cast<std::size_t>(kTextBytes) * static_cast<std::size_t>(size));
  b.allgather(TensorView{text, kTextBytes, DType::u8, Device::cpu()},
              TensorView{texts.data(), static_cast<std::int64_t>(texts.size()), DType::u8, Device::cpu()});

  std::map<std::int64_t, std::vector<int>> groups;
  for (int r = 0; r < size; ++r) groups[all[r]].push_back(r);
  const std::vector<int>* majority = nullptr;
  for (auto& [h, ranks] : groups)
    if (2 * ranks.size() > static_cast<std::size_t>(size)) majority = &ranks;
  std::vector<int> odd;
  if (majority != nullptr)
    for (int r = 0; r < size; ++r)
      if (std::find(majority->begin(), majority->end(), r) == majority->end()) odd.push_back(r);

  std::string path = path_of(first);
  std::ostringstream os;
  os << "lockstep: check_replicas: the replicas differ at leaf '" << (path.empty() ? "(root)" : path)
     << "' (leaf " << first << " of " << n << "; " << differing << " leaf" << (differing == 1 ? "" : "s")
     << " differ in all)";
  if (!odd.empty()) os << ": " << rank_list(odd) << " disagree" << (odd.size() == 1 ? "s" : "")
                       << " with " << rank_list(*majority);
  else os << ": no majority; " << groups.size() << " different values";
  os << ". Value on each rank:";
  for (int r = 0; r < size; ++r) {
    const char* t = texts.data() + static_cast<std::size_t>(kTextBytes) * static_cast<std::size_t>(r);
    os << "\n  rank " << r << ": " << std::string(t, strnlen(t, kTextBytes));
    if (std::find(odd.begin(), odd.end(), r) != odd.end()) os << "   <-- differs";
  }
  os << rank_suffix();
  throw MismatchError(os.str());
}

}  // namespace lockstep::detail

