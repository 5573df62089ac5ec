// Gradient-averaging strategies used by bench_gradsync: the raw MPI ones a hand-written
// training loop would use (the references), and the chunked ones Lockstep's DistributedOptimizer
// is measured against. Every strategy leaves each gradient equal to the average over ranks.
#pragma once

#include <mpi.h>

#include <lockstep/lockstep.hpp>

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

namespace bench {

using lockstep::TensorView;

/// x *= s over n floats (vectorised; s = 1/n turns a sum into an average).
inline void scale(float* __restrict__ x, std::int64_t n, float s) {
  for (std::int64_t i = 0; i < n; ++i) x[i] *= s;
}
/// dst = src * s (the unpack of a packed bucket with the averaging folded in).
inline void copy_scaled(float* __restrict__ dst, const float* __restrict__ src, std::int64_t n, float s) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i] * s;
}

inline void raw_allreduce(float* p, std::int64_t n, MPI_Comm comm) {
  MPI_Allreduce(MPI_IN_PLACE, p, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm);
}

/// One MPI_Allreduce per tensor, then scaling while the tensor is still in cache (what Flux.jl
/// and Lux do).
inline void raw_per_tensor(std::span<const TensorView> ts, MPI_Comm comm, float inv) {
  for (const auto& t : ts) {
    raw_allreduce(static_cast<float*>(t.data), t.numel, comm);
    scale(static_cast<float*>(t.data), t.numel, inv);
  }
}

/// Packs consecutive tensors into buckets of at most cap_bytes (a tensor larger than the cap
/// gets a bucket of its own), one MPI_Allreduce per bucket, and unpacks with the scaling folded
/// in. cap_bytes >= total is "pack everything + one allreduce + unpack"; 25 MiB is DDP's default.
inline void raw_pack_buckets(std::span<const TensorView> ts, std::size_t cap_bytes, float* staging,
                             MPI_Comm comm, float inv) {
  std::size_t first = 0;
  while (first < ts.size()) {
    std::size_t last = first;
    std::int64_t n = 0;
    while (last < ts.size() &&
           (last == first || static_cast<std::size_t>(n + ts[last].numel) * 4 <= cap_bytes)) {
      std::memcpy(staging + n, ts[last].data, ts[last].nbytes());
      n += ts[last].numel;
      ++last;
    }
    raw_allreduce(staging, n, comm);
    std::int64_t off = 0;
    for (std::size_t k = first; k < last; ++k) {
      copy_scaled(static_cast<float*>(ts[k].data), staging + off, ts[k].numel, inv);
      off += ts[k].numel;
    }
    first = last;
  }
}

/// Already-flat gradients: MPI_Allreduce in place over consecutive slices of slice_bytes, each
/// scaled right after its reduction. slice_bytes >= total is "one allreduce" (then the scaling
/// is a second pass over the whole buffer); 25 MiB gives DDP-sized buckets without packing.
inline void raw_flat_slices(float* flat, std::int64_t numel, std::size_t slice_bytes, MPI_Comm comm,
                            float inv) {
  const std::int64_t step = std::max<std::int64_t>(1, static_cast<std::int64_t>(slice_bytes / 4));
  for (std::int64_t off = 0; off < numel; off += step) {
    const std::int64_t c = std::min(step, numel - off);
    raw_allreduce(flat + off, c, comm);
    scale(flat + off, c, inv);
  }
}

/// The chunked design proposed for DistributedOptimizer, through Lockstep's own Backend:
/// a tensor of at least direct_bytes is averaged in place in slices of chunk_bytes (no copy);
/// smaller tensors are packed into a staging chunk of chunk_bytes, averaged together and copied
/// back. Every collective then works on a cache-sized piece.
inline void lockstep_chunked(lockstep::Backend& be, std::span<const TensorView> ts, std::size_t chunk_bytes,
                             std::size_t direct_bytes, float* staging) {
  const std::int64_t chunk = std::max<std::int64_t>(1, static_cast<std::int64_t>(chunk_bytes / 4));
  std::vector<const TensorView*> packed;
  std::int64_t fill = 0;
  auto flush = [&] {
    if (fill == 0) return;
    be.allreduce(TensorView{staging, fill, lockstep::DType::f32, lockstep::Device::cpu()},
                 lockstep::ReduceOp::avg);
    std::int64_t off = 0;
    for (const TensorView* t : packed) {
      std::memcpy(t->data, staging + off, t->nbytes());
      off += t->numel;
    }
    packed.clear();
    fill = 0;
  };
  for (const auto& t : ts) {
    if (t.nbytes() >= direct_bytes) {
      for (std::int64_t off = 0; off < t.numel; off += chunk)
        be.allreduce(t.slice(off, std::min(chunk, t.numel - off)), lockstep::ReduceOp::avg);
      continue;
    }
    if (fill + t.numel > chunk) flush();
    std::memcpy(staging + fill, t.data, t.nbytes());
    packed.push_back(&t);
    fill += t.numel;
  }
  flush();
}

}  // namespace bench
