// Data partitioning (MPI, 1 to 4 ranks): DistributedDataContainer (equal shares, padding or
// dropping, shared per-epoch shuffle, fewer samples than ranks), the partitioners, and
// parallelize with the weighted mean and the sum on even and uneven splits.
#include <catch2/catch.hpp>

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>

#include "training_common.hpp"

using namespace lstest;

namespace {

// Every rank's indices, gathered (each rank holds the same count).
std::vector<std::int64_t> gather_indices(ls::Backend& b, const std::vector<std::int64_t>& mine) {
  std::vector<std::int64_t> send = mine;
  std::vector<std::int64_t> all(send.size() * static_cast<std::size_t>(b.size()));
  if (!send.empty())
    b.allgather(ls::TensorView{send.data(), static_cast<std::int64_t>(send.size()), ls::DType::i64, ls::Device::cpu()},
                ls::TensorView{all.data(), static_cast<std::int64_t>(all.size()), ls::DType::i64, ls::Device::cpu()});
  return all;
}

std::uint64_t fnv_of(const std::vector<std::int64_t>& v) {
  return ls::detail::fnv1a(v.data(), v.size() * sizeof(std::int64_t));
}

}  // namespace

TEST_CASE("DistributedDataContainer gives every rank the same number of samples", "[data]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  bool ok = true;
  std::string why;
  for (std::int64_t samples : {0, 1, 2, 3, 5, 7, 12, 13}) {
    for (auto rem : {ls::Remainder::pad, ls::Remainder::drop}) {
      for (bool shuffle : {false, true}) {
        ls::DistributedDataContainer c(b, samples, ls::DataOptions{.shuffle = shuffle, .seed = 42, .remainder = rem});
        const std::int64_t want = samples == 0 ? 0
                                  : rem == ls::Remainder::pad ? (samples + n - 1) / n
                                                              : samples / n;
        const std::string tag = "samples " + std::to_string(samples) +
                                (rem == ls::Remainder::pad ? " pad" : " drop") + (shuffle ? " shuffled" : "");
        if (c.size() != want) ok = false, why = tag + ": size " + std::to_string(c.size());
        if (!same_on_all_ranks(b, static_cast<std::uint64_t>(c.size()))) ok = false, why = tag + ": sizes differ";
        auto all = gather_indices(b, c.indices());
        std::set<std::int64_t> distinct(all.begin(), all.end());
        for (auto i : all)
          if (i < 0 || i >= samples) ok = false, why = tag + ": index out of range";
        if (rem == ls::Remainder::pad && samples > 0 &&
            static_cast<std::int64_t>(distinct.size()) != samples)
          ok = false, why = tag + ": padding lost samples";
        if (rem == ls::Remainder::drop && distinct.size() != all.size())
          ok = false, why = tag + ": drop repeated samples";
        // Every epoch's shuffle is the same on every rank and changes with the epoch.
        if (shuffle && samples >= 5) {
          auto e0 = all;
          c.set_epoch(1);
          auto e1 = gather_indices(b, c.indices());
          if (e0 == e1) ok = false, why = tag + ": epoch 1 has the same order as epoch 0";
          c.set_epoch(0);
          if (gather_indices(b, c.indices()) != e0) ok = false, why = tag + ": set_epoch(0) not reproducible";
        }
        if (!same_on_all_ranks(b, fnv_of(all))) ok = false, why = tag + ": ranks see different permutations";
      }
    }
  }
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("DistributedDataContainer over a dataset, batches and mismatches", "[data]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  std::vector<int> dataset(10);
  std::iota(dataset.begin(), dataset.end(), 100);
  ls::DistributedDataContainer c(b, dataset, ls::DataOptions{.shuffle = false});
  bool ok = c.size() == (10 + n - 1) / n;
  for (std::int64_t i = 0; i < c.size(); ++i) ok = ok && c[i] == 100 + c.global_index(i);
  ok = ok && c.num_batches(2) == (c.size() + 1) / 2 && c.num_batches(2, true) == c.size() / 2;
  std::int64_t seen = 0;
  for (std::int64_t k = 0; k < c.num_batches(2); ++k) seen += static_cast<std::int64_t>(c.batch(k, 2).size());
  ok = ok && seen == c.size();
  // A dataset moved in.
  ls::DistributedDataContainer owned(b, std::vector<double>{1.5, 2.5, 3.5});
  ok = ok && owned.size() == (3 + n - 1) / n && owned[0] == 1.5 + owned.global_index(0);
  CHECK(all_ranks(b, ok));

  if (n >= 2) {
    bool threw = false;
    try {
      ls::DistributedDataContainer bad(b, b.rank() == n - 1 ? 11 : 10);
    } catch (const ls::MismatchError& e) {
      threw = std::string(e.what()).find("n_samples") != std::string::npos;
    }
    CHECK(all_ranks(b, threw));
  }
}

TEST_CASE("partitioners split even and uneven batches, also with fewer samples than ranks", "[data]") {
  auto parts = ls::batch_partitioner.partitions(10, 4);
  REQUIRE(parts.size() == 4);
  CHECK(parts[0].count == 3);
  CHECK(parts[1].count == 3);
  CHECK(parts[2].count == 2);
  CHECK(parts[3].count == 2);
  CHECK(parts[3].start == 8);
  CHECK(parts[2].rank == 2);
  auto few = ls::batch_partitioner.partitions(2, 4);
  REQUIRE(few.size() == 2);
  CHECK(few[1].rank == 1);
  auto ex = ls::exclusive_batch_partitioner.partitions(5, 2);
  REQUIRE(ex.size() == 5);
  CHECK(ex[4].rank == 0);
  CHECK(ex[3].rank == 1);
  CHECK_THROWS_AS(ls::dim_partitioner(0, false, false).partitions(4, 2), ls::InvalidArgument);

  ls::Tensor t = ls::Tensor::from(std::vector<float>{0, 1, 2, 3, 4, 5}, {3, 2});
  auto rows = ls::slice_along(t, 0, 1, 2, true);
  CHECK(rows.shape() == ls::Shape{2, 2});
  CHECK(rows.raw_data() == t.data<float>() + 2);  // zero copy
  auto col = ls::slice_along(t, 1, 1, 1, false);
  CHECK(col.shape() == ls::Shape{3});
  CHECK(col.data<float>()[2] == 5);
}

TEST_CASE("parallelize: weighted mean and sum equal the whole-batch values", "[data]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  bool ok = true;
  std::string why;
  for (std::int64_t batch : {1, 2, 3, 5, 8, 13}) {
    // x [batch, 3]: row i holds (i, i^2, 1).
    std::vector<double> xs;
    for (std::int64_t i = 0; i < batch; ++i) xs.insert(xs.end(), {double(i), double(i * i), 1.0});
    ls::Tensor x = ls::Tensor::from(xs, {batch, 3});
    double full_mean[3] = {0, 0, 0};
    for (std::int64_t i = 0; i < batch; ++i)
      for (int k = 0; k < 3; ++k) full_mean[k] += xs[static_cast<std::size_t>(i * 3 + k)] / static_cast<double>(batch);

    // The per-partition result is the mean over its rows; the mean reducer weights by rows.
    auto row_mean = [](const ls::Tensor& part, double offset) {
      ls::Tensor m = ls::Tensor::zeros({3}, ls::DType::f64);
      for (std::int64_t i = 0; i < part.dim(0); ++i)
        for (int k = 0; k < 3; ++k)
          m.data<double>()[k] += part.data<double>()[i * 3 + k] / static_cast<double>(part.dim(0));
      m.data<double>()[0] += offset;
      return m;
    };
    for (auto part : {ls::batch_partitioner, ls::dim_partitioner(0, true, true)}) {
      auto mean = ls::parallelize(b, part, ls::mean_reducer, row_mean);
      ls::Tensor r = mean(x, 0.0);
      for (int k = 0; k < 3; ++k)
        if (std::abs(r.data<double>()[k] - full_mean[k]) > 1e-12 * (1 + std::abs(full_mean[k])))
          ok = false, why = "mean, batch " + std::to_string(batch);
    }
    // Sum of per-sample values (exclusive: one sample per call, the dimension removed), with a
    // structured result.
    auto per_sample = ls::parallelize(b, ls::exclusive_batch_partitioner, ls::sum_reducer,
                                      [](const ls::Tensor& row) {
                                        return std::tuple<double, std::int64_t>{row.data<double>()[1], 1};
                                      });
    auto [total, calls] = per_sample(x);
    double want = 0;
    for (std::int64_t i = 0; i < batch; ++i) want += static_cast<double>(i * i);
    if (total != want || calls != batch) ok = false, why = "sum, batch " + std::to_string(batch);
    // A scalar result through the weighted mean.
    auto scalar_mean = ls::parallelize(b, ls::batch_partitioner, ls::mean_reducer,
                                       [](const ls::Tensor& part) {
                                         double s = 0;
                                         for (std::int64_t i = 0; i < part.dim(0); ++i) s += part.data<double>()[i * 3];
                                         return s / static_cast<double>(part.dim(0));
                                       });
    if (std::abs(scalar_mean(x) - full_mean[0]) > 1e-12 * (1 + full_mean[0]))
      ok = false, why = "scalar mean, batch " + std::to_string(batch);
  }
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("parallelize partitions along another dimension", "[data]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  // x [2, 5]: partition the 5 columns; each call returns the sum of its block.
  ls::Tensor x = ls::Tensor::from(std::vector<float>{1, 2, 3, 4, 5, 10, 20, 30, 40, 50}, {2, 5});
  auto f = ls::parallelize(b, ls::dim_partitioner(1), ls::sum_reducer, [](const ls::Tensor& block) {
    float s = 0;
    for (auto v : block.span<float>()) s += v;
    return s;
  });
  CHECK(all_ranks(b, f(x) == 165.0f));
}

// ---- Overflow in batch arithmetic, moved-from containers (adversarial cases) ----------------

TEST_CASE("batch arithmetic does not overflow with huge batch sizes, batches and epochs", "[data][bounds]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  ls::DistributedDataContainer c(b, 10, ls::DataOptions{.shuffle = true, .seed = 7});
  const std::int64_t s = c.size();  // 10 / ranks, rounded up: at least 3 up to 4 ranks
  REQUIRE(s >= 3);
  CHECK(c.num_batches(kMax) == 1);
  CHECK(c.num_batches(kMax, true) == 0);
  CHECK(c.num_batches(s - 1) == 2);
  CHECK(c.batch(0, kMax).size() == static_cast<std::size_t>(s));
  CHECK_THROWS_AS(c.batch(1, kMax), ls::InvalidArgument);
  CHECK_THROWS_AS(c.batch(kMax, 2), ls::InvalidArgument);
  CHECK_THROWS_AS(c.batch(2, kMax), ls::InvalidArgument);
  CHECK_THROWS_AS(c.batch(kMax, kMax), ls::InvalidArgument);
  CHECK_THROWS_AS(c.batch(-1, 1), ls::InvalidArgument);
  CHECK_THROWS_AS(c.batch(0, std::numeric_limits<std::int64_t>::min()), ls::InvalidArgument);
  CHECK(c.batch(s - 1, 1).size() == 1);
  CHECK_THROWS_AS(c.batch(s, 1), ls::InvalidArgument);
  // The last epoch an int64 can number shuffles like any other (epoch + 1 overflowed).
  c.set_epoch(kMax);
  bool in_range = true;
  for (auto i : c.indices()) in_range = in_range && i >= 0 && i < 10;
  CHECK(in_range);
  CHECK(all_ranks(b, in_range && same_on_all_ranks(b, fnv_of(gather_indices(b, c.indices())))));
}

TEST_CASE("a moved-from DistributedDataContainer holds no samples; self-move keeps it", "[data][move]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  ls::DistributedDataContainer c(b, std::vector<double>{1.5, 2.5, 3.5, 4.5, 5.5}, ls::DataOptions{.shuffle = false});
  const std::int64_t s = c.size();
  REQUIRE(s >= 1);
  auto d = std::move(c);
  CHECK(d.size() == s);
  CHECK(d.total_size() == 5);
  CHECK(d[0] == 1.5 + static_cast<double>(d.global_index(0)));
  CHECK(c.size() == 0);
  CHECK(c.total_size() == 0);
  CHECK_THROWS_AS(c[0], ls::InvalidArgument);
  c.set_epoch(3);  // brings no samples back: it used to index the moved-from (empty) vector
  CHECK(c.size() == 0);
  CHECK_THROWS_AS(c[0], ls::InvalidArgument);
  CHECK(c.num_batches(2) == 0);

  auto& alias = d;
  d = std::move(alias);
  CHECK(d.size() == s);
  CHECK(d.data().size() == 5);
  CHECK(d[0] == 1.5 + static_cast<double>(d.global_index(0)));

  ls::DistributedDataContainer e(b, std::vector<double>{9.0});
  e = std::move(d);
  CHECK(e.total_size() == 5);
  CHECK(e.data().size() == 5);
  CHECK(d.size() == 0);

  // The index-only container is still copyable; a copy is independent.
  ls::DistributedDataContainer idx(b, 6);
  auto copy = idx;
  idx.set_epoch(1);
  CHECK(copy.size() == idx.size());
  CHECK(copy.epoch() == 0);
  CHECK(all_ranks(b, e.total_size() == 5 && c.size() == 0));
}
