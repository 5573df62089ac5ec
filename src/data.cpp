// DistributedDataContainer (equal shares, shared per-epoch shuffle), the dimension partitioner,
// tensor slicing and the cross-rank combination of parallelize's results.
#include "lockstep/data.hpp"

#include <algorithm>
#include <cstring>

#include "lockstep/device_runtime.hpp"
#include "lockstep/synchronize.hpp"

namespace lockstep {

namespace {
// splitmix64: a small generator whose output is the same on every platform, so every rank (and
// every standard library) computes the same permutation from the same seed.
std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, bound) without modulo bias (rejection).
std::uint64_t bounded(std::uint64_t& s, std::uint64_t bound) {
  const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % bound);
  for (;;) {
    const std::uint64_t x = splitmix64(s);
    if (x < limit) return x % bound;
  }
}
}  // namespace

DistributedDataContainer<void>::DistributedDataContainer(Backend& backend, std::int64_t n_samples,
                                                         DataOptions options)
    : rank_(backend.rank()), ranks_(backend.size()), n_(n_samples), options_(options) {
  LOCKSTEP_CHECK_ARG(n_samples >= 0, "DistributedDataContainer: n_samples must be >= 0, got ",
                     n_samples);
  // Ranks that disagree on the dataset would run different numbers of batches and deadlock
  // later; catch it here, on every rank.
  const std::string sig = detail::concat("n_samples=", n_samples, " shuffle=", options.shuffle,
                                         " seed=", options.seed,
                                         " remainder=", options.remainder == Remainder::pad ? "pad" : "drop");
  detail::check_same_structure(backend, sig, 0, 0, "DistributedDataContainer", [&] {
    return std::vector<detail::StructureEntry>{{"dataset", sig}};
  });
  rebuild();
}

DistributedDataContainer<void>::DistributedDataContainer(DistributedDataContainer&& other) noexcept
    : rank_(other.rank_),
      ranks_(other.ranks_),
      n_(other.n_),
      epoch_(other.epoch_),
      options_(other.options_),
      indices_(std::move(other.indices_)) {
  other.n_ = 0;
  other.epoch_ = 0;
  other.indices_.clear();
}

DistributedDataContainer<void>& DistributedDataContainer<void>::operator=(
    DistributedDataContainer&& other) noexcept {
  if (this != &other) {
    rank_ = other.rank_;
    ranks_ = other.ranks_;
    n_ = other.n_;
    epoch_ = other.epoch_;
    options_ = other.options_;
    indices_ = std::move(other.indices_);
    other.n_ = 0;
    other.epoch_ = 0;
    other.indices_.clear();
  }
  return *this;
}

void DistributedDataContainer<void>::rebuild() {
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n_));
  for (std::int64_t i = 0; i < n_; ++i) perm[static_cast<std::size_t>(i)] = i;
  if (options_.shuffle && n_ > 1) {
    // epoch + 1 in unsigned arithmetic: the same value as before for every epoch that did not
    // overflow, and defined for INT64_MAX.
    std::uint64_t s = options_.seed ^ (0xD1B54A32D192ED03ull * (static_cast<std::uint64_t>(epoch_) + 1));
    for (std::int64_t i = n_ - 1; i > 0; --i) {
      const auto j = static_cast<std::int64_t>(bounded(s, static_cast<std::uint64_t>(i + 1)));
      std::swap(perm[static_cast<std::size_t>(i)], perm[static_cast<std::size_t>(j)]);
    }
  }
  std::int64_t per_rank = 0;
  if (n_ > 0) per_rank = options_.remainder == Remainder::pad ? (n_ + ranks_ - 1) / ranks_ : n_ / ranks_;
  indices_.resize(static_cast<std::size_t>(per_rank));
  for (std::int64_t k = 0; k < per_rank; ++k) {
    const std::int64_t pos = rank_ + k * ranks_;  // position in the padded permutation
    indices_[static_cast<std::size_t>(k)] = perm[static_cast<std::size_t>(pos % n_)];
  }
}

std::int64_t DistributedDataContainer<void>::global_index(std::int64_t i) const {
  LOCKSTEP_CHECK_ARG(i >= 0 && i < size(), "DistributedDataContainer: index ", i,
                     " out of range [0, ", size(), ")");
  return indices_[static_cast<std::size_t>(i)];
}

void DistributedDataContainer<void>::set_epoch(std::int64_t e) {
  epoch_ = e;
  rebuild();
}

std::int64_t DistributedDataContainer<void>::num_batches(std::int64_t batch_size, bool drop_last) const {
  LOCKSTEP_CHECK_ARG(batch_size > 0, "num_batches: batch_size must be > 0, got ", batch_size);
  // Rounded up without size() + batch_size - 1, which overflows for a large batch_size.
  return size() / batch_size + (!drop_last && size() % batch_size != 0 ? 1 : 0);
}

std::span<const std::int64_t> DistributedDataContainer<void>::batch(std::int64_t b,
                                                                    std::int64_t batch_size) const {
  // b * batch_size < max(size(), 1), without the product (it overflows for large arguments).
  LOCKSTEP_CHECK_ARG(batch_size > 0 && b >= 0 && b <= (std::max<std::int64_t>(size(), 1) - 1) / batch_size,
                     "batch: batch ", b, " of size ", batch_size, " is out of range (", size(),
                     " samples)");
  const std::int64_t start = b * batch_size;
  const std::int64_t count = std::min(batch_size, size() - start);
  return std::span<const std::int64_t>(indices_).subspan(static_cast<std::size_t>(start),
                                                         static_cast<std::size_t>(std::max<std::int64_t>(count, 0)));
}

std::vector<Partition> DimPartitioner::partitions(std::int64_t batch_size, int ranks) const {
  LOCKSTEP_CHECK_ARG(batch_size >= 0 && ranks > 0, "partitions: bad batch_size ", batch_size,
                     " or ranks ", ranks);
  std::vector<Partition> out;
  if (exclusive) {
    for (std::int64_t i = 0; i < batch_size; ++i)
      out.push_back({i, 1, static_cast<int>(i % ranks)});
    return out;
  }
  LOCKSTEP_CHECK_ARG(keepdim, "dim_partitioner: keepdim = false needs exclusive = true");
  const std::int64_t parts = std::min<std::int64_t>(batch_size, ranks);
  std::int64_t start = 0;
  for (std::int64_t i = 0; i < parts; ++i) {
    const std::int64_t count = batch_size / parts + (i < batch_size % parts ? 1 : 0);
    out.push_back({start, count, static_cast<int>(i)});
    start += count;
  }
  return out;
}

Tensor slice_along(const Tensor& t, int dim, std::int64_t start, std::int64_t count, bool keepdim) {
  LOCKSTEP_CHECK_ARG(dim >= 0 && static_cast<std::size_t>(dim) < t.ndim(), "slice_along: dimension ",
                     dim, " of a tensor of shape ", to_string(t.shape()));
  const std::int64_t extent = t.dim(static_cast<std::size_t>(dim));
  // Compared without adding, so that no sum can overflow.
  LOCKSTEP_CHECK_ARG(start >= 0 && count >= 0 && start <= extent && count <= extent - start,
                     "slice_along: start ", start, " with count ", count,
                     " out of range for dimension ", dim, " of shape ", to_string(t.shape()));
  LOCKSTEP_CHECK_ARG(keepdim || count == 1, "slice_along: keepdim = false needs count 1, got ", count);
  Shape out_shape = t.shape();
  out_shape[static_cast<std::size_t>(dim)] = count;
  if (!keepdim) out_shape.erase(out_shape.begin() + dim);
  // No elements: nothing to point at or copy (and the products of the other extents, which a
  // zero extent no longer bounds, are never formed).
  if (t.numel() == 0 || count == 0) return Tensor(std::move(out_shape), t.dtype(), t.device());
  // Every extent is now >= 1, so each partial product is at most t.numel(): no overflow.
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= t.dim(static_cast<std::size_t>(d));
  for (std::size_t d = static_cast<std::size_t>(dim) + 1; d < t.ndim(); ++d) inner *= t.dim(d);
  if (outer == 1) {
    // Contiguous: a view that shares t's memory and keeps it alive.
    return t.slice_view(start * inner, std::move(out_shape));
  }
  const std::size_t es = size_of(t.dtype());
  Tensor out(std::move(out_shape), t.dtype(), t.device());
  const auto* src = static_cast<const std::byte*>(t.raw_data());
  auto* dst = static_cast<std::byte*>(out.raw_data());
  const std::size_t row = static_cast<std::size_t>(count * inner) * es;
  for (std::int64_t o = 0; o < outer; ++o) {
    const auto* s = src + static_cast<std::size_t>((o * extent + start) * inner) * es;
    auto* d = dst + static_cast<std::size_t>(o) * row;
    if (t.device().is_cpu())
      std::memcpy(d, s, row);
    else
      device_runtime("slice_along").copy(d, t.device(), s, t.device(), row);
  }
  return out;
}

namespace detail {

namespace {
template <class T>
void add_scaled_typed(T* dst, const T* src, std::int64_t n, double w) {
  const T tw = static_cast<T>(w);
  for (std::int64_t i = 0; i < n; ++i) dst[i] += tw * src[i];
}
template <class T>
void add_typed(T* dst, const T* src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}
}  // namespace

void add_scaled(Tensor& dst, const Tensor& src, double weight) {
  LOCKSTEP_CHECK_ARG(dst.numel() == src.numel() && dst.dtype() == src.dtype(),
                     "parallelize: results of different partitions differ: ", name(dst.dtype()), " ",
                     to_string(dst.shape()), " vs ", name(src.dtype()), " ", to_string(src.shape()));
  LOCKSTEP_CHECK_ARG(dst.device().is_cpu() && src.device().is_cpu(),
                     "parallelize: results must be host tensors");
  const auto n = dst.numel();
  switch (dst.dtype()) {
    case DType::f32: add_scaled_typed(dst.data<float>(), src.data<float>(), n, weight); break;
    case DType::f64: add_scaled_typed(dst.data<double>(), src.data<double>(), n, weight); break;
    case DType::i32: add_typed(dst.data<std::int32_t>(), src.data<std::int32_t>(), n); break;
    case DType::i64: add_typed(dst.data<std::int64_t>(), src.data<std::int64_t>(), n); break;
    default:
      throw InvalidArgument(concat("parallelize: results of dtype ", name(dst.dtype()),
                                   " are not supported (f32, f64, i32, i64)"));
  }
}

void reduce_results(Backend& b, std::vector<Tensor*>& tensors, std::vector<double*>& fscalars,
                    std::vector<std::int64_t*>& iscalars, double weight, bool mean) {
  // Floating leaves (and the weight) in one double buffer, integer leaves in one int64 buffer.
  std::vector<double> fb;
  std::vector<std::int64_t> ib;
  bool has_int = !iscalars.empty();
  for (auto* t : tensors) {
    LOCKSTEP_CHECK_ARG(t->device().is_cpu(), "parallelize: results must be host tensors");
    switch (t->dtype()) {
      case DType::f32: for (float v : t->span<float>()) fb.push_back(v); break;
      case DType::f64: for (double v : t->span<double>()) fb.push_back(v); break;
      case DType::i32: has_int = true; for (auto v : t->span<std::int32_t>()) ib.push_back(v); break;
      case DType::i64: has_int = true; for (auto v : t->span<std::int64_t>()) ib.push_back(v); break;
      default:
        throw InvalidArgument(concat("parallelize: results of dtype ", name(t->dtype()),
                                     " are not supported (f32, f64, i32, i64)"));
    }
  }
  LOCKSTEP_CHECK_ARG(!(mean && has_int),
                     "parallelize: mean_reducer needs floating-point results (use sum_reducer)");
  for (auto* f : fscalars) fb.push_back(*f);
  for (auto* i : iscalars) ib.push_back(*i);
  fb.push_back(weight);
  b.allreduce(TensorView{fb.data(), static_cast<std::int64_t>(fb.size()), DType::f64, Device::cpu()},
              ReduceOp::sum);
  if (!ib.empty())
    b.allreduce(TensorView{ib.data(), static_cast<std::int64_t>(ib.size()), DType::i64, Device::cpu()},
                ReduceOp::sum);
  const double total = fb.back();
  const double scale = mean ? 1.0 / total : 1.0;
  std::size_t fi = 0, ii = 0;
  for (auto* t : tensors) {
    switch (t->dtype()) {
      case DType::f32: for (float& v : t->span<float>()) v = static_cast<float>(fb[fi++] * scale); break;
      case DType::f64: for (double& v : t->span<double>()) v = fb[fi++] * scale; break;
      case DType::i32: for (auto& v : t->span<std::int32_t>()) v = static_cast<std::int32_t>(ib[ii++]); break;
      case DType::i64: for (auto& v : t->span<std::int64_t>()) v = ib[ii++]; break;
      default: break;
    }
  }
  for (auto* f : fscalars) *f = fb[fi++] * scale;
  for (auto* i : iscalars) *i = ib[ii++];
}

void share_result_layout(Backend& b, std::vector<Tensor*>& tensors, bool have_result, int root) {
  // Root's layout: count, then per tensor dtype, ndim, extents.
  std::vector<std::int64_t> layout;
  if (b.rank() == root) {
    layout.push_back(static_cast<std::int64_t>(tensors.size()));
    for (auto* t : tensors) {
      layout.push_back(static_cast<std::int64_t>(t->dtype()));
      layout.push_back(static_cast<std::int64_t>(t->ndim()));
      for (auto e : t->shape()) layout.push_back(e);
    }
  }
  std::int64_t len = static_cast<std::int64_t>(layout.size());
  b.broadcast(TensorView{&len, 1, DType::i64, Device::cpu()}, root);
  layout.resize(static_cast<std::size_t>(len));
  b.broadcast(TensorView{layout.data(), len, DType::i64, Device::cpu()}, root);
  std::int64_t failed = 0;
  if (!have_result) {
    if (layout.empty() || layout[0] != static_cast<std::int64_t>(tensors.size())) {
      failed = 1;
    } else {
      std::size_t pos = 1;
      for (auto* t : tensors) {
        const auto dt = static_cast<DType>(layout[pos++]);
        const auto nd = static_cast<std::size_t>(layout[pos++]);
        Shape s(layout.begin() + static_cast<std::ptrdiff_t>(pos),
                layout.begin() + static_cast<std::ptrdiff_t>(pos + nd));
        pos += nd;
        *t = Tensor::zeros(s, dt);
      }
    }
  }
  // Every rank learns whether a rank could not shape its empty result (no rank may leave the
  // others waiting in the reduction).
  b.allreduce(TensorView{&failed, 1, DType::i64, Device::cpu()}, ReduceOp::max);
  if (failed != 0)
    throw InvalidArgument(concat("parallelize: some rank ran no partition (fewer samples than "
                                 "ranks) and its result type has a variable structure (a vector, "
                                 "map or optional of tensors); use a result with fixed structure",
                                 rank_suffix()));
}

}  // namespace detail
}  // namespace lockstep
