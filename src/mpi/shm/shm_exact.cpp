// Deterministic mode's exact sum fused into the shared-memory path (ShmCollectives::exact_sum,
// shm_collectives.hpp). The int64 path (src/train/exact_sum.cpp) folds each rank's values into
// int64 words in memory, allreduces the words (twice the bytes of the values) and converts them
// back; here the values cross the slots as f32, exactly as an f32 allreduce's do, and the
// block's top, the fold, the int64 sum and the conversion happen per block of 64 elements in
// cache (exact::fold_sum_to_f32). Every rank reads every rank's values, so the block's top it
// takes is the max that the int64 path agrees on; integer sums are exact whatever their order;
// so every rank that computes a slice gets the bits of the int64 path.
#include <algorithm>
#include <cstdint>

#include "core/exact_sum_kernels.hpp"
#include "mpi/shm/shm_collectives.hpp"

namespace lockstep::detail {

static_assert(ShmCollectives::kMaxRanks <= exact::kMaxFusedSources, "one source per rank");

bool ShmCollectives::exact_sum(const ExactSumCall& call) {
  const ReduceOp op = call.divisor != 1.0 ? ReduceOp::avg : ReduceOp::sum;
  const CallRecord mine =
      call_record(calls_++, CallKind::exact_sum, call.numel, DType::f32, static_cast<int>(op), -1, true);
  // Whole blocks per slice, so that every slice starts at a block's first element.
  const std::size_t per = slice_bytes_ / sizeof(float) / exact::kBlock * exact::kBlock;
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
  auto use = [&](std::size_t off, std::size_t m) {
    // Every rank's values from its slot, this rank's too (a part may lie in out, which this
    // slice overwrites); the blocks' sums in rank order, which integer sums make irrelevant.
    const std::uint32_t* from[kMaxRanks];
    for (int p = 0; p < size_; ++p) from[p] = reinterpret_cast<const std::uint32_t*>(slot(p, next_));
    const std::uint8_t* tops = call.block_top != nullptr ? call.block_top + off / exact::kBlock : nullptr;
    exact::fold_sum_to_f32(from, size_, static_cast<std::int64_t>(m), tops, call.divisor, call.out + off);
  };
  run_call(mine, static_cast<std::size_t>(call.numel), per, "exact_sum", fill, use);
  exact_sums_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace lockstep::detail
