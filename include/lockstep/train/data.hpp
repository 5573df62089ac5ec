// Data partitioning: DistributedDataContainer (every rank gets the same number of samples, with
// a per-epoch shuffle shared by all ranks) and TorchOpt's partitioners and reducers with
// parallelize (every rank runs f on its slice of a batch; the results are combined).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <iterator>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/core/traverse.hpp"

namespace lockstep {

/// What to do with the samples left over when n_samples is not a multiple of the rank count.
enum class Remainder : std::uint8_t {
  pad,   ///< wrap around to the start, so every rank gets ceil(n / ranks) samples (default)
  drop,  ///< drop them, so every rank gets floor(n / ranks) samples
  /// keep every sample exactly once: ranks get floor or ceil(n / ranks) samples, and with
  /// DataOptions::global_batch_size the last global batch is smaller (a rank's share of it may
  /// be empty). -n 1 and -n N then see the same samples in the same global batches.
  uneven,
};

/// Options of DistributedDataContainer.
struct DataOptions {
  bool shuffle = true;            ///< a new permutation each epoch (same on every rank)
  std::uint64_t seed = 0;         ///< shared seed of the shuffle; must be equal on every rank
  Remainder remainder = Remainder::pad;
  /// Samples per batch of num_batches() and batch(b) (0: not set; then pass it to
  /// num_batches(batch_size) and batch(b, batch_size)). Given here, the constructor checks that
  /// every rank has the same, so no rank runs more batches than another.
  std::int64_t batch_size = 0;
  /// Samples per batch of the whole job (0: not set), instead of batch_size: global batch b is
  /// positions [b G, (b+1) G) of the epoch's permutation, and batch(b) hands this rank its rows
  /// of it (every rank's rows together are the global batch, whatever the number of ranks).
  /// global_rows(b) says how many rows the global batch has (fewer in a last partial batch):
  /// divide a summed loss by it, so that N ranks compute what one process computes.
  std::int64_t global_batch_size = 0;
  bool drop_last = false;         ///< num_batches() leaves out a partial last batch
  /// Samples per micro-batch (0: not set), with global_batch_size, which must be a multiple of
  /// it, and Remainder::uneven: micro-batch m of global batch b is positions
  /// [b G + m M, b G + (m+1) M) of the epoch's permutation (M = micro_batch_size; the last of a
  /// partial last global batch may be shorter). Which samples a micro-batch holds depends only
  /// on the seed, the epoch, G and M, never on the rank count; each rank processes a contiguous
  /// block of each global batch's micro-batches (micro_batches(b), micro_batch(b, m)), so the
  /// ranks' counts differ when the count is not a multiple of the rank count, and a rank may have
  /// none. What deterministic training (DistributedOptions::deterministic) needs.
  std::int64_t micro_batch_size = 0;
};

/// The micro-batches of one global batch that one rank processes: the global micro-batch
/// indices [first, first + count) of the global batch's `total` micro-batches. Invariant: over
/// ranks 0..N-1 the blocks are contiguous, in rank order, and cover [0, total) exactly once;
/// the first total % N ranks get one more than the others (30 over 4: 8, 8, 7, 7).
struct MicroBatches {
  std::int64_t first = 0;  ///< global index (within the global batch) of this rank's first
  std::int64_t count = 0;  ///< how many this rank processes (0 possible)
  std::int64_t total = 0;  ///< micro-batches in the global batch, over all ranks

  bool empty() const noexcept { return count == 0; }
  std::int64_t size() const noexcept { return count; }
  /// Global index of this rank's i-th micro-batch.
  std::int64_t operator[](std::int64_t i) const noexcept { return first + i; }
  /// Iterates over the global indices first, first + 1, ..., first + count - 1. (A plain
  /// iterator, not std::ranges::iota_view: clang 14 cannot compile that one with libstdc++ 12.)
  struct Iterator {
    using iterator_category = std::input_iterator_tag;
    using value_type = std::int64_t;
    using difference_type = std::ptrdiff_t;
    using pointer = const std::int64_t*;
    using reference = std::int64_t;
    std::int64_t at = 0;
    std::int64_t operator*() const noexcept { return at; }
    Iterator& operator++() noexcept {
      ++at;
      return *this;
    }
    Iterator operator++(int) noexcept { return {at++}; }
    bool operator==(const Iterator&) const = default;
  };
  Iterator begin() const noexcept { return {first}; }
  Iterator end() const noexcept { return {first + count}; }
  bool operator==(const MicroBatches&) const = default;
};

/// Rank `rank` of `size`'s micro-batches of one global batch of `global_batch` samples cut into
/// micro-batches of `micro_batch` samples (global_batch / micro_batch of them; MicroBatches
/// says how they are dealt). Pure: no communication. InvalidArgument, naming the values, when
/// global_batch or micro_batch is below 1, global_batch is not a multiple of micro_batch,
/// size is below 1 or rank is outside [0, size).
[[nodiscard]] MicroBatches micro_batches_of(std::int64_t global_batch, std::int64_t micro_batch, int rank, int size);

/// The same deal of `count` micro-batches (count >= 0; a partial last global batch has
/// ceil(rows / micro_batch) of them, the last shorter).
[[nodiscard]] MicroBatches split_micro_batches(std::int64_t count, int rank, int size);

template <class Dataset = void>
class DistributedDataContainer;

/// This rank's share of n_samples sample indices. Every rank gets the same number of samples, so
/// no rank runs more batches than another (Flux and Lux deadlock there); with fewer samples than
/// ranks and Remainder::pad, samples are repeated so that every rank still gets one.
/// Rank r gets positions r, r + ranks, r + 2 ranks, ... of the epoch's (padded) permutation;
/// with DataOptions::micro_batch_size instead its micro-batches' positions, contiguous blocks,
/// and the ranks' counts may differ (size() is then this rank's own count).
template <>
class DistributedDataContainer<void> {
 public:
  /// Collective: checks that every rank passes the same n_samples and options
  /// (MismatchError on every rank otherwise). n_samples >= 0, options.batch_size >= 0
  /// (InvalidArgument on every rank otherwise). The backend must outlive the container.
  DistributedDataContainer(Backend& backend, std::int64_t n_samples, DataOptions options = {})
      : DistributedDataContainer(backend, n_samples, options, -1) {}
  DistributedDataContainer(const DistributedDataContainer&) = default;
  DistributedDataContainer& operator=(const DistributedDataContainer&) = default;
  /// A moved-from container holds no samples (size() and total_size() are 0, operator[] and
  /// global_index throw InvalidArgument, set_epoch brings none back); self-move keeps it.
  DistributedDataContainer(DistributedDataContainer&& other) noexcept;
  DistributedDataContainer& operator=(DistributedDataContainer&& other) noexcept;

  /// Number of samples this rank visits per epoch (equal on every rank, except with
  /// DataOptions::micro_batch_size: then this rank's micro-batches' samples).
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(indices_.size()); }
  /// Number of samples in the dataset.
  std::int64_t total_size() const noexcept { return n_; }
  /// Dataset index of this rank's i-th sample in the current epoch.
  std::int64_t global_index(std::int64_t i) const;
  /// This rank's dataset indices for the current epoch.
  const std::vector<std::int64_t>& indices() const noexcept { return indices_; }
  /// Reshuffles for epoch e (the same permutation on every rank; a no-op without shuffle).
  /// Collective (one small allgather): ranks passing different epochs would visit different
  /// permutations, so that is a MismatchError on every rank naming each rank's epoch.
  void set_epoch(std::int64_t e);
  std::int64_t epoch() const noexcept { return epoch_; }
  const DataOptions& options() const noexcept { return options_; }
  /// Number of batches of batch_size samples per epoch (the last may be partial unless
  /// drop_last); equal on every rank when every rank passes the same batch_size (which this
  /// local call cannot check: prefer DataOptions::batch_size and num_batches()).
  std::int64_t num_batches(std::int64_t batch_size, bool drop_last = false) const;
  /// The same with DataOptions::batch_size and drop_last (checked equal on every rank at
  /// construction); InvalidArgument if batch_size was not set.
  std::int64_t num_batches() const;
  /// With DataOptions::global_batch_size: the rows of global batch b (the same on every rank;
  /// less than global_batch_size only in a partial last batch).
  std::int64_t global_rows(std::int64_t b) const;
  /// Dataset indices of batch b (of batch_size samples) of this rank.
  std::span<const std::int64_t> batch(std::int64_t b, std::int64_t batch_size) const;
  /// The same with DataOptions::batch_size, or with DataOptions::global_batch_size this rank's
  /// rows of global batch b (possibly none in a partial last batch with Remainder::uneven).
  /// With DataOptions::micro_batch_size: this rank's micro-batches of global batch b, back to
  /// back (they are contiguous in the permutation), possibly none.
  [[nodiscard]] std::span<const std::int64_t> batch(std::int64_t b) const;
  /// With DataOptions::micro_batch_size: the micro-batches of global batch b this rank
  /// processes (the same on every rank for a given rank and rank count; InvalidArgument
  /// otherwise or for b out of range).
  [[nodiscard]] MicroBatches micro_batches(std::int64_t b) const;
  /// With DataOptions::micro_batch_size: the dataset indices of micro-batch m of global batch
  /// b, for any m in [0, micro_batches(b).total), whichever rank processes it (so a rank can
  /// look at any micro-batch; the span stays valid until set_epoch or a move).
  [[nodiscard]] std::span<const std::int64_t> micro_batch(std::int64_t b, std::int64_t m) const;

  auto begin() const noexcept { return indices_.begin(); }
  auto end() const noexcept { return indices_.end(); }

 protected:
  /// data_size: the number of samples the dataset holds (-1: unknown); n_samples must not
  /// exceed it (checked on every rank together with the options).
  DistributedDataContainer(Backend& backend, std::int64_t n_samples, DataOptions options,
                           std::int64_t data_size);

 private:
  void rebuild();
  std::int64_t used_positions() const noexcept;
  void check_micro(const char* what) const;
  Backend* backend_ = nullptr;
  int rank_ = 0, ranks_ = 1;
  std::int64_t n_ = 0;
  std::int64_t epoch_ = 0;
  DataOptions options_;
  std::vector<std::int64_t> indices_;
  /// With micro_batch_size only: the whole epoch's permutation, which micro_batch(b, m) reads
  /// for any m (a rank's indices_ hold only its own micro-batches). Empty otherwise.
  std::vector<std::int64_t> perm_;
};

/// The same over an indexable dataset (anything with operator[](integer), e.g. std::vector):
/// operator[](i) returns this rank's i-th sample. An lvalue dataset is held by reference, an
/// rvalue is moved in.
template <class Dataset>
class DistributedDataContainer : public DistributedDataContainer<void> {
 public:
  /// n_samples must not exceed data.size() when the dataset has one.
  DistributedDataContainer(Backend& backend, Dataset&& data, std::int64_t n_samples,
                           DataOptions options = {})
      : DistributedDataContainer<void>(backend, n_samples, options, size_of_dataset(data)),
        data_(std::forward<Dataset>(data)) {}
  template <class D = Dataset>
    requires requires(const std::remove_reference_t<D>& d) { d.size(); }
  DistributedDataContainer(Backend& backend, Dataset&& data, DataOptions options = {})
      : DistributedDataContainer<void>(backend, static_cast<std::int64_t>(data.size()), options),
        data_(std::forward<Dataset>(data)) {}

  DistributedDataContainer(const DistributedDataContainer&) = default;
  DistributedDataContainer& operator=(const DistributedDataContainer&) = default;
  DistributedDataContainer(DistributedDataContainer&&) = default;
  /// Self-move keeps the container and its dataset (a dataset's own self-move may empty it).
  DistributedDataContainer& operator=(DistributedDataContainer&& other) noexcept(
      std::is_nothrow_move_assignable_v<Dataset>)
    requires(!std::is_reference_v<Dataset> && std::is_move_assignable_v<Dataset>)
  {
    if (this != &other) {
      DistributedDataContainer<void>::operator=(std::move(other));
      data_ = std::move(other.data_);
    }
    return *this;
  }

  /// This rank's i-th sample of the current epoch.
  decltype(auto) operator[](std::int64_t i) { return data_[global_index(i)]; }
  decltype(auto) operator[](std::int64_t i) const { return data_[global_index(i)]; }
  /// The whole dataset.
  decltype(auto) data() noexcept { return (data_); }

 private:
  static std::int64_t size_of_dataset(const std::remove_reference_t<Dataset>& d) {
    if constexpr (requires { d.size(); })
      return static_cast<std::int64_t>(d.size());
    else
      return -1;
  }
  Dataset data_;
};

DistributedDataContainer(Backend&, std::integral auto) -> DistributedDataContainer<void>;
DistributedDataContainer(Backend&, std::integral auto, DataOptions) -> DistributedDataContainer<void>;
template <class D>
  requires(!std::integral<std::remove_cvref_t<D>>)
DistributedDataContainer(Backend&, D&&) -> DistributedDataContainer<D>;
template <class D>
  requires(!std::integral<std::remove_cvref_t<D>>)
DistributedDataContainer(Backend&, D&&, DataOptions) -> DistributedDataContainer<D>;
template <class D>
  requires(!std::integral<std::remove_cvref_t<D>>)
DistributedDataContainer(Backend&, D&&, std::int64_t) -> DistributedDataContainer<D>;
template <class D>
  requires(!std::integral<std::remove_cvref_t<D>>)
DistributedDataContainer(Backend&, D&&, std::int64_t, DataOptions) -> DistributedDataContainer<D>;

// ---------------------------------------------------------------------------------------------
// Partitioners, reducers, parallelize (after torchopt.distributed)
// ---------------------------------------------------------------------------------------------

/// One partition of a batch: samples [start, start + count) along the partitioned dimension,
/// run by rank `rank`.
struct Partition {
  std::int64_t start = 0;
  std::int64_t count = 0;
  int rank = 0;
};

/// Splits every Tensor argument along dimension `dim`; other arguments go to every partition
/// unchanged. Not exclusive: min(batch, ranks) partitions of nearly equal size, partition i on
/// rank i. Exclusive: one partition per sample, sample i on rank i % ranks. keepdim = false
/// selects (removes the dimension) instead of slicing; meant for exclusive.
struct DimPartitioner {
  int dim = 0;
  bool exclusive = false;
  bool keepdim = true;

  /// The partitions of a batch of batch_size samples over `ranks` ranks.
  std::vector<Partition> partitions(std::int64_t batch_size, int ranks) const;
};

/// TorchOpt's dim_partitioner(dim, exclusive, keepdim).
[[nodiscard]] inline DimPartitioner dim_partitioner(int dim = 0, bool exclusive = false, bool keepdim = true) {
  return DimPartitioner{dim, exclusive, keepdim};
}
/// Slices along dimension 0, one contiguous slice per rank (TorchOpt's batch_partitioner).
inline constexpr DimPartitioner batch_partitioner{0, false, true};
/// One sample per call, dimension 0 removed (TorchOpt's exclusive_batch_partitioner).
inline constexpr DimPartitioner exclusive_batch_partitioner{0, true, false};

/// Combines results as their mean, weighted by the number of samples of each partition, so that
/// it equals the mean over the whole batch even for uneven splits (TorchOpt's mean_reducer takes
/// the unweighted mean of the per-partition results, which is biased when partitions differ in
/// size). Results must be floating-point.
struct MeanReducer {};
/// Combines results as their sum.
struct SumReducer {};
/// Concatenates the results along the partitioned dimension, in partition order (which is sample
/// order), and returns the whole on every rank: for a function with a value per sample (a
/// result shaped by its partition), the result over the whole batch. With keepdim = false
/// (exclusive_batch_partitioner) the per-sample results are stacked along a new dimension at
/// the partitioner's dimension. Results must be (structures of) host tensors, of any dtype,
/// that agree on everything but the partitioned dimension.
struct ConcatReducer {};
inline constexpr MeanReducer mean_reducer{};
inline constexpr SumReducer sum_reducer{};
inline constexpr ConcatReducer concat_reducer{};

/// Part of tensor t along dimension dim: [start, start + count); keepdim = false removes the
/// dimension (count must be 1). A zero-copy view when the part is contiguous (dim 0, or only
/// extents of 1 before dim), which shares t's memory and keeps it alive; a copy otherwise.
[[nodiscard]] Tensor slice_along(const Tensor& t, int dim, std::int64_t start, std::int64_t count, bool keepdim);

namespace detail {

enum class ReducerKind : std::uint8_t { mean, sum, concat };
const char* reducer_name(ReducerKind k) noexcept;

/// Adds `src` (times `weight`) into `dst` elementwise (same structure); floating leaves only
/// are weighted. Tensors: same dtype and numel.
void add_scaled(Tensor& dst, const Tensor& src, double weight);

/// Sums the result leaves across ranks (floating leaves in double, integer leaves in int64, one
/// allreduce each) together with `weight`; divides floating leaves by the total weight when
/// `mean`. Throws InvalidArgument for integer leaves with mean.
void reduce_results(Backend& b, std::vector<Tensor*>& tensors, std::vector<double*>& fscalars,
                    std::vector<std::int64_t*>& iscalars, double weight, bool mean);

/// Broadcasts root's result layout (dtypes and shapes of its tensor leaves) and shapes the
/// tensors of a rank that ran no partition accordingly. Collective among all ranks.
void share_result_layout(Backend& b, std::vector<Tensor*>& tensors, bool have_result, int root);

/// Describes one result of f, for the comparison across partitions and ranks (a walk visitor):
/// `sig` is what must agree (structure, dtypes, shapes; with concat_dim >= 0 that dimension is
/// left out), `text` names the leaves for messages, `concat_problem` the first leaf that
/// concat_reducer cannot concatenate.
class ResultDescriber {
 public:
  /// dim, keepdim: the partitioner's; for_concat: describe for concat_reducer (leave dimension
  /// dim out of the signature when keepdim, and note leaves that cannot be concatenated).
  ResultDescriber(int dim, bool keepdim, bool for_concat)
      : dim_(dim), keepdim_(keepdim), for_concat_(for_concat) {}
  void leaf(const std::string& path, const Tensor& t);
  template <class S>
    requires std::is_arithmetic_v<S>
  void leaf(const std::string& path, const S&) {
    scalar(path, std::is_floating_point_v<S>, std::is_signed_v<S>, sizeof(S));
  }
  void node(const std::string& path, const char* kind, std::size_t n);
  void key(const std::string& path, const std::string& k);

  std::string sig, text, concat_problem;
  std::int64_t tensors = 0, fscalars = 0, iscalars = 0;

 private:
  void scalar(const std::string& path, bool floating, bool is_signed, std::size_t bytes);
  void add_text(const std::string& path, const std::string& desc);
  int dim_;
  bool keepdim_, for_concat_;
  bool text_full_ = false;
};

template <class R>
ResultDescriber describe_result(const R& r, ReducerKind kind, const DimPartitioner& p) {
  ResultDescriber d(p.dim, p.keepdim, kind == ReducerKind::concat);
  PathBuilder path;
  walk<true>(r, d, path);
  return d;
}

/// What one rank did in one call of a parallelized function, before anything is combined.
struct ParallelCall {
  ParallelCall(ReducerKind k, const DimPartitioner& p) : kind(k), partitioner(p) {}
  ReducerKind kind;
  DimPartitioner partitioner;
  std::string args;                  // the arguments' shapes, the partitioner, the reducer
  bool have = false;                 // ran at least one partition
  std::string result_sig, result_text;  // of this rank's first result
  std::size_t first_index = 0;           // its partition
  std::int64_t tensors = 0, fscalars = 0, iscalars = 0;  // leaves of this rank's result
  std::vector<std::int64_t> extents;  // concat: per local partition, per tensor leaf
  std::vector<std::byte> bytes;       // concat: those pieces, back to back
  std::exception_ptr error;           // what this rank threw, if anything
  ErrorKind error_kind = ErrorKind::none;  // its kind, as the ranks send it (text_kind)
  std::string error_text;

  /// Records the exception in flight (call from a catch block).
  void fail(std::exception_ptr e);
  /// Appends a tensor argument's dtype and shape (or a placeholder for other arguments) to args.
  void describe_arg(const Tensor* t);
  /// Records the result of partition `index` (described by d); MismatchError when it does not
  /// agree with this rank's earlier partitions.
  void add_result(const ResultDescriber& d, std::size_t index, const std::vector<Partition>& parts);
  /// concat: appends a tensor leaf of a partition's result.
  void pack(const Tensor& t);
};

/// Collective, one small allgather when all is well: every rank learns whether any rank
/// failed, called with other arguments, or got results of another structure, and then every
/// rank throws the same error (a rank whose own f threw an exception other than Lockstep's
/// rethrows that). Returns every rank's concat payload size.
std::vector<std::int64_t> agree_on_call(Backend& b, const ParallelCall& c);

/// Collective: gathers every rank's concat pieces and assembles, into each of `tensors` (shaped
/// like one partition's result), the concatenation over all partitions in partition order.
void concat_results(Backend& b, const ParallelCall& c, const std::vector<std::int64_t>& sizes,
                    std::vector<Tensor*>& tensors, const std::vector<Partition>& parts);

template <class T>
auto slice_arg(T& arg, const DimPartitioner& p, const Partition& part) {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, Tensor>) {
    return slice_along(arg, p.dim, part.start, part.count, p.keepdim);
  } else {
    return std::ref(arg);
  }
}

/// The one rule of mean_reducer, for parallelize and for remote calls alike: a weighted mean
/// has no integer answer, so every result leaf must be floating point (an f32/f64/bf16/f16
/// tensor or a float/double scalar); an integer leaf is refused with InvalidArgument naming it
/// (use sum_reducer). `what` names the caller ("parallelize", "remote call").
std::string mean_reducer_refusal(const char* what, const std::string& leaf, const std::string& kind);
template <class R>
void check_mean_results(const R& r, const char* what) {
  if constexpr (std::is_arithmetic_v<R>) {
    if constexpr (!std::is_floating_point_v<R>) throw InvalidArgument(mean_reducer_refusal(what, "the result", "an integer scalar"));
  } else {
    for_each_leaf_with_path(r, [&](const std::string& path, const auto& leaf) {
      using L = std::remove_cvref_t<decltype(leaf)>;
      if constexpr (std::is_same_v<L, Tensor>) {
        if (!is_floating(leaf.dtype()))
          throw InvalidArgument(mean_reducer_refusal(what, path, concat("a tensor of ", name(leaf.dtype()))));
      } else if constexpr (!std::is_floating_point_v<L>) {
        throw InvalidArgument(mean_reducer_refusal(what, path, "an integer scalar"));
      }
    });
  }
}

template <class T>
std::int64_t batch_size_of(const T& arg, int dim) {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, Tensor>) {
    LOCKSTEP_CHECK_ARG(dim >= 0 && static_cast<std::size_t>(dim) < arg.ndim(),
                       "parallelize: cannot partition a tensor of shape ", to_string(arg.shape()),
                       " along dimension ", dim);
    return arg.dim(static_cast<std::size_t>(dim));
  } else {
    return -1;
  }
}

template <class R>
void scale_into(R& acc, const R& r, double w, bool first) {
  // acc (+)= w * r, leaf by leaf.
  std::vector<Tensor*> at;
  std::vector<const Tensor*> rt;
  for_each_leaf(acc, [&](auto& l) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(l)>, Tensor>) at.push_back(&l);
  });
  for_each_leaf(r, [&](const auto& l) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(l)>, Tensor>) rt.push_back(&l);
  });
  LOCKSTEP_CHECK_ARG(at.size() == rt.size(), "parallelize: results of different partitions have "
                                             "different structures");
  for (std::size_t i = 0; i < at.size(); ++i) {
    if (first) at[i]->zero_();
    add_scaled(*at[i], *rt[i], w);
  }
  // Scalars: walk both in step.
  std::size_t k = 0;
  std::vector<double> rv;
  for_each_leaf(r, [&](const auto& l) {
    using L = std::remove_cvref_t<decltype(l)>;
    if constexpr (std::is_arithmetic_v<L>) rv.push_back(static_cast<double>(l));
  });
  for_each_leaf(acc, [&](auto& l) {
    using L = std::remove_cvref_t<decltype(l)>;
    if constexpr (std::is_arithmetic_v<L>) {
      const double base = first ? 0.0 : static_cast<double>(l);
      if constexpr (std::is_floating_point_v<L>)
        l = static_cast<L>(base + w * rv.at(k));
      else
        l = static_cast<L>(base + rv.at(k));  // integers are counted, not weighted
      ++k;
    }
  });
}
}  // namespace detail

/// Every rank calls the returned function with the same (whole) batch; each runs f on the
/// partitions the partitioner assigns to it (Tensor arguments sliced, others passed as they
/// are), and the results (a Tensor, an arithmetic scalar, or a traversable structure of them)
/// are combined across ranks by the reducer and returned on every rank. Collective.
///
/// Before combining anything the ranks compare, in one small allgather, what they did: the
/// arguments' shapes and dtypes (hence the batch size), the partitioner, the reducer, the
/// structure of their results (leaves, dtypes, shapes; for concat_reducer all but the
/// partitioned dimension) and whether f or a local check threw. Any difference, or an exception
/// on any rank, is an error on every rank naming each rank's part (MismatchError, or the
/// exception's own type), never a hang or a reduction of mismatched buffers. mean_reducer and
/// sum_reducer need results of one shape on every partition: a value per sample (a result
/// shaped by its partition) needs concat_reducer.
template <class Partitioner, class Reducer, class F>
[[nodiscard]] auto parallelize(Backend& backend, Partitioner partitioner, Reducer /*reducer: a tag*/, F f) {
  static_assert(std::is_same_v<Partitioner, DimPartitioner>,
                "parallelize: the partitioner must be a DimPartitioner (dim_partitioner(...), "
                "batch_partitioner, exclusive_batch_partitioner)");
  static_assert(std::is_same_v<Reducer, MeanReducer> || std::is_same_v<Reducer, SumReducer> ||
                    std::is_same_v<Reducer, ConcatReducer>,
                "parallelize: the reducer must be mean_reducer, sum_reducer or concat_reducer");
  return [&backend, partitioner, f = std::move(f)](auto&&... args) mutable {
    constexpr detail::ReducerKind kKind = std::is_same_v<Reducer, MeanReducer>  ? detail::ReducerKind::mean
                                          : std::is_same_v<Reducer, SumReducer> ? detail::ReducerKind::sum
                                                                                : detail::ReducerKind::concat;
    constexpr bool kMean = kKind == detail::ReducerKind::mean;
    constexpr bool kConcat = kKind == detail::ReducerKind::concat;
    using Result = std::remove_cvref_t<decltype(std::invoke(
        f, detail::slice_arg(args, partitioner, std::declval<const Partition&>())...))>;
    static_assert(std::is_default_constructible_v<Result>,
                  "parallelize: the result type must be default-constructible");
    static_assert(!(kConcat && std::is_arithmetic_v<Result>),
                  "parallelize: concat_reducer concatenates tensors; return a Tensor (a scalar "
                  "per sample: a 0-d or 1-element tensor), or use mean_reducer or sum_reducer");
    detail::ParallelCall call(kKind, partitioner);
    Result acc{};
    std::vector<Partition> parts;
    double weight = 0.0;
    // Everything a rank does alone happens in here; what it throws is reported to every rank
    // by agree_on_call, so that no rank is left waiting in a collective the others never reach.
    try {
      std::int64_t batch = -1;
      bool consistent = true;
      (
          [&](const auto& a) {
            if constexpr (std::is_same_v<std::remove_cvref_t<decltype(a)>, Tensor>)
              call.describe_arg(&a);
            else
              call.describe_arg(nullptr);
            const auto bs = detail::batch_size_of(a, partitioner.dim);
            if (bs < 0) return;
            if (batch >= 0 && bs != batch) consistent = false;
            if (batch < 0) batch = bs;
          }(args),
          ...);
      LOCKSTEP_CHECK_ARG(batch >= 0, "parallelize: no Tensor argument to partition");
      LOCKSTEP_CHECK_ARG(consistent, "parallelize: Tensor arguments differ in size along dimension ",
                         partitioner.dim);
      LOCKSTEP_CHECK_ARG(batch > 0, "parallelize: empty batch");
      parts = partitioner.partitions(batch, backend.size());
      for (std::size_t p = 0; p < parts.size(); ++p) {
        const auto& part = parts[p];
        if (part.rank != backend.rank()) continue;
        Result r = std::invoke(f, detail::slice_arg(args, partitioner, part)...);
        call.add_result(detail::describe_result(r, kKind, partitioner), p, parts);
        if constexpr (kConcat) {
          for_each_tensor(r, [&](const Tensor& t) { call.pack(t); });
          if (!call.have) acc = std::move(r);  // the template of the result's structure
        } else {
          const double w = kMean ? static_cast<double>(part.count) : 1.0;
          if (!call.have) {
            acc = clone_tree(r);
            detail::scale_into(acc, r, w, true);
          } else {
            detail::scale_into(acc, r, w, false);
          }
          weight += w;
        }
        call.have = true;
      }
      for_each_leaf(acc, [&](const auto& l) {
        using L = std::remove_cvref_t<decltype(l)>;
        if constexpr (std::is_same_v<L, Tensor>) ++call.tensors;
        else if constexpr (std::is_floating_point_v<L>) ++call.fscalars;
        else ++call.iscalars;
      });
    } catch (...) {
      call.fail(std::current_exception());
    }
    const auto sizes = detail::agree_on_call(backend, call);
    // From here on every rank holds the same arguments, partitions and result structure.
    std::vector<Tensor*> tensors = tensor_leaves(acc);
    // Ranks without a partition learn the result's shapes from rank 0 (which always has one).
    if (static_cast<std::int64_t>(parts.size()) < backend.size()) {
      detail::share_result_layout(backend, tensors, call.have, 0);
      tensors = tensor_leaves(acc);
    }
    if constexpr (kConcat) {
      detail::concat_results(backend, call, sizes, tensors, parts);
      return acc;
    } else {
      std::vector<double> fvals;
      std::vector<std::int64_t> ivals;
      for_each_leaf(acc, [&](auto& l) {
        using L = std::remove_cvref_t<decltype(l)>;
        if constexpr (std::is_floating_point_v<L>) fvals.push_back(static_cast<double>(l));
        else if constexpr (std::is_arithmetic_v<L>) ivals.push_back(static_cast<std::int64_t>(l));
      });
      std::vector<double*> fptr;
      std::vector<std::int64_t*> iptr;
      for (auto& v : fvals) fptr.push_back(&v);
      for (auto& v : ivals) iptr.push_back(&v);
      detail::reduce_results(backend, tensors, fptr, iptr, weight, kMean);
      std::size_t fi = 0, ii = 0;
      for_each_leaf(acc, [&](auto& l) {
        using L = std::remove_cvref_t<decltype(l)>;
        if constexpr (std::is_floating_point_v<L>) l = static_cast<L>(fvals[fi++]);
        else if constexpr (std::is_arithmetic_v<L>) l = static_cast<L>(ivals[ii++]);
      });
      return acc;
    }
  };
}

}  // namespace lockstep
