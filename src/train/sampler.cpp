// DistributedDataContainer: every rank the same number of samples (padding, dropping or uneven
// remainders), or its block of every global batch's micro-batches (micro_batch_size), with a
// per-epoch shuffle drawn from a seed every rank shares; micro_batches_of, the deal of
// micro-batches to ranks.
#include "lockstep/train/data.hpp"

#include <algorithm>

#include "comm/rank_list.hpp"
#include "lockstep/train/synchronize.hpp"

namespace lockstep {

using detail::concat;

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
                                                         DataOptions options, std::int64_t data_size)
    : backend_(&backend), rank_(backend.rank()), ranks_(backend.size()), n_(n_samples), options_(options) {
  // Nothing is thrown before every rank has compared its arguments: a rank that threw alone
  // would leave the others waiting in the comparison. Ranks that disagree on the dataset would
  // run different numbers of batches and deadlock later; catch it here, on every rank.
  std::string problem;
  if (n_samples < 0)
    problem = concat("n_samples must be >= 0, got ", n_samples);
  else if (data_size >= 0 && n_samples > data_size)
    problem = concat("n_samples ", n_samples, " is more than the dataset holds (", data_size, ")");
  else if (options.batch_size < 0)
    problem = concat("DataOptions::batch_size must be >= 0 (0: not set), got ", options.batch_size);
  else if (options.global_batch_size < 0)
    problem = concat("DataOptions::global_batch_size must be >= 0 (0: not set), got ", options.global_batch_size);
  else if (options.batch_size > 0 && options.global_batch_size > 0)
    problem = concat("DataOptions: set batch_size (per rank, ", options.batch_size, ") or global_batch_size (",
                     options.global_batch_size, "), not both");
  else if (options.remainder != Remainder::pad && options.remainder != Remainder::drop &&
           options.remainder != Remainder::uneven)
    problem = concat("DataOptions::remainder is not a Remainder (",
                     static_cast<int>(options.remainder), ")");
  else if (options.micro_batch_size < 0)
    problem = concat("DataOptions::micro_batch_size must be >= 0 (0: not set), got ", options.micro_batch_size);
  else if (options.micro_batch_size > 0 && options.global_batch_size == 0)
    problem = concat("DataOptions::micro_batch_size (", options.micro_batch_size,
                     ") needs global_batch_size: micro-batches are cut from global batches");
  else if (options.micro_batch_size > 0 && options.global_batch_size % options.micro_batch_size != 0)
    problem = concat("DataOptions: global_batch_size ", options.global_batch_size,
                     " is not a multiple of micro_batch_size ", options.micro_batch_size,
                     " (a global batch is made of whole micro-batches)");
  else if (options.micro_batch_size > 0 && options.remainder != Remainder::uneven)
    problem = concat("DataOptions::micro_batch_size needs remainder = Remainder::uneven (pad and drop "
                     "depend on the rank count, the micro-batches must not)");
  const char* rem = options.remainder == Remainder::pad      ? "pad"
                    : options.remainder == Remainder::drop   ? "drop"
                    : options.remainder == Remainder::uneven ? "uneven"
                                                             : "invalid";
  const std::string sig =
      concat("n_samples=", n_samples, " shuffle=", options.shuffle, " seed=", options.seed,
             " remainder=", rem, " batch_size=", options.batch_size,
             " global_batch_size=", options.global_batch_size, " drop_last=", options.drop_last, " micro_batch_size=", options.micro_batch_size,
             problem.empty() ? std::string() : concat(" (", problem, ")"));
  detail::check_same_structure(backend, sig, 0, 0, "DistributedDataContainer", [&] {
    return std::vector<detail::StructureEntry>{{"dataset", sig}};
  });
  // Every rank has the same arguments, hence the same problem.
  LOCKSTEP_CHECK_ARG(problem.empty(), "DistributedDataContainer: ", problem);
  rebuild();
}

DistributedDataContainer<void>::DistributedDataContainer(DistributedDataContainer&& other) noexcept
    : backend_(other.backend_),
      rank_(other.rank_),
      ranks_(other.ranks_),
      n_(other.n_),
      epoch_(other.epoch_),
      options_(other.options_),
      indices_(std::move(other.indices_)),
      perm_(std::move(other.perm_)) {
  other.n_ = 0;
  other.epoch_ = 0;
  other.indices_.clear();
  other.perm_.clear();
}

DistributedDataContainer<void>& DistributedDataContainer<void>::operator=(
    DistributedDataContainer&& other) noexcept {
  if (this != &other) {
    backend_ = other.backend_;
    rank_ = other.rank_;
    ranks_ = other.ranks_;
    n_ = other.n_;
    epoch_ = other.epoch_;
    options_ = other.options_;
    indices_ = std::move(other.indices_);
    perm_ = std::move(other.perm_);
    other.n_ = 0;
    other.epoch_ = 0;
    other.indices_.clear();
    other.perm_.clear();
  }
  return *this;
}

void DistributedDataContainer<void>::rebuild() {
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n_));
  for (std::int64_t i = 0; i < n_; ++i) perm[static_cast<std::size_t>(i)] = i;
  if (options_.shuffle && n_ > 1) {
    std::uint64_t s = options_.seed ^ (0xD1B54A32D192ED03ull * (static_cast<std::uint64_t>(epoch_) + 1));
    for (std::int64_t i = n_ - 1; i > 0; --i) {
      const auto j = static_cast<std::int64_t>(bounded(s, static_cast<std::uint64_t>(i + 1)));
      std::swap(perm[static_cast<std::size_t>(i)], perm[static_cast<std::size_t>(j)]);
    }
  }
  if (options_.micro_batch_size > 0) {
    // Micro-batches: keep the whole permutation (micro_batch(b, m) reads any micro-batch), and
    // this rank's samples are its micro-batches of every global batch, in order. Nothing here
    // depends on the rank count but which blocks this rank takes.
    perm_ = std::move(perm);
    indices_.clear();
    const std::int64_t nb = num_batches();
    for (std::int64_t b = 0; b < nb; ++b) {
      const auto rows = batch(b);
      indices_.insert(indices_.end(), rows.begin(), rows.end());
    }
    return;
  }
  std::int64_t per_rank = 0;
  if (n_ > 0) {
    if (options_.remainder == Remainder::pad)
      per_rank = n_ / ranks_ + (n_ % ranks_ != 0);
    else if (options_.remainder == Remainder::drop)
      per_rank = n_ / ranks_;
    else  // uneven: positions rank, rank + ranks, ... below n
      per_rank = n_ / ranks_ + (rank_ < n_ % ranks_ ? 1 : 0);
  }
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
  // Collective: ranks in different epochs would visit different permutations (samples seen
  // twice or never) without any error.
  const int n = backend_->size();
  std::int64_t mine = e;
  std::vector<std::int64_t> all(static_cast<std::size_t>(n));
  backend_->allgather(TensorView{&mine, 1, DType::i64, Device::cpu()},
                      TensorView{all.data(), n, DType::i64, Device::cpu()});
  if (std::any_of(all.begin(), all.end(), [&](std::int64_t v) { return v != all[0]; })) {
    throw MismatchError("DistributedDataContainer::set_epoch: the ranks passed different epochs: " +
                        detail::rank_values(all, 8) + detail::rank_suffix());
  }
  epoch_ = e;
  rebuild();
}

std::int64_t DistributedDataContainer<void>::num_batches(std::int64_t batch_size, bool drop_last) const {
  LOCKSTEP_CHECK_ARG(batch_size > 0, "num_batches: batch_size must be > 0, got ", batch_size);
  // No size() + batch_size - 1: that overflows for a batch_size near the int64 maximum.
  return size() / batch_size + (!drop_last && size() % batch_size != 0 ? 1 : 0);
}

// The number of permutation positions the ranks visit together (the padded, dropped or whole
// dataset), the same on every rank.
std::int64_t DistributedDataContainer<void>::used_positions() const noexcept {
  if (n_ == 0) return 0;
  if (options_.remainder == Remainder::pad) return (n_ / ranks_ + (n_ % ranks_ != 0)) * ranks_;
  if (options_.remainder == Remainder::drop) return n_ / ranks_ * ranks_;
  return n_;
}

std::int64_t DistributedDataContainer<void>::num_batches() const {
  if (options_.global_batch_size > 0) {
    const std::int64_t g = options_.global_batch_size, used = used_positions();
    return used / g + (!options_.drop_last && used % g != 0 ? 1 : 0);
  }
  LOCKSTEP_CHECK_ARG(options_.batch_size > 0, "num_batches(): neither DataOptions::batch_size nor "
                                              "global_batch_size is set; set one, or pass the batch size");
  return num_batches(options_.batch_size, options_.drop_last);
}

std::int64_t DistributedDataContainer<void>::global_rows(std::int64_t b) const {
  LOCKSTEP_CHECK_ARG(options_.global_batch_size > 0, "global_rows: DataOptions::global_batch_size is not set");
  LOCKSTEP_CHECK_ARG(b >= 0 && b < num_batches(), "global_rows: batch ", b, " is out of range (",
                     num_batches(), " global batches)");
  const std::int64_t g = options_.global_batch_size;
  return std::min(g, used_positions() - b * g);
}

std::span<const std::int64_t> DistributedDataContainer<void>::batch(std::int64_t b,
                                                                    std::int64_t batch_size) const {
  // b < ceil(size / batch_size), written without b * batch_size (which can overflow); batch 0
  // of an empty share is the empty span.
  LOCKSTEP_CHECK_ARG(batch_size > 0 && b >= 0 && (b == 0 || b < num_batches(batch_size)),
                     "batch: batch ", b, " of size ", batch_size, " is out of range (", size(),
                     " samples)");
  if (size() == 0) return {};
  const std::int64_t start = b * batch_size;
  const std::int64_t count = std::min(batch_size, size() - start);
  return std::span<const std::int64_t>(indices_).subspan(static_cast<std::size_t>(start),
                                                         static_cast<std::size_t>(count));
}

std::span<const std::int64_t> DistributedDataContainer<void>::batch(std::int64_t b) const {
  if (options_.micro_batch_size > 0) {
    // This rank's micro-batches of global batch b are one contiguous run of positions.
    const MicroBatches mine = micro_batches(b);  // checks b
    if (mine.empty()) return {};
    const std::int64_t g = options_.global_batch_size, m = options_.micro_batch_size;
    const std::int64_t first = b * g + mine.first * m;
    const std::int64_t last = b * g + std::min((mine.first + mine.count) * m, global_rows(b));
    return std::span<const std::int64_t>(perm_).subspan(static_cast<std::size_t>(first),
                                                         static_cast<std::size_t>(last - first));
  }
  if (options_.global_batch_size > 0) {
    const std::int64_t rows = global_rows(b);  // checks b
    // This rank's k-th sample sits at position rank + k ranks: the ones in [b G, b G + rows).
    const std::int64_t first = b * options_.global_batch_size, last = first + rows;
    auto k_from = [&](std::int64_t pos) {  // the first k with rank + k ranks >= pos
      return pos <= rank_ ? 0 : (pos - rank_ + ranks_ - 1) / ranks_;
    };
    const std::int64_t lo = std::min(k_from(first), size()), hi = std::min(k_from(last), size());
    return std::span<const std::int64_t>(indices_).subspan(static_cast<std::size_t>(lo),
                                                            static_cast<std::size_t>(hi - lo));
  }
  LOCKSTEP_CHECK_ARG(options_.batch_size > 0, "batch(b): neither DataOptions::batch_size nor "
                                              "global_batch_size is set; set one, or pass the batch size");
  return batch(b, options_.batch_size);
}

void DistributedDataContainer<void>::check_micro(const char* what) const {
  LOCKSTEP_CHECK_ARG(options_.micro_batch_size > 0, what, ": DataOptions::micro_batch_size is not set");
}

MicroBatches DistributedDataContainer<void>::micro_batches(std::int64_t b) const {
  check_micro("micro_batches");
  const std::int64_t rows = global_rows(b);  // checks b
  const std::int64_t m = options_.micro_batch_size;
  return split_micro_batches(rows / m + (rows % m != 0 ? 1 : 0), rank_, ranks_);
}

std::span<const std::int64_t> DistributedDataContainer<void>::micro_batch(std::int64_t b, std::int64_t m) const {
  check_micro("micro_batch");
  const std::int64_t rows = global_rows(b);  // checks b
  const std::int64_t size = options_.micro_batch_size;
  const std::int64_t total = rows / size + (rows % size != 0 ? 1 : 0);
  LOCKSTEP_CHECK_ARG(m >= 0 && m < total, "micro_batch: micro-batch ", m, " is out of range (global batch ", b,
                     " has ", total, ")");
  const std::int64_t first = b * options_.global_batch_size + m * size;
  const std::int64_t count = std::min(size, rows - m * size);
  return std::span<const std::int64_t>(perm_).subspan(static_cast<std::size_t>(first),
                                                       static_cast<std::size_t>(count));
}

MicroBatches split_micro_batches(std::int64_t count, int rank, int size) {
  LOCKSTEP_CHECK_ARG(count >= 0, "split_micro_batches: count must be >= 0, got ", count);
  LOCKSTEP_CHECK_ARG(size >= 1 && rank >= 0 && rank < size, "split_micro_batches: rank ", rank,
                     " is not in [0, ", size, ")");
  // Contiguous blocks in rank order, the first count % size ranks one longer: the same deal as
  // the partitioners' (batch_partitioner), and every block's start is a function of
  // (count, rank, size) alone.
  const std::int64_t base = count / size, extra = count % size, r = rank;
  return MicroBatches{.first = r * base + std::min(r, extra), .count = base + (r < extra ? 1 : 0), .total = count};
}

MicroBatches micro_batches_of(std::int64_t global_batch, std::int64_t micro_batch, int rank, int size) {
  LOCKSTEP_CHECK_ARG(micro_batch >= 1, "micro_batches_of: the micro-batch must be >= 1 sample, got ", micro_batch);
  LOCKSTEP_CHECK_ARG(global_batch >= 1, "micro_batches_of: the global batch must be >= 1 sample, got ", global_batch);
  LOCKSTEP_CHECK_ARG(global_batch % micro_batch == 0, "micro_batches_of: the global batch ", global_batch,
                     " is not a multiple of the micro-batch ", micro_batch,
                     " (a global batch is made of whole micro-batches)");
  LOCKSTEP_CHECK_ARG(size >= 1 && rank >= 0 && rank < size, "micro_batches_of: rank ", rank,
                     " is not in [0, ", size, ")");
  return split_micro_batches(global_batch / micro_batch, rank, size);
}

}  // namespace lockstep
