// The dimension partitioner (dim_partitioner, batch_partitioner) and slicing a tensor along a
// dimension: what parallelize and the remote calls both split their arguments with.
#include "lockstep/train/data.hpp"

#include <algorithm>
#include <cstring>

#include "lockstep/core/device_runtime.hpp"

namespace lockstep {

using detail::concat;

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
  // count <= extent - start, not start + count <= extent: the sum can overflow.
  LOCKSTEP_CHECK_ARG(start >= 0 && count >= 0 && start <= extent && count <= extent - start,
                     "slice_along: ", count, " elements from ", start, " are out of range for dimension ",
                     dim, " of shape ", to_string(t.shape()));
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

}  // namespace lockstep
