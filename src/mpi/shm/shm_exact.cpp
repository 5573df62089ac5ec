// Deterministic mode's exact sum fused into the shared-memory path (ShmCollectives::exact_sum,
// shm_collectives.hpp). The int64 path (src/train/exact_sum.cpp) folds each rank's values into
// int64 words in memory, allreduces the words (twice the bytes of the values) and converts them
// back; here the values cross the slots as f32, exactly as an f32 allreduce's do, and the
// block's top, the fold, the exact sum and the conversion happen per block of 64 elements in
// cache (exact::fold_sum_to_f32), each rank for its share of each slice. The rank reducing a
// block reads every rank's values of it, so the block's top it takes is the max that the int64
// path agrees on, and integer sums are exact whatever their order: the bits of the int64 path.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/exact_sum_kernels.hpp"
#include "mpi/shm/shm_collectives.hpp"

namespace lockstep::detail {

static_assert(ShmCollectives::kMaxRanks <= exact::kMaxFusedSources, "one source per rank");

bool ShmCollectives::exact_sum(const ExactSumCall& call) {
  const ReduceOp op = call.divisor != 1.0 ? ReduceOp::avg : ReduceOp::sum;
  const CallRecord mine =
      call_record(calls_++, CallKind::exact_sum, call.numel, DType::f32, static_cast<int>(op), -1, true);
  // A slice of `per` elements (whole blocks, so that every slice and every share starts at a
  // block's first element) holds every rank's values; rank r reduces share r of it (`share`
  // elements, whole blocks, the last share shorter or empty) and puts the result after the values
  // in its slot, from which the other ranks copy it: the fold work divided among the ranks.
  const std::size_t ranks = static_cast<std::size_t>(size_), block = static_cast<std::size_t>(exact::kBlock);
  const std::size_t cap = slice_bytes_ / sizeof(float);
  auto share_of = [&](std::size_t m) { return ((m + ranks - 1) / ranks + block - 1) / block * block; };
  std::size_t per = cap / block * block;
  while (per > 0 && per + share_of(per) > cap) per -= block;
  if (call.numel <= 0 || per == 0) {
    // Agreed first (the header alone), then the same verdict everywhere.
    run_call(mine, 1, 1, "exact_sum", [](char*, std::size_t, std::size_t) {}, [](std::size_t, std::size_t) {});
    return false;
  }
  const ExactSumPart* const parts = call.parts;
  const std::int64_t nparts = call.nparts;
  auto fill = [&](char* dst, std::size_t off, std::size_t m) {
    // This rank's elements [off, off + m), part by part (the parts are disjoint and cover them).
    const std::int64_t lo = static_cast<std::int64_t>(off), hi = static_cast<std::int64_t>(off + m);
    for (std::int64_t j = 0; j < nparts; ++j) {
      const ExactSumPart& part = parts[j];
      const std::int64_t from = std::max(lo, part.at), to = std::min(hi, part.at + part.n);
      if (from < to)
        shm_copy_to_slot(dst + static_cast<std::size_t>(from - lo) * sizeof(float), part.x + (from - part.at),
                         static_cast<std::size_t>(to - from) * sizeof(float));
    }
  };
  // The other ranks' shares of the slice before this one (off, m), from their slots of it: each
  // of them finished that slice before it published this one, and none refills that slot before
  // every rank has finished this one.
  ExactSumWriter out(call.outs, call.nouts);
  bool held = false;
  std::size_t held_off = 0, held_m = 0;
  auto copy_out_held = [&] {
    if (!held) return;
    const std::size_t q = share_of(held_m);
    for (int p = 0; p < size_; ++p) {
      const std::size_t lo = std::min(held_m, static_cast<std::size_t>(p) * q), hi = std::min(held_m, lo + q);
      if (p == rank_ || lo >= hi) continue;
      out.write(static_cast<std::int64_t>(held_off + lo),
                reinterpret_cast<const float*>(slot(p, next_ - 1) + per * sizeof(float)),
                static_cast<std::int64_t>(hi - lo));
    }
    held = false;
  };
  auto use = [&](std::size_t off, std::size_t m) {
    // This rank's share, from every rank's values in the slots (this rank's too: its parts may
    // lie in the result, which this slice overwrites), folded into its slot after the values
    // (for the others) and copied from there into the result while it is in cache.
    const std::size_t q = share_of(m);
    const std::size_t lo = std::min(m, static_cast<std::size_t>(rank_) * q), hi = std::min(m, lo + q);
    if (lo < hi) {
      const std::uint32_t* from[kMaxRanks];
      for (int p = 0; p < size_; ++p) from[p] = reinterpret_cast<const std::uint32_t*>(slot(p, next_)) + lo;
      const std::uint8_t* tops = call.block_top != nullptr ? call.block_top + (off + lo) / block : nullptr;
      float* result = reinterpret_cast<float*>(slot(rank_, next_) + per * sizeof(float));
      exact::fold_sum_to_f32(from, size_, static_cast<std::int64_t>(hi - lo), tops, call.divisor, result);
      out.write(static_cast<std::int64_t>(off + lo), result, static_cast<std::int64_t>(hi - lo));
    }
    copy_out_held();
    held = true;
    held_off = off;
    held_m = m;
  };
  run_call(mine, static_cast<std::size_t>(call.numel), per, "exact_sum", fill, use);
  // One rendezvous more, with no data, for the last slice's shares.
  run_call(mine, 1, 1, "exact_sum", [](char*, std::size_t, std::size_t) {},
           [&](std::size_t, std::size_t) { copy_out_held(); });
  exact_sums_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace lockstep::detail
