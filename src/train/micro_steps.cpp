// The ranks' agreement on the number of micro-steps each reduction holds, at no collective of its
// own. Each rank divides the reduced sum by its own count (finish in bucket_staging.cpp), so
// counts that differ (ls::accumulate called a different number of times per rank, or a cycle of
// accumulation_steps cut short with reduce_bound on one rank) would leave the replicas different
// without a word. One call of every step, the carrier, reduces a trailer of kTrailer elements
// after its own elements, and every rank reads from it whether the counts agree.
//
// The trailer holds two elements per bit of the count: the bit and its complement, each 0 or 1.
// The counts agree exactly when, for every bit, one of the two reduced elements is 0: a bit the
// ranks agree on leaves its other element 0 on every rank, and one they disagree on makes both
// elements positive. This holds under every form the carrier may take (sum or avg, f32 or f64,
// rounded to f16 or bf16 on the 16-bit wire, summed in any order, by any path: shared memory,
// hierarchical, a reduce-scatter's block): a sum of zeros is exactly 0, a sum of nonnegative
// numbers with one of them 1 is at least 1 whatever the rounding (or +inf, past f16's range),
// and a division by the rank count keeps 0 at 0 and a positive value positive. Sums of the counts
// themselves (the count and its square) would be exact only while they fit the significand: on the
// bf16 wire only up to 256.
//
// Which call carries it follows from the sizes alone, the same on every rank (MPI matches
// collectives by count): the step's smallest allreduce, the last slice of a part, copied with the
// trailer into the carrier's buffer and back after, so that the copy costs the least (the buffer
// is a reduce buffer, allocated once at setup: on MPIBackend's shared-memory path the call is
// still reduced where it lies, as flat_zeros_like(backend, ...)'s gradients are); sharded, the
// allreduce of a bucket's tail (fewer than nranks elements) where a bucket has one, else the
// smallest bucket's reduce-scatter, laid out in blocks of its pieces each followed by the trailer
// (a reduce-scatter gives each rank only its own block). There is a carrier only where a count
// can differ: at two or more ranks, when every bucket is of host f32 or f64 gradients (the only
// ones the core accumulates: add_bucket refuses the others, on every micro-step).
//
// Counts that differ are the same verdict on every rank (every rank reads the same reduced
// bits), so every rank then makes one allgather of the counts, on this error path only, to name
// them, and throws MismatchError.
#include "train/reducer_impl.hpp"

#include <algorithm>
#include <cstring>
#include <memory>

#include "comm/rank_list.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep {

using detail::concat;

namespace {
constexpr std::int64_t kTrailer = 64;  // GradientReducer::Impl::Carrier::kTrailer
constexpr std::size_t kCarrierSetupBytes = std::size_t{64} << 20;

template <class T>
void write_trailer(T* p, std::int64_t count) {
  const auto c = static_cast<std::uint64_t>(count);
  for (int bit = 0; bit < kTrailer / 2; ++bit) {
    const bool set = ((c >> bit) & 1u) != 0;
    p[2 * bit] = set ? T(1) : T(0);
    p[2 * bit + 1] = set ? T(0) : T(1);
  }
}

// True if the reduced trailer says that the ranks' counts differ.
template <class T>
bool trailer_differs(const T* p) {
  for (int bit = 0; bit < kTrailer / 2; ++bit)
    if (p[2 * bit] != T(0) && p[2 * bit + 1] != T(0)) return true;
  return false;
}
}  // namespace

std::int64_t GradientReducer::Impl::last_slice(std::int64_t n, std::int64_t step) {
  return n - step * ((n - 1) / step);
}

// The sizes of the parts prepare_parts makes of host bucket b, in order.
std::vector<std::int64_t> GradientReducer::Impl::part_sizes(const Bucket& b) const {
  std::vector<std::int64_t> out;
  if (b.large.empty()) {
    if (b.numel > 0) out.push_back(b.numel);
    return out;
  }
  if (b.small_numel > 0) out.push_back(b.small_numel);
  for (std::size_t j : b.large) out.push_back(leaves[j].numel);
  return out;
}

void GradientReducer::Impl::plan_carrier() {
  static_assert(Carrier::kTrailer == kTrailer);
  carrier = Carrier{};
  // Deterministic mode sums the counts in its own exact collective (they may differ by rank).
  if (nranks < 2 || options.deterministic) return;
  for (const Bucket& b : buckets)
    if (b.numel > 0 && (!b.device.is_cpu() || (b.dtype != DType::f32 && b.dtype != DType::f64))) return;
  std::int64_t best = 0, size = 0;
  DType dtype = DType::f32;
  auto consider = [&](std::int64_t copied, std::size_t bi, std::size_t part, bool rs) {
    if (copied <= 0 || (carrier.used && copied >= best)) return;
    best = copied;
    size = rs ? copied + nranks * kTrailer : copied + kTrailer;
    dtype = buckets[bi].dtype;
    carrier.used = true;
    carrier.bucket = bi;
    carrier.part = part;
    carrier.rs = rs;
  };
  for (std::size_t bi = 0; bi < buckets.size(); ++bi) {
    const Bucket& b = buckets[bi];
    if (b.numel == 0) continue;
    if (sharded) {  // never split (bucket_plan.cpp): one part
      const std::int64_t q = b.numel / nranks;
      consider(b.numel - q * nranks, bi, 0, false);  // the tail's allreduce
      consider(q * nranks, bi, 0, true);
      continue;
    }
    const std::int64_t step = slice_elements(b);
    const std::vector<std::int64_t> sizes = part_sizes(b);
    for (std::size_t p = 0; p < sizes.size(); ++p) consider(last_slice(sizes[p], step), bi, p, false);
  }
  if (!carrier.used) return;
  carrier.size = size;
  carrier.dtype = dtype;
  // A reduce buffer (collective, here in the reducer's setup on every rank): where the backend
  // has one (MPIBackend's shared-memory path), the carried call is reduced where it lies, as the
  // gradients of flat_zeros_like(backend, ...) are. Only up to kCarrierSetupBytes, a decision
  // from the sizes alone: a larger call (a bucket_bytes of gigabytes) gets ordinary memory when
  // it is first carried, so that setup does not hold memory a step may never use.
  const std::size_t bytes = static_cast<std::size_t>(size) * size_of(dtype);
  if (bytes > kCarrierSetupBytes) return;
  std::shared_ptr<void> mem = backend->allocate_reduce_buffer(bytes);
  void* data = mem.get();
  carrier.buf = Tensor::adopt(data, std::move(mem), {size}, dtype, Device::cpu());
}

void GradientReducer::Impl::ensure_carrier_buf() {
  if (carrier.buf.numel() != carrier.size) carrier.buf = Tensor::zeros({carrier.size}, carrier.dtype, Device::cpu());
}

bool GradientReducer::Impl::carries(std::size_t bi, std::size_t part) const {
  return carrier.used && carrier.bucket == bi && carrier.part == part;
}

// The carrier's buffer for an allreduce of `home`: its elements, then the trailer.
TensorView GradientReducer::Impl::carry(TensorView home) {
  ensure_carrier_buf();
  if (carrier.buf.numel() != home.numel + kTrailer || carrier.buf.dtype() != home.dtype)
    throw Error("GradientReducer: internal error: the carried call is not the size planned");
  auto* p = static_cast<std::byte*>(carrier.buf.raw_data());
  std::memcpy(p, home.data, home.nbytes());
  if (home.dtype == DType::f32) write_trailer(reinterpret_cast<float*>(p + home.nbytes()), carrier.count);
  else write_trailer(reinterpret_cast<double*>(p + home.nbytes()), carrier.count);
  carrier.home = home;
  carrier.at = 0;
  carrier.settled = carrier.differ = false;
  return carrier.buf.view();
}

// The carrier's buffer for a reduce-scatter of `whole` (nranks pieces of q elements): each piece
// followed by the trailer, so that each rank's block brings it the reduced trailer. The block of
// this rank is carrier.buf's [at, at + q + kTrailer).
TensorView GradientReducer::Impl::carry_blocks(TensorView whole, std::int64_t q) {
  ensure_carrier_buf();
  const std::int64_t block = q + kTrailer;
  if (carrier.buf.numel() != block * nranks || carrier.buf.dtype() != whole.dtype)
    throw Error("GradientReducer: internal error: the carried reduce-scatter is not the size planned");
  const std::size_t es = size_of(whole.dtype);
  auto* p = static_cast<std::byte*>(carrier.buf.raw_data());
  for (int r = 0; r < nranks; ++r) {
    std::byte* dst = p + static_cast<std::size_t>(r * block) * es;
    std::memcpy(dst, static_cast<const std::byte*>(whole.data) + static_cast<std::size_t>(r * q) * es,
                static_cast<std::size_t>(q) * es);
    if (whole.dtype == DType::f32) write_trailer(reinterpret_cast<float*>(dst + q * es), carrier.count);
    else write_trailer(reinterpret_cast<double*>(dst + q * es), carrier.count);
  }
  carrier.home = whole.slice(my_rank * q, q);
  carrier.at = my_rank * block;
  carrier.settled = carrier.differ = false;
  return carrier.buf.view();
}

// After the carrier's call completed: its reduced elements back home, and the verdict.
void GradientReducer::Impl::settle_carrier() {
  if (carrier.home.numel == 0) return;  // not carried this step
  const std::size_t es = size_of(carrier.home.dtype);
  const auto* p = static_cast<const std::byte*>(carrier.buf.raw_data()) + static_cast<std::size_t>(carrier.at) * es;
  std::memcpy(carrier.home.data, p, carrier.home.nbytes());
  const std::byte* t = p + carrier.home.nbytes();
  carrier.differ = carrier.home.dtype == DType::f32 ? trailer_differs(reinterpret_cast<const float*>(t))
                                                    : trailer_differs(reinterpret_cast<const double*>(t));
  carrier.settled = true;
  carrier.home = {};
}

// After the step's buckets: MismatchError on every rank if the counts differed.
void GradientReducer::Impl::check_micro_steps() {
  if (!carrier.settled) return;
  carrier.settled = false;
  if (!carrier.differ) return;
  const int n = backend->size();
  std::int64_t mine = carrier.count;
  std::vector<std::int64_t> all(static_cast<std::size_t>(n));
  backend->allgather(TensorView{&mine, 1, DType::i64, Device::cpu()},
                     TensorView{all.data(), n, DType::i64, Device::cpu()});
  const auto [lo, hi] = std::minmax_element(all.begin(), all.end());
  std::vector<int> fewest, most;
  for (int r = 0; r < n; ++r) {
    if (all[static_cast<std::size_t>(r)] == *lo) fewest.push_back(r);
    if (all[static_cast<std::size_t>(r)] == *hi) most.push_back(r);
  }
  auto some = [](std::vector<int> ranks) {  // at most 8 named
    const std::size_t more = ranks.size() > 8 ? ranks.size() - 8 : 0;
    ranks.resize(ranks.size() - more);
    return concat(detail::rank_list(ranks), more ? concat(" and ", more, " more") : std::string());
  };
  const std::string summary = concat("fewest ", *lo, " on ", some(fewest), ", most ", *hi, " on ", some(most));
  const std::string counts = detail::rank_values(all, 8);
  accumulated = 0;
  reset_step();
  throw MismatchError(concat("GradientReducer: the ranks reduced different numbers of micro-steps (", counts,
                             "; ", summary, "; accumulation_steps = ", options.accumulation_steps,
                             "); every rank must reduce the same number (ls::accumulate the same number of "
                             "times on every rank before update), or the replicas would differ: each divides "
                             "by its own count. The accumulated gradients were dropped",
                             detail::rank_suffix()));
}

}  // namespace lockstep
