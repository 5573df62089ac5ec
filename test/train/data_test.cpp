// Data partitioning (MPI, 1 to 4 ranks): DistributedDataContainer (equal shares, padding or
// dropping, shared per-epoch shuffle, fewer samples than ranks), the partitioners, and
// parallelize with the weighted mean and the sum on even and uneven splits.
#include <catch2/catch.hpp>

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>

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

std::uint64_t hash_of(const std::vector<std::int64_t>& v) {
  return ls::detail::hash_bytes(v.data(), v.size() * sizeof(std::int64_t));
}

// Runs f; "" if it returns, else the exception's kind and message ("MismatchError: ...").
template <class F>
std::string thrown_by(F&& f) {
  try {
    f();
    return "";
  } catch (const ls::InvalidArgument& e) {
    return std::string("InvalidArgument: ") + e.what();
  } catch (const ls::MismatchError& e) {
    return std::string("MismatchError: ") + e.what();
  } catch (const ls::Error& e) {
    return std::string("Error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("std::exception: ") + e.what();
  }
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// x [batch, 3], row i = (i, i^2, 1), f64.
ls::Tensor rows_tensor(std::int64_t batch) {
  std::vector<double> xs;
  for (std::int64_t i = 0; i < batch; ++i) xs.insert(xs.end(), {double(i), double(i * i), 1.0});
  return ls::Tensor::from(xs, {batch, 3});
}

// Samples in partition i of a contiguous split of batch over n ranks.
std::int64_t part_size(std::int64_t batch, int n, int i) {
  const std::int64_t parts = std::min<std::int64_t>(batch, n);
  return i < parts ? batch / parts + (i < batch % parts ? 1 : 0) : 0;
}

// A correct call after an error: the ranks are still in step and the backend works.
bool still_usable(ls::Backend& b) {
  auto f = ls::parallelize(b, ls::exclusive_batch_partitioner, ls::sum_reducer,
                           [](const ls::Tensor& row) { return row.data<double>()[1]; });
  return f(rows_tensor(6)) == 55.0;  // 0 + 1 + 4 + 9 + 16 + 25
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
        if (!same_on_all_ranks(b, hash_of(all))) ok = false, why = tag + ": ranks see different permutations";
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

TEST_CASE("parallelize: results shaped per partition are a MismatchError on every rank with mean and sum",
          "[data][agreement]") {
  // The defect: f returns a value per sample, so its result has as many elements as the
  // partition; mean_reducer and sum_reducer allreduced buffers of different sizes (MpiError on
  // one rank, garbage on the others). Now every rank throws, naming each rank's shape.
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  bool ok = true;
  std::string why;
  auto per_sample = [](const ls::Tensor& part) {
    ls::Tensor out = ls::Tensor::zeros({part.dim(0)}, ls::DType::f64);
    for (std::int64_t i = 0; i < part.dim(0); ++i) out.data<double>()[i] = 2 * part.data<double>()[i * 3];
    return out;
  };
  auto check = [&](auto reducer, const char* name) {
    for (std::int64_t batch : {5, 7, 13}) {  // uneven at 2, 3 and 4 ranks
      const ls::Tensor x = rows_tensor(batch);
      auto g = ls::parallelize(b, ls::batch_partitioner, reducer, per_sample);
      const std::string err = thrown_by([&] { (void)g(x); });
      const std::string tag = std::string(name) + ", batch " + std::to_string(batch) + ": ";
      if (n == 1) {
        if (!err.empty()) ok = false, why = tag + err;  // one partition: nothing to disagree on
        continue;
      }
      bool named = has(err, "MismatchError: parallelize: the ranks' results differ") &&
                   has(err, "needs concat_reducer");
      for (int r = 0; r < n; ++r)
        named = named && has(err, "rank " + std::to_string(r) + ": f64 [" +
                                      std::to_string(part_size(batch, n, r)) + "]");
      if (!named) ok = false, why = tag + err;
    }
  };
  check(ls::mean_reducer, "mean");
  check(ls::sum_reducer, "sum");
  // Exclusive: per-sample results whose shape depends on the sample (1 element for even
  // samples, 2 for odd): the partitions of one rank disagree, or the ranks do.
  auto by_sample = ls::parallelize(b, ls::exclusive_batch_partitioner, ls::mean_reducer, [](const ls::Tensor& row) {
    return ls::Tensor::zeros({1 + static_cast<std::int64_t>(row.data<double>()[0]) % 2}, ls::DType::f64);
  });
  const std::string err = thrown_by([&] { (void)by_sample(rows_tensor(4)); });
  if (!has(err, "MismatchError: parallelize:") || !has(err, "differ")) ok = false, why = "exclusive: " + err;
  ok = still_usable(b) && ok;
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("concat_reducer returns the whole-batch result of a per-sample function on every rank",
          "[data][agreement]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  bool ok = true;
  std::string why;
  auto fail = [&](const std::string& w) { ok = false, why = w; };
  for (std::int64_t batch : {1, 2, 3, 5, 8, 13}) {  // fewer samples than ranks too
    const std::string tag = "batch " + std::to_string(batch) + ": ";
    const ls::Tensor x = rows_tensor(batch);
    auto want = [](std::int64_t i) { return 2.0 * static_cast<double>(i + i * i); };
    // One value per sample, computed on slices.
    auto row_values = [](const ls::Tensor& part) {
      ls::Tensor out = ls::Tensor::zeros({part.dim(0)}, ls::DType::f64);
      const double* p = part.data<double>();
      for (std::int64_t i = 0; i < part.dim(0); ++i) out.data<double>()[i] = 2 * (p[i * 3] + p[i * 3 + 1]);
      return out;
    };
    for (auto part : {ls::batch_partitioner, ls::dim_partitioner(0, true, true)}) {
      const ls::Tensor r = ls::parallelize(b, part, ls::concat_reducer, row_values)(x);
      if (r.shape() != ls::Shape{batch}) fail(tag + "shape " + ls::to_string(r.shape()));
      else
        for (std::int64_t i = 0; i < batch; ++i)
          if (r.data<double>()[i] != want(i)) fail(tag + "value " + std::to_string(i));
    }
    // exclusive_batch_partitioner (the dimension removed): 0-d results stacked into [batch].
    const ls::Tensor s = ls::parallelize(b, ls::exclusive_batch_partitioner, ls::concat_reducer,
                                         [](const ls::Tensor& row) {
                                           ls::Tensor t = ls::Tensor::zeros({}, ls::DType::f64);
                                           t.data<double>()[0] = 2 * (row.data<double>()[0] + row.data<double>()[1]);
                                           return t;
                                         })(x);
    if (s.shape() != ls::Shape{batch}) fail(tag + "stacked shape " + ls::to_string(s.shape()));
    else
      for (std::int64_t i = 0; i < batch; ++i)
        if (s.data<double>()[i] != want(i)) fail(tag + "stacked value " + std::to_string(i));
    // A structure of several dtypes: (i64 [count], f32 [count, 2]).
    auto [ids, pairs] = ls::parallelize(b, ls::batch_partitioner, ls::concat_reducer, [](const ls::Tensor& part) {
      const std::int64_t c = part.dim(0);
      std::tuple<ls::Tensor, ls::Tensor> out{ls::Tensor::zeros({c}, ls::DType::i64), ls::Tensor::zeros({c, 2})};
      for (std::int64_t i = 0; i < c; ++i) {
        const double v = part.data<double>()[i * 3];
        std::get<0>(out).data<std::int64_t>()[i] = static_cast<std::int64_t>(v);
        std::get<1>(out).data<float>()[2 * i] = static_cast<float>(v);
        std::get<1>(out).data<float>()[2 * i + 1] = static_cast<float>(-v);
      }
      return out;
    })(x);
    if (ids.shape() != ls::Shape{batch} || pairs.shape() != ls::Shape{batch, 2} || ids.dtype() != ls::DType::i64)
      fail(tag + "tuple shapes");
    else
      for (std::int64_t i = 0; i < batch; ++i)
        if (ids.data<std::int64_t>()[i] != i || pairs.data<float>()[2 * i] != float(i) ||
            pairs.data<float>()[2 * i + 1] != -float(i))
          fail(tag + "tuple value " + std::to_string(i));
    // Results of different lengths per partition (the even samples of each): concatenated.
    const ls::Tensor evens = ls::parallelize(b, ls::dim_partitioner(0, true, true), ls::concat_reducer,
                                             [](const ls::Tensor& part) {
                                               std::vector<std::int64_t> e;
                                               for (std::int64_t i = 0; i < part.dim(0); ++i) {
                                                 const auto v = static_cast<std::int64_t>(part.data<double>()[i * 3]);
                                                 if (v % 2 == 0) e.push_back(v);
                                               }
                                               return ls::Tensor::from(e, {static_cast<std::int64_t>(e.size())});
                                             })(x);
    if (evens.numel() != (batch + 1) / 2) fail(tag + "evens: " + ls::to_string(evens.shape()));
    else
      for (std::int64_t i = 0; i < evens.numel(); ++i)
        if (evens.data<std::int64_t>()[i] != 2 * i) fail(tag + "evens value " + std::to_string(i));
    // Partitioned along dimension 1: blocks of columns, concatenated back along dimension 1.
    std::vector<float> cols;
    for (int r = 0; r < 2; ++r)
      for (std::int64_t j = 0; j < batch; ++j) cols.push_back(static_cast<float>(100 * r + j));
    const ls::Tensor wide = ls::Tensor::from(cols, {2, batch});
    const ls::Tensor tenfold = ls::parallelize(b, ls::dim_partitioner(1), ls::concat_reducer, [](const ls::Tensor& block) {
      ls::Tensor out = block.clone();
      for (float& v : out.span<float>()) v *= 10;
      return out;
    })(wide);
    if (tenfold.shape() != wide.shape()) fail(tag + "dim 1 shape " + ls::to_string(tenfold.shape()));
    else
      for (std::size_t i = 0; i < cols.size(); ++i)
        if (tenfold.data<float>()[i] != 10 * cols[i]) fail(tag + "dim 1 value " + std::to_string(i));
  }
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("concat_reducer refuses what it cannot concatenate, on every rank", "[data][agreement]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  bool ok = true;
  std::string why;
  const ls::Tensor x = rows_tensor(13);
  // A scalar leaf has nothing to concatenate.
  std::string err = thrown_by([&] {
    (void)ls::parallelize(b, ls::batch_partitioner, ls::concat_reducer, [](const ls::Tensor& p) {
      return std::tuple<ls::Tensor, double>{p.clone(), 1.0};
    })(x);
  });
  if (!has(err, "InvalidArgument: parallelize:") || !has(err, "'[1]' is a scalar")) ok = false, why = "scalar: " + err;
  // A 0-d tensor has no dimension 0 (with the dimension kept).
  err = thrown_by([&] {
    (void)ls::parallelize(b, ls::batch_partitioner, ls::concat_reducer,
                          [](const ls::Tensor&) { return ls::Tensor::zeros({}, ls::DType::f64); })(x);
  });
  if (!has(err, "InvalidArgument: parallelize:") || !has(err, "no dimension 0")) ok = false, why = "0-d: " + err;
  if (n >= 2) {
    // The other dimensions differ across ranks: named per rank.
    err = thrown_by([&] {
      (void)ls::parallelize(b, ls::batch_partitioner, ls::concat_reducer, [&](const ls::Tensor& p) {
        return ls::Tensor::zeros({p.dim(0), b.rank() + 1}, ls::DType::f64);
      })(x);
    });
    bool named = has(err, "MismatchError: parallelize: the ranks' results differ, so concat_reducer");
    for (int r = 0; r < n; ++r)
      named = named && has(err, "rank " + std::to_string(r) + ": f64 [" + std::to_string(part_size(13, n, r)) +
                                    ", " + std::to_string(r + 1) + "]");
    if (!named) ok = false, why = "other dims: " + err;
    // A variable structure on a rank that ran no partition (1 sample, n ranks).
    err = thrown_by([&] {
      (void)ls::parallelize(b, ls::batch_partitioner, ls::concat_reducer, [](const ls::Tensor& p) {
        std::vector<ls::Tensor> v;
        v.push_back(p.clone());
        return v;
      })(rows_tensor(1));
    });
    if (!has(err, "InvalidArgument: parallelize:") || !has(err, "variable structure")) ok = false, why = "vector: " + err;
  }
  ok = still_usable(b) && ok;
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("parallelize: an exception on one rank is an error on every rank, and the ranks stay in step",
          "[data][agreement]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  bool ok = true;
  std::string why;
  const ls::Tensor x = rows_tensor(5);
  const int thrower = static_cast<int>(std::min<std::int64_t>(5, n)) - 1;  // runs the last sample
  // The user's own exception: the rank that threw gets it back as it was, the others an Error
  // naming it.
  std::string err = thrown_by([&] {
    (void)ls::parallelize(b, ls::batch_partitioner, ls::sum_reducer, [](const ls::Tensor& p) {
      if (p.data<double>()[(p.dim(0) - 1) * 3] == 4.0) throw std::runtime_error("boom on purpose");
      return 1.0;
    })(x);
  });
  const bool user_ok = b.rank() == thrower
                           ? err == "std::exception: boom on purpose"
                           : has(err, "Error: parallelize: the call failed before the results were combined") &&
                                 has(err, "rank " + std::to_string(thrower) + ": f threw: boom on purpose");
  if (!user_ok) ok = false, why = "user exception: " + err;
  // A Lockstep error on one rank (f reads f64 data as float there): the same type everywhere.
  err = thrown_by([&] {
    (void)ls::parallelize(b, ls::batch_partitioner, ls::mean_reducer, [&](const ls::Tensor& p) {
      return b.rank() == thrower ? static_cast<double>(p.data<float>()[0]) : p.data<double>()[0];
    })(x);
  });
  if (!has(err, "InvalidArgument: parallelize: the call failed") ||
      !has(err, "rank " + std::to_string(thrower) + ": "))
    ok = false, why = "lockstep exception: " + err;
  ok = still_usable(b) && ok;
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("parallelize: ranks that pass different batches, partitioners or reducers all get the error",
          "[data][agreement]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  bool ok = true;
  std::string why;
  auto sum_first = [](const ls::Tensor& p) {
    double s = 0;
    for (std::int64_t i = 0; i < p.dim(0); ++i) s += p.data<double>()[i * p.dim(1)];
    return s;
  };
  const bool last = b.rank() == n - 1;
  if (n >= 2) {
    // The last rank's batch has one sample more: the partitions would not line up.
    std::string err = thrown_by([&] {
      (void)ls::parallelize(b, ls::batch_partitioner, ls::mean_reducer, sum_first)(rows_tensor(last ? 6 : 5));
    });
    if (!has(err, "MismatchError: parallelize: the ranks called it with different arguments") ||
        !has(err, "rank 0: f64 [5, 3]") || !has(err, "rank " + std::to_string(n - 1) + ": f64 [6, 3]"))
      ok = false, why = "batch: " + err;
    // Another feature count.
    err = thrown_by([&] {
      (void)ls::parallelize(b, ls::batch_partitioner, ls::sum_reducer,
                            sum_first)(last ? ls::Tensor::zeros({5, 4}, ls::DType::f64) : rows_tensor(5));
    });
    if (!has(err, "MismatchError:") || !has(err, "f64 [5, 4]")) ok = false, why = "features: " + err;
    // An empty batch on one rank only (there an InvalidArgument of its own).
    err = thrown_by([&] {
      (void)ls::parallelize(b, ls::batch_partitioner, ls::sum_reducer, sum_first)(rows_tensor(last ? 0 : 5));
    });
    if (!has(err, "InvalidArgument: parallelize: the call failed") || !has(err, "empty batch"))
      ok = false, why = "empty batch: " + err;
    // Another partitioner on one rank.
    const ls::Tensor square = ls::Tensor::zeros({5, 5}, ls::DType::f64);
    err = thrown_by([&] {
      (void)ls::parallelize(b, last ? ls::dim_partitioner(1) : ls::batch_partitioner, ls::sum_reducer,
                            [](const ls::Tensor&) { return 1.0; })(square);
    });
    if (!has(err, "MismatchError:") || !has(err, "partitioned along dimension 1")) ok = false, why = "partitioner: " + err;
    // Another reducer on one rank.
    err = thrown_by([&] {
      if (last)
        (void)ls::parallelize(b, ls::batch_partitioner, ls::sum_reducer, sum_first)(rows_tensor(5));
      else
        (void)ls::parallelize(b, ls::batch_partitioner, ls::mean_reducer, sum_first)(rows_tensor(5));
    });
    if (!has(err, "MismatchError:") || !has(err, "sum_reducer") || !has(err, "mean_reducer"))
      ok = false, why = "reducer: " + err;
  }
  // The same bad input on every rank: the same error on every rank.
  std::string err = thrown_by([&] {
    (void)ls::parallelize(b, ls::batch_partitioner, ls::sum_reducer, sum_first)(rows_tensor(0));
  });
  if (!has(err, "InvalidArgument:") || !has(err, "empty batch")) ok = false, why = "empty everywhere: " + err;
  err = thrown_by([&] {
    (void)ls::parallelize(b, ls::dim_partitioner(-1), ls::sum_reducer, sum_first)(rows_tensor(3));
  });
  if (!has(err, "InvalidArgument:") || !has(err, "along dimension -1")) ok = false, why = "dim -1: " + err;
  err = thrown_by([&] {
    (void)ls::parallelize(b, ls::batch_partitioner, ls::mean_reducer,
                          [](const ls::Tensor&) { return std::int64_t{1}; })(rows_tensor(5));
  });
  if (!has(err, "InvalidArgument:") || !has(err, "mean_reducer needs floating-point results")) ok = false, why = "int mean: " + err;
  err = thrown_by([&] {
    (void)ls::parallelize(b, ls::batch_partitioner, ls::sum_reducer,
                          [](const ls::Tensor&) { return ls::Tensor::zeros({2}, ls::DType::f16); })(rows_tensor(5));
  });
  if (!has(err, "InvalidArgument:") || !has(err, "dtype f16 are not supported")) ok = false, why = "f16 sum: " + err;
  ok = still_usable(b) && ok;
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("parallelize: variable and empty result structures", "[data][agreement]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  bool ok = true;
  std::string why;
  // A vector of scalars on a rank that ran no partition (1 sample): it cannot know the length.
  // (Before: allreduces of different lengths.)
  if (n >= 2) {
    const std::string err = thrown_by([&] {
      (void)ls::parallelize(b, ls::batch_partitioner, ls::sum_reducer, [](const ls::Tensor&) {
        return std::vector<double>{1.0, 2.0};
      })(rows_tensor(1));
    });
    if (!has(err, "InvalidArgument: parallelize:") || !has(err, "variable structure")) ok = false, why = "vector: " + err;
  }
  for (std::int64_t batch : {1, 5}) {
    // No leaves at all, and zero-size tensors: valid, empty results.
    const auto none = ls::parallelize(b, ls::batch_partitioner, ls::mean_reducer,
                                      [](const ls::Tensor&) { return std::vector<ls::Tensor>{}; })(rows_tensor(batch));
    if (!none.empty()) ok = false, why = "empty vector";
    const ls::Tensor zero = ls::parallelize(b, ls::exclusive_batch_partitioner, ls::sum_reducer, [](const ls::Tensor&) {
      return ls::Tensor::zeros({0}, ls::DType::f64);
    })(rows_tensor(batch));
    if (zero.shape() != ls::Shape{0}) ok = false, why = "zero-size sum " + ls::to_string(zero.shape());
    const ls::Tensor cat = ls::parallelize(b, ls::batch_partitioner, ls::concat_reducer, [](const ls::Tensor&) {
      return ls::Tensor::zeros({0, 3}, ls::DType::f32);  // nothing along dimension 0
    })(rows_tensor(batch));
    if (cat.shape() != ls::Shape{0, 3}) ok = false, why = "zero-size concat " + ls::to_string(cat.shape());
  }
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("DistributedDataContainer: ranks deciding alone get the error on every rank", "[data][agreement]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  const bool last = b.rank() == n - 1;
  bool ok = true;
  std::string why;
  auto expect = [&](const std::string& err, const char* kind, const char* part, const char* what) {
    if (!has(err, kind) || !has(err, part)) ok = false, why = std::string(what) + ": " + err;
  };
  // The same bad argument everywhere: InvalidArgument everywhere.
  expect(thrown_by([&] { ls::DistributedDataContainer c(b, -1); }), "InvalidArgument:", "n_samples must be >= 0",
         "negative everywhere");
  std::vector<int> five(5);
  expect(thrown_by([&] { ls::DistributedDataContainer c(b, five, 6); }), "InvalidArgument:",
         "more than the dataset holds (5)", "short dataset");
  expect(thrown_by([&] { ls::DistributedDataContainer c(b, 5, ls::DataOptions{.batch_size = -2}); }),
         "InvalidArgument:", "batch_size must be >= 0", "negative batch_size");
  if (n >= 2) {
    // On one rank only (before: that rank threw alone and the others waited forever).
    expect(thrown_by([&] { ls::DistributedDataContainer c(b, last ? -1 : 5); }), "MismatchError:", "n_samples",
           "negative on one rank");
    std::vector<int> four(4);
    expect(thrown_by([&] { ls::DistributedDataContainer c(b, last ? four : five, 5); }), "MismatchError:",
           "more than the dataset holds", "short dataset on one rank");
    expect(thrown_by([&] { ls::DistributedDataContainer c(b, 10, ls::DataOptions{.seed = last ? 2u : 1u}); }),
           "MismatchError:", "seed", "seed");
    expect(thrown_by([&] { ls::DistributedDataContainer c(b, 10, ls::DataOptions{.batch_size = last ? 3 : 2}); }),
           "MismatchError:", "batch_size", "batch_size");
  }
  // Batch size in the options: num_batches() and batch(b) use it.
  ls::DistributedDataContainer c(b, 10, ls::DataOptions{.shuffle = false, .batch_size = 2});
  if (c.num_batches() != c.num_batches(2) || c.batch(0).size() != c.batch(0, 2).size()) ok = false, why = "batch_size option";
  ls::DistributedDataContainer unset(b, 10);
  expect(thrown_by([&] { (void)unset.num_batches(); }), "InvalidArgument:", "batch_size nor global_batch_size is set", "unset");
  // Epochs: set_epoch compares them.
  ls::DistributedDataContainer shuffled(b, 12, ls::DataOptions{.seed = 7});
  if (n >= 2) {
    expect(thrown_by([&] { shuffled.set_epoch(last ? 2 : 1); }), "MismatchError:", "different epochs", "epoch");
    const std::string err = thrown_by([&] { shuffled.set_epoch(last ? 2 : 1); });
    if (!has(err, "rank 0: 1") || !has(err, "rank " + std::to_string(n - 1) + ": 2")) ok = false, why = "epoch names: " + err;
  }
  shuffled.set_epoch(3);
  ok = ok && shuffled.epoch() == 3 && same_on_all_ranks(b, hash_of(gather_indices(b, shuffled.indices())));
  // Sizes near the int64 limit: no overflow.
  constexpr auto kMax = std::numeric_limits<std::int64_t>::max();
  if (c.num_batches(kMax) != 1 || c.num_batches(kMax, true) != 0) ok = false, why = "num_batches(max)";
  expect(thrown_by([&] { (void)c.batch(std::int64_t{1} << 62, 4); }), "InvalidArgument:", "out of range", "batch overflow");
  expect(thrown_by([&] { (void)c.batch(1, kMax); }), "InvalidArgument:", "out of range", "batch past the end");
  INFO(why);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("partitioners and slice_along refuse zero, negative and overflowing sizes", "[data][agreement]") {
  CHECK_THROWS_AS(ls::batch_partitioner.partitions(-1, 2), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::batch_partitioner.partitions(4, 0), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::exclusive_batch_partitioner.partitions(4, -3), ls::InvalidArgument);
  CHECK(ls::batch_partitioner.partitions(0, 3).empty());
  const ls::Tensor t = ls::Tensor::from(std::vector<float>{0, 1, 2, 3, 4, 5}, {3, 2});
  constexpr auto kMax = std::numeric_limits<std::int64_t>::max();
  CHECK_THROWS_AS(ls::slice_along(t, 0, kMax, 1, true), ls::InvalidArgument);  // start + count overflows
  CHECK_THROWS_AS(ls::slice_along(t, 0, 1, kMax, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(t, 0, -1, 1, true), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::slice_along(t, 2, 0, 1, true), ls::InvalidArgument);
  CHECK(ls::slice_along(t, 0, 3, 0, true).shape() == ls::Shape{0, 2});
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
  CHECK(all_ranks(b, in_range && same_on_all_ranks(b, hash_of(gather_indices(b, c.indices())))));
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

TEST_CASE("global_batch_size with Remainder::uneven: the ranks' rows together are the global batch, at any N",
          "[data][global]") {
  auto& backend = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = backend.size();
  for (std::int64_t samples : {0, 1, 7, 10, 23}) {
    for (std::int64_t g : {1, 3, 4, 8}) {
      ls::DataOptions o;
      o.shuffle = false;
      o.remainder = ls::Remainder::uneven;
      o.global_batch_size = g;
      ls::DistributedDataContainer c(backend, samples, o);
      const std::int64_t batches = c.num_batches();
      CHECK(batches == (samples + g - 1) / g);  // as one process with batches of g
      std::int64_t seen = 0;
      for (std::int64_t b = 0; b < batches; ++b) {
        const auto rows = c.batch(b);
        const std::int64_t expect_rows = std::min(g, samples - b * g);
        CHECK(c.global_rows(b) == expect_rows);
        // Without shuffle global batch b is samples [b g, b g + rows): count and sum over ranks.
        std::int64_t count = static_cast<std::int64_t>(rows.size()), sum = 0;
        for (auto i : rows) {
          CHECK(i >= b * g);
          CHECK(i < b * g + expect_rows);
          sum += i;
        }
        CHECK(ls::allreduce(backend, count, ls::ReduceOp::sum) == expect_rows);
        const std::int64_t first = b * g, last = first + expect_rows - 1;
        CHECK(ls::allreduce(backend, sum, ls::ReduceOp::sum) == (first + last) * expect_rows / 2);
        seen += count;
      }
      CHECK(ls::allreduce(backend, seen, ls::ReduceOp::sum) == samples);  // each sample once, at any N
      (void)n;
    }
  }
  // Shuffled: every sample exactly once over the epoch's global batches.
  ls::DataOptions o;
  o.remainder = ls::Remainder::uneven;
  o.global_batch_size = 5;
  o.seed = 3;
  ls::DistributedDataContainer c(backend, 37, o);
  std::vector<std::int64_t> hits(37, 0);
  for (std::int64_t b = 0; b < c.num_batches(); ++b)
    for (auto i : c.batch(b)) ++hits[static_cast<std::size_t>(i)];
  backend.allreduce(ls::TensorView{hits.data(), 37, ls::DType::i64, ls::Device::cpu()}, ls::ReduceOp::sum);
  CHECK(std::all_of(hits.begin(), hits.end(), [](std::int64_t h) { return h == 1; }));
  // batch_size and global_batch_size together are refused on every rank.
  ls::DataOptions both;
  both.batch_size = 2;
  both.global_batch_size = 4;
  CHECK_THROWS_AS(ls::DistributedDataContainer(backend, 10, both), ls::InvalidArgument);
}
