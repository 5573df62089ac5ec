// MPIBackend's hierarchical allreduce (src/mpi/hierarchical.*), on one machine: ctest runs this
// binary with LOCKSTEP_TEST_HOST_SIZE=k (a build with fault injection), which makes the backend
// treat ranks [0,k), [k,2k), ... as separate machines. Checked: the path is on exactly where the
// placement allows it (even, at least two machines of at least two ranks); every op and dtype
// (f32, f64, i32, i64; bf16 and f16 with sum and avg) at sizes from 1 element to several MiB,
// in place and out of place, gives the flat MPI allreduce's result (bitwise for the integers and
// for min and max; for the floating sums and products, within rounding of it, and bitwise what
// the hierarchical order of the sum gives at two machines), the same bits on every rank; ranks
// or whole machines that disagree about a call get MismatchError on every rank, with no buffer
// written and the backend still usable. Also: the hierarchical broadcast (every root, every size,
// a root that differs between machines), the hierarchical reduce-scatter, all-gather and 16-bit
// wire reduce-scatter (the sharded optimizer's; tagged [hier_rs], which also runs on real hosts
// at any placement), the 16-bit wire allreduce (f32 sums within a machine, 16-bit between
// machines; tagged [hier_ar16], also run on real hosts), the reducer's default bucket size per
// path (the reducer's split of a bucket's large tensors across machines, tagged [reducer_split],
// and Lockstep's Open MPI TCP default: hierarchical_reducer_test.cpp, the same program).
#include <catch2/catch.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"
#include "mpi/hierarchical_support.hpp"

namespace ls = lockstep;
using namespace hier_test;

namespace {


// Rank r's element i: non-integer floats (the order of a sum shows in the last bits), small
// integers for prod (no overflow at 8 ranks), anything for the other integer ops.
double value_uncached(ls::DType t, ls::ReduceOp op, int r, std::int64_t i) {
  const bool integer = t == ls::DType::i32 || t == ls::DType::i64;
  if (op == ls::ReduceOp::prod) return integer ? 1 + (i + r) % 3 : 0.75 + 0.5 * std::abs(std::sin(0.37 * i + r));
  if (integer) return static_cast<double>(((i * 7919 + r * 104729) % 20011) - 10005);
  return std::sin(0.001 * static_cast<double>(i) + r) * (1.0 + 0.37 * r);
}

// Memoized (the references read every rank's values again and again).
double value(ls::DType t, ls::ReduceOp op, int r, std::int64_t i) {
  const bool integer = t == ls::DType::i32 || t == ls::DType::i64;
  const int kind = (op == ls::ReduceOp::prod ? 2 : 0) + (integer ? 1 : 0);
  static std::vector<std::vector<double>> memo[4];
  auto& per_rank = memo[kind];
  if (static_cast<std::size_t>(r) >= per_rank.size()) per_rank.resize(static_cast<std::size_t>(r) + 1);
  auto& m = per_rank[static_cast<std::size_t>(r)];
  if (static_cast<std::size_t>(i) >= m.size()) {
    const std::size_t from = m.size();
    m.resize(std::max(static_cast<std::size_t>(i) + 1, 2 * from));
    for (std::size_t k = from; k < m.size(); ++k) m[k] = value_uncached(t, op, r, static_cast<std::int64_t>(k));
  }
  return m[static_cast<std::size_t>(i)];
}

template <class T>
void fill(ls::Tensor& x, ls::DType t, ls::ReduceOp op, int r) {
  T* p = x.data<T>();
  for (std::int64_t i = 0; i < x.numel(); ++i) p[i] = static_cast<T>(value(t, op, r, i));
}

// The sizes: from one element up to several MiB, none a multiple of anything in particular, and
// around the pipeline's chunk (LOCKSTEP_TEST_HIER_CHUNK_BYTES, default 4 MiB) for 4-byte types.
std::vector<std::int64_t> sizes() {
  const std::int64_t chunk = env_int("LOCKSTEP_TEST_HIER_CHUNK_BYTES", 4 << 20) / 4;
  std::vector<std::int64_t> out = {1, 2, 3, 5, 7, 1001, 65537, chunk - 1, chunk + 1, 1700003};
  if (chunk < 100000) out.push_back(3 * chunk + 5);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// The flat reference: MPI_Allreduce over MPI_COMM_WORLD (then / n for avg, as the flat path does).
template <class T>
std::vector<T> flat_reference(const ls::Tensor& x, MPI_Datatype dt, ls::ReduceOp op, int n) {
  std::vector<T> out(static_cast<std::size_t>(x.numel()));
  MPI_Op mop = op == ls::ReduceOp::prod ? MPI_PROD
               : op == ls::ReduceOp::min ? MPI_MIN
               : op == ls::ReduceOp::max ? MPI_MAX
                                         : MPI_SUM;
  MPI_Allreduce(x.data<T>(), out.data(), static_cast<int>(x.numel()), dt, mop, MPI_COMM_WORLD);
  if (op == ls::ReduceOp::avg)
    for (auto& v : out) v = static_cast<T>(v / static_cast<T>(n));
  return out;
}

// At two machines of k ranks each, what the hierarchical order gives: each machine folds its
// ranks in rank order, then one addition (or product) of the two machines' values, commutative
// so the same bits whichever machine's value comes first, then / n for avg.
template <class T>
T hier_order(ls::DType t, ls::ReduceOp op, int k, std::int64_t i) {
  auto fold = [&](int from) {
    T acc = static_cast<T>(value(t, op, from, i));
    for (int r = from + 1; r < from + k; ++r) {
      const T x = static_cast<T>(value(t, op, r, i));
      acc = op == ls::ReduceOp::prod ? static_cast<T>(acc * x) : static_cast<T>(acc + x);
    }
    return acc;
  };
  T a = fold(0), b = fold(k);
  T v = op == ls::ReduceOp::prod ? static_cast<T>(a * b) : static_cast<T>(a + b);
  if (op == ls::ReduceOp::avg) v = static_cast<T>(v / static_cast<T>(2 * k));
  return v;
}

// Calls from this many bytes take the hierarchical path (LOCKSTEP_TEST_HIER_MIN_BYTES, default 64 KiB).
std::size_t hier_min_bytes() { return static_cast<std::size_t>(env_int("LOCKSTEP_TEST_HIER_MIN_BYTES", 64 << 10)); }

// Two machines holding ranks [0,k) and [k,2k) (as LOCKSTEP_TEST_HOST_SIZE and --map-by
// ppr:k:node place them; round robin does not): where hier_order() is the path's order.
bool two_contiguous_hosts() {
  ls::MPIBackend& b = backend();
  const int n = b.size(), k = b.local_size();
  return b.hierarchical() && k * 2 == n && all_ranks(b.local_rank() == b.rank() % k);
}

template <class T>
void check_dtype(ls::DType t, MPI_Datatype dt) {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const bool two_hosts = two_contiguous_hosts();
  const bool integer = t == ls::DType::i32 || t == ls::DType::i64;
  for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::prod, ls::ReduceOp::min, ls::ReduceOp::max,
                          ls::ReduceOp::avg}) {
    if (integer && op == ls::ReduceOp::avg) continue;
    for (std::int64_t count : sizes()) {
      for (bool in_place : {true, false}) {
        ls::Tensor x(ls::Shape{count}, t);
        fill<T>(x, t, op, rank);
        const std::vector<T> flat = flat_reference<T>(x, dt, op, n);
        ls::Tensor out(ls::Shape{count}, t);
        if (in_place) {
          b.allreduce(x.view(), op);
        } else {
          b.allreduce(x.view(), out.view(), op);
          // send is left as it was
          std::int64_t changed = 0;
          for (std::int64_t i = 0; i < count; ++i)
            changed += x.data<T>()[i] == static_cast<T>(value(t, op, rank, i)) ? 0 : 1;
          CHECK(changed == 0);
        }
        const T* got = in_place ? x.data<T>() : out.data<T>();
        std::int64_t wrong = 0, wrong_order = 0;
        double worst = 0;
        for (std::int64_t i = 0; i < count; ++i) {
          const T want = flat[static_cast<std::size_t>(i)];
          if (integer || op == ls::ReduceOp::min || op == ls::ReduceOp::max) {
            wrong += got[i] == want ? 0 : 1;  // bitwise: the order does not matter
          } else {
            const double err = std::abs(static_cast<double>(got[i]) - static_cast<double>(want)) /
                               std::max(1.0, std::abs(static_cast<double>(want)));
            worst = std::max(worst, err);
            wrong += err <= 8 * n * std::numeric_limits<T>::epsilon() ? 0 : 1;
            if (two_hosts && static_cast<std::size_t>(count) * sizeof(T) >= hier_min_bytes()) wrong_order += got[i] == hier_order<T>(t, op, n / 2, i) ? 0 : 1;
          }
        }
        INFO(ls::name(t) << " " << ls::name(op) << " count " << count << (in_place ? " in place" : " out of place")
                         << " rank " << rank << ": worst relative error " << worst);
        CHECK(wrong == 0);
        CHECK(wrong_order == 0);
        CHECK(same_on_every_rank(got, static_cast<std::size_t>(count) * sizeof(T)));
      }
    }
  }
}

// `call` on x (count + 1 floats, rank * 1000 + i % 1000) must end in MismatchError on every rank,
// its text naming `part`, with x untouched.
template <class Call>
void refused_untouched(int rank, std::int64_t count, const char* what, const char* part, Call&& call) {
  const lstest::Refusal r = lstest::refusal_on_marked_buffer(rank, count, call);
  INFO(what << ": rank " << rank << " got: " << (r.threw ? r.text : std::string("no exception")));
  CHECK(all_ranks(r.threw));
  CHECK(all_ranks(r.text.find(part) != std::string::npos));
  CHECK(all_ranks(r.changed == 0));
}

}  // namespace

TEST_CASE("the hierarchical path is on exactly where the placement allows it") {
  ls::MPIBackend& b = backend();
  const int k = env_int("LOCKSTEP_TEST_HOST_SIZE", 0), n = b.size();
  const bool expected = k >= 2 && k < n && n % k == 0 && k <= 8 && !env_off("LOCKSTEP_HIERARCHICAL") &&
                        !env_off("LOCKSTEP_SHM");
  CHECK(b.hierarchical() == expected);
  if (k > 0 && k < n) {
    CHECK_FALSE(b.shared_memory());  // the whole communicator is not on one "machine"
    CHECK(b.local_size() == std::min(k, n - b.rank() / k * k));
    CHECK(b.local_rank() == b.rank() % k);
  }
  ls::MPIBackend self(MPI_COMM_SELF);  // one rank: nothing to split
  CHECK_FALSE(self.hierarchical());
}

TEST_CASE("allreduce f32: the flat result within rounding, the hierarchical order bitwise") {
  check_dtype<float>(ls::DType::f32, MPI_FLOAT);
}
TEST_CASE("allreduce f64: the flat result within rounding, the hierarchical order bitwise") {
  check_dtype<double>(ls::DType::f64, MPI_DOUBLE);
}
TEST_CASE("allreduce i32 and i64: the flat result bitwise") {
  check_dtype<std::int32_t>(ls::DType::i32, MPI_INT32_T);
  check_dtype<std::int64_t>(ls::DType::i64, MPI_INT64_T);
}

// The 16-bit value of x (bf16 or f16), as a float.
float round16(ls::DType t, float x) {
  return t == ls::DType::bf16 ? ls::to_float(ls::to_bfloat16(x)) : ls::to_float(ls::to_half(x));
}

TEST_CASE("allreduce of bf16 and f16 (the 16-bit wire): within the 16-bit rounding of the exact sum") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  for (ls::DType t : {ls::DType::bf16, ls::DType::f16}) {
    const double eps = t == ls::DType::bf16 ? 1.0 / 128 : 1.0 / 1024;
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg}) {
      for (std::int64_t count : sizes()) {
        ls::Tensor x(ls::Shape{count}, t);
        auto* p = static_cast<std::uint16_t*>(x.raw_data());
        for (std::int64_t i = 0; i < count; ++i) {
          const float v = static_cast<float>(value(ls::DType::f32, op, rank, i));
          if (t == ls::DType::bf16) {
            const ls::bfloat16 h = ls::to_bfloat16(v);
            std::memcpy(p + i, &h, 2);
          } else {
            const ls::half h = ls::to_half(v);
            std::memcpy(p + i, &h, 2);
          }
        }
        b.allreduce(x.view(), op);
        std::int64_t wrong = 0;
        // Against the exact sum of the 16-bit inputs, element by element (every element: a sum
        // of n values), with a bound of a few roundings of the sum of the magnitudes.
        for (std::int64_t i = 0; i < count; ++i) {
          double exact = 0, mag = 0;
          for (int r = 0; r < n; ++r) {
            const double v = round16(t, static_cast<float>(value(ls::DType::f32, op, r, i)));
            exact += v;
            mag += std::abs(v);
          }
          if (op == ls::ReduceOp::avg) {
            exact /= n;
            mag /= n;
          }
          float got;
          if (t == ls::DType::bf16) {
            ls::bfloat16 h;
            std::memcpy(&h, p + i, 2);
            got = ls::to_float(h);
          } else {
            ls::half h;
            std::memcpy(&h, p + i, 2);
            got = ls::to_float(h);
          }
          wrong += std::abs(got - exact) <= 4 * eps * mag + 1e-6 ? 0 : 1;
        }
        INFO(ls::name(t) << " " << ls::name(op) << " count " << count << " rank " << rank);
        CHECK(wrong == 0);
        CHECK(same_on_every_rank(x.raw_data(), static_cast<std::size_t>(count) * 2));
      }
    }
  }
}

TEST_CASE("ranks or whole machines that disagree about an allreduce get MismatchError on every rank") {
  ls::MPIBackend& b = backend();
  if (!b.hierarchical()) return;  // the flat path's own checks are tested elsewhere
  const int rank = b.rank(), k = b.local_size();
  const std::int64_t count = (std::int64_t{1} << 18) + 3;
  int round = 0;
  auto expect_mismatch = [&](const char* what, const char* part, auto&& call) {
    refused_untouched(rank, count, what, part, call);
    // Still in step: a correct call works.
    ls::Tensor y(ls::Shape{count});
    for (std::int64_t i = 0; i < count; ++i) y.data<float>()[i] = 1.0f;
    b.allreduce(y.view(), ls::ReduceOp::sum);
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < count; ++i) wrong += y.data<float>()[i] == static_cast<float>(b.size()) ? 0 : 1;
    CHECK(all_ranks(wrong == 0));
    ++round;
  };
  expect_mismatch("one rank's element count", "element count", [&](ls::Tensor& x) {
    b.allreduce(x.view().slice(0, rank == b.size() - 1 ? count + 1 : count), ls::ReduceOp::sum);
  });
  expect_mismatch("one machine's op (each machine agrees within)", "op", [&](ls::Tensor& x) {
    b.allreduce(x.view().slice(0, count), rank < k ? ls::ReduceOp::sum : ls::ReduceOp::max);
  });
  // Every call is agreed before its path is chosen: one machine's count of one element against
  // the others' large count, and a count that straddles the threshold (below it on one rank,
  // above it on the others) are MismatchError on every rank, never ranks on two paths.
  expect_mismatch("one machine's count of one element", "element count", [&](ls::Tensor& x) {
    b.allreduce(x.view().slice(0, rank < k ? 1 : count), ls::ReduceOp::sum);
  });
  const auto edge = static_cast<std::int64_t>(hier_min_bytes() / sizeof(float));
  if (edge >= 1 && edge < count) {
    expect_mismatch("a count that straddles the threshold on one rank", "element count", [&](ls::Tensor& x) {
      b.allreduce(x.view().slice(0, rank == 1 ? edge - 1 : edge), ls::ReduceOp::sum);
    });
    // The message names the ranks and their counts.
    const lstest::Refusal r = lstest::refusal_on_marked_buffer(rank, count, [&](ls::Tensor& x) {
      b.allreduce(x.view().slice(0, rank == 1 ? edge - 1 : edge), ls::ReduceOp::sum);
    });
    INFO(r.text);
    CHECK(all_ranks(r.text.find(ls::detail::concat("rank 1: ", edge - 1)) != std::string::npos));
    CHECK(all_ranks(r.text.find(ls::detail::concat(": ", edge)) != std::string::npos));
  } else {
    ++round;
  }
  expect_mismatch("the same local rank differs on every machine", "element count", [&](ls::Tensor& x) {
    b.allreduce(x.view().slice(0, rank % k == 0 ? count : count - 1), ls::ReduceOp::sum);
  });
  // Collectives that never take the path are agreed too: one rank's reduce or barrier against
  // the others' allreduce.
  expect_mismatch("one rank's reduce against an allreduce", "collective", [&](ls::Tensor& x) {
    if (rank == 0) b.reduce(x.view().slice(0, count), ls::ReduceOp::sum, 0);
    else b.allreduce(x.view().slice(0, count), ls::ReduceOp::sum);
  });
  expect_mismatch("one rank's barrier against a small allreduce", "collective", [&](ls::Tensor& x) {
    if (rank == b.size() - 1) b.barrier();
    else b.allreduce(x.view().slice(0, 2), ls::ReduceOp::sum);
  });
  CHECK(round == 7);
}

// The gradient reducer's default bucket size follows the path (issue 26 item 4): 1 MiB while
// every rank is on one machine (the shared-memory path's best), kDefaultNetworkBucketBytes when
// the ranks span machines (each call over a network pays round trips); a size given explicitly
// is kept either way, 1 MiB included (issue 29: an explicit 1 MiB read as "the default" and became
// 16 MiB across machines). The buckets still average correctly.
TEST_CASE("the gradient reducer's default bucket size: 1 MiB on one machine, larger across machines") {
  auto& b = backend();
  const int n = b.size(), r = b.rank(), k = env_int("LOCKSTEP_TEST_HOST_SIZE", 0);
  const bool across = k > 0 && k < n;
  REQUIRE((b.local_size() < n) == across);
  std::vector<ls::Tensor> grads;
  for (int i = 0; i < 8; ++i) grads.push_back(ls::Tensor::zeros({(std::int64_t{1} << 20) / 4}));  // 8 x 1 MiB
  ls::GradientReducer dflt(b, grads);
  ls::DistributedOptions two_mib;
  two_mib.bucket_bytes = std::size_t{2} << 20;
  ls::GradientReducer two(b, grads, two_mib);
  static_assert(ls::kDefaultNetworkBucketBytes >= (std::size_t{8} << 20), "the 8 MiB fit in one network bucket");
  CHECK(dflt.bucket_count() == (across ? 1u : 8u));
  CHECK(two.bucket_count() == 4u);
  // Unset picks the path's size; a size set, 1 MiB exactly included, is kept on either path.
  CHECK(!ls::DistributedOptions{}.bucket_bytes.has_value());
  CHECK(ls::host_bucket_bytes({}, b) == (across ? ls::kDefaultNetworkBucketBytes : ls::kDefaultBucketBytes));
  CHECK(ls::host_bucket_bytes({.bucket_bytes = ls::kDefaultBucketBytes}, b) == ls::kDefaultBucketBytes);
  ls::GradientReducer one(b, grads, {.bucket_bytes = std::size_t{1} << 20});
  CHECK(one.bucket_count() == 8u);
  {
    // The same through DistributedOptimizer's setup: its state holds the size it uses.
    auto set = ls::setup(ls::DistributedOptimizer(b, ls::SGD{}, {.bucket_bytes = std::size_t{1} << 20}), grads);
    CHECK(set.options().bucket_bytes == std::optional<std::size_t>(std::size_t{1} << 20));
    CHECK(set.reducer().bucket_count() == 8u);
    auto unset = ls::setup(ls::DistributedOptimizer(b, ls::SGD{}), grads);
    CHECK(unset.options().bucket_bytes == std::optional<std::size_t>(ls::host_bucket_bytes({}, b)));
    CHECK(unset.reducer().bucket_count() == (across ? 1u : 8u));
  }
  // The ranks compare the size each will use: rank 0's explicit 1 MiB against the others' unset
  // default is the same plan on one machine and a MismatchError naming bucket_bytes across.
  std::string why;
  try {
    ls::DistributedOptions o;
    if (r == 0) o.bucket_bytes = ls::kDefaultBucketBytes;
    ls::GradientReducer mixed(b, grads, o);
    CHECK(mixed.bucket_count() == 8u);
  } catch (const ls::MismatchError& e) {
    why = e.what();
  }
  INFO("rank " << r << ": " << why);
  CHECK(all_ranks(across ? why.find("bucket_bytes") != std::string::npos : why.empty()));
  for (auto& g : grads) {
    float* p = g.data<float>();
    for (std::int64_t i = 0; i < g.numel(); ++i) p[i] = static_cast<float>(i % 5 + r);
  }
  REQUIRE(dflt.reduce());
  bool ok = true;
  const float shift = static_cast<float>(n - 1) / 2.0f;
  for (auto& g : grads) {
    const float* p = g.data<float>();
    for (std::int64_t i = 0; i < g.numel() && ok; ++i) ok = std::abs(p[i] - (static_cast<float>(i % 5) + shift)) < 1e-5f;
  }
  CHECK(all_ranks(ok));
}

// Broadcast across machines (issue 26 item 3): from every root, the root's machine sends each
// chunk once to every other machine and each machine spreads it through shared memory. Every
// rank ends with the root's bytes, at sizes below and above the threshold and across chunks, for
// 1-, 4- and 8-byte dtypes.
TEST_CASE("broadcast from every root: the root's bytes on every rank") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  for (const ls::DType t : {ls::DType::f32, ls::DType::f64, ls::DType::u8}) {
    for (const std::int64_t count : {std::int64_t{1}, std::int64_t{3000}, std::int64_t{70000}, std::int64_t{1} << 20,
                                     (std::int64_t{9} << 20) / 8 + 5}) {
      for (int root = 0; root < n; ++root) {
        ls::Tensor x(ls::Shape{count}, t);
        auto* p = static_cast<unsigned char*>(x.raw_data());
        const std::size_t bytes = static_cast<std::size_t>(x.nbytes());
        for (std::size_t i = 0; i < bytes; ++i)
          p[i] = static_cast<unsigned char>(rank == root ? (i * 131 + static_cast<std::size_t>(root) * 7) % 251 : 0xEE);
        b.broadcast(x.view(), root);
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < bytes; ++i)
          wrong += p[i] == static_cast<unsigned char>((i * 131 + static_cast<std::size_t>(root) * 7) % 251) ? 0 : 1;
        INFO("dtype " << ls::name(t) << ", " << count << " elements, root " << root << ", rank " << rank);
        CHECK(all_ranks(wrong == 0));
      }
    }
  }
}

TEST_CASE("machines that disagree about a broadcast's root get MismatchError on every rank") {
  ls::MPIBackend& b = backend();
  if (!b.hierarchical()) return;  // the flat path's own checks are tested elsewhere
  const int rank = b.rank(), k = b.local_size();
  const std::int64_t count = (std::int64_t{1} << 18) + 3;
  ls::Tensor x(ls::Shape{count});
  for (std::int64_t i = 0; i < count; ++i) x.data<float>()[i] = static_cast<float>(rank * 1000 + i % 1000);
  std::string text;
  bool threw = false;
  try {
    b.broadcast(x.view(), rank < k ? 0 : 1);  // the first machine says root 0, the others root 1
  } catch (const ls::MismatchError& e) {
    threw = true;
    text = e.what();
  }
  INFO("rank " << rank << " got: " << (threw ? text : std::string("no exception")));
  CHECK(all_ranks(threw));
  CHECK(all_ranks(text.find("root") != std::string::npos));
  std::int64_t changed = 0;
  for (std::int64_t i = 0; i < count; ++i) changed += x.data<float>()[i] == static_cast<float>(rank * 1000 + i % 1000) ? 0 : 1;
  CHECK(all_ranks(changed == 0));
  // Still in step: a correct call works.
  b.broadcast(x.view(), 1);
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < count; ++i) wrong += x.data<float>()[i] == static_cast<float>(1000 + i % 1000) ? 0 : 1;
  CHECK(all_ranks(wrong == 0));
}

// Reduce-scatter and all-gather across machines (issue 26 item 3, the sharded optimizer's two
// collectives): node-local reduce-scatter in shared memory, then among the machines; among the
// machines, then node-local all-gather. Block counts from one element up to a few slices, in
// place and out of place. Checked against MPI's own flat reduce-scatter / all-gather over
// MPI_COMM_WORLD: bitwise for the integers, min and max, and the all-gather; for the floating
// sums within rounding (8 n eps relative), and at two machines bitwise the hierarchical order
// (each machine's ranks folded in rank order, then the two machines' values added). At 3 ranks
// as {0,1},{2} (uneven) the backend takes the flat path, and the same checks hold.
namespace {

// Block counts: small ones (flat below the threshold), one past the threshold, and one just
// over a slice (a slice is about the chunk's bytes of send in all) so that two slices overlap;
// `few`: one below and one past the threshold only (the dtypes other than f32, for the test's time;
// the slices of those are crossed in the small-chunk configuration).
std::vector<std::int64_t> block_counts(bool few = false) {
  const std::int64_t slice = env_int("LOCKSTEP_TEST_HIER_CHUNK_BYTES", 4 << 20) / 4 / backend().size();
  std::vector<std::int64_t> out = {1, 3, 16411, slice + 3};
  if (few) out = {3, 16411};
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

template <class T>
void check_reduce_scatter(ls::DType t, MPI_Datatype dt, bool few) {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const bool two_hosts = two_contiguous_hosts();
  const bool integer = t == ls::DType::i32 || t == ls::DType::i64;
  for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::max, ls::ReduceOp::avg}) {
    if (integer && op == ls::ReduceOp::avg) continue;
    for (std::int64_t q : block_counts(few)) {
      for (bool in_place : {true, false}) {
        const std::int64_t total = q * n;
        ls::Tensor x(ls::Shape{total}, t);
        fill<T>(x, t, op, rank);
        std::vector<T> flat(static_cast<std::size_t>(q));
        MPI_Reduce_scatter_block(x.data<T>(), flat.data(), static_cast<int>(q), dt,
                                 op == ls::ReduceOp::max ? MPI_MAX : MPI_SUM, MPI_COMM_WORLD);
        if (op == ls::ReduceOp::avg)
          for (auto& v : flat) v = static_cast<T>(v / static_cast<T>(n));
        ls::Tensor out(ls::Shape{q}, t);
        const T* got = nullptr;
        if (in_place) {
          b.reduce_scatter(x.view(), x.view().slice(rank * q, q), op);
          got = x.data<T>() + rank * q;
        } else {
          b.reduce_scatter(x.view(), out.view(), op);
          got = out.data<T>();
          std::int64_t changed = 0;  // send is left as it was
          for (std::int64_t i = 0; i < total; ++i)
            changed += x.data<T>()[i] == static_cast<T>(value(t, op, rank, i)) ? 0 : 1;
          CHECK(changed == 0);
        }
        std::int64_t wrong = 0, wrong_order = 0, others = 0;
        double worst = 0;
        for (std::int64_t i = 0; i < q; ++i) {
          const T want = flat[static_cast<std::size_t>(i)];
          if (integer || op == ls::ReduceOp::max) {
            wrong += got[i] == want ? 0 : 1;
          } else {
            const double err = std::abs(static_cast<double>(got[i]) - static_cast<double>(want)) /
                               std::max(1.0, std::abs(static_cast<double>(want)));
            worst = std::max(worst, err);
            wrong += err <= 8 * n * std::numeric_limits<T>::epsilon() ? 0 : 1;
            if (two_hosts && static_cast<std::size_t>(total) * sizeof(T) >= hier_min_bytes())
              wrong_order += got[i] == hier_order<T>(t, op, n / 2, rank * q + i) ? 0 : 1;
          }
        }
        // In place on the hierarchical path, the other blocks of send are left as they were (the
        // flat path's MPI_IN_PLACE may use them as scratch).
        if (in_place && b.hierarchical() && static_cast<std::size_t>(total) * sizeof(T) >= hier_min_bytes())
          for (std::int64_t i = 0; i < total; ++i)
            if (i < rank * q || i >= (rank + 1) * q) others += x.data<T>()[i] == static_cast<T>(value(t, op, rank, i)) ? 0 : 1;
        INFO("reduce_scatter " << ls::name(t) << " " << ls::name(op) << " block " << q
                               << (in_place ? " in place" : " out of place") << " rank " << rank
                               << ": worst relative error " << worst);
        CHECK(wrong == 0);
        CHECK(wrong_order == 0);
        CHECK(others == 0);
      }
    }
  }
}

}  // namespace

TEST_CASE("reduce_scatter across machines: the flat result (bitwise where the order allows)", "[hier_rs]") {
  check_reduce_scatter<float>(ls::DType::f32, MPI_FLOAT, false);
  check_reduce_scatter<double>(ls::DType::f64, MPI_DOUBLE, true);
  check_reduce_scatter<std::int32_t>(ls::DType::i32, MPI_INT32_T, true);
  check_reduce_scatter<std::int64_t>(ls::DType::i64, MPI_INT64_T, true);
}

TEST_CASE("allgather across machines: every rank's block in rank order, bitwise", "[hier_rs]") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  for (const ls::DType t : {ls::DType::f32, ls::DType::u8, ls::DType::f64}) {
    const std::size_t es = ls::size_of(t);
    for (std::int64_t q : block_counts()) {
      for (bool in_place : {true, false}) {
        ls::Tensor all(ls::Shape{q * n}, t);
        ls::Tensor mine(ls::Shape{q}, t);
        const std::size_t bytes = static_cast<std::size_t>(q) * es;
        auto pattern = [&](int r, std::size_t i) { return static_cast<unsigned char>((i * 131 + static_cast<std::size_t>(r) * 29 + 7) % 251); };
        auto* pa = static_cast<unsigned char*>(all.raw_data());
        auto* pm = static_cast<unsigned char*>(mine.raw_data());
        for (std::size_t i = 0; i < bytes * static_cast<std::size_t>(n); ++i) pa[i] = 0xEE;
        for (std::size_t i = 0; i < bytes; ++i) (in_place ? pa + static_cast<std::size_t>(rank) * bytes : pm)[i] = pattern(rank, i);
        if (in_place)
          b.allgather(all.view().slice(rank * q, q), all.view());
        else
          b.allgather(mine.view(), all.view());
        std::size_t wrong = 0;
        for (int r = 0; r < n; ++r)
          for (std::size_t i = 0; i < bytes; ++i) wrong += pa[static_cast<std::size_t>(r) * bytes + i] == pattern(r, i) ? 0 : 1;
        INFO("allgather " << ls::name(t) << " block " << q << (in_place ? " in place" : " out of place") << " rank "
                          << rank);
        CHECK(wrong == 0);
      }
    }
  }
}

// The 16-bit wire on the inter-host part only: each machine sums its ranks' f32 values in f32
// (rank order), rounds that once to the wire dtype, and the machines' values are added in
// 16-bit (each addition rounded). Bound against the exact sum of the f32 inputs: with u the
// wire's unit roundoff (2^-8 bf16, 2^-11 f16) and H machines, |error| <= H u sum|x| (plus f32
// rounding); tested with (H + 1) u. At two machines: bitwise that order, which a 16-bit
// node-local sum (every rank's value rounded first) would not give.
TEST_CASE("reduce_scatter_wire16 across machines: node sums in f32, the 16-bit wire between machines", "[hier_rs]") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const bool two_hosts = two_contiguous_hosts();
  const int hosts = b.hierarchical() ? n / b.local_size() : n;  // flat: every rank's value rounded
  for (ls::DType w : {ls::DType::bf16, ls::DType::f16}) {
    const double u = w == ls::DType::bf16 ? 1.0 / 256 : 1.0 / 2048;
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg}) {
      for (std::int64_t q : {std::int64_t{5}, std::int64_t{70001}}) {
        const std::int64_t total = q * n;
        ls::Tensor x(ls::Shape{total});
        fill<float>(x, ls::DType::f32, ls::ReduceOp::sum, rank);
        ls::Tensor out(ls::Shape{q});
        b.reduce_scatter_wire16(x.view(), out.view(), w, op);
        std::int64_t wrong = 0, wrong_order = 0;
        const bool on_path = b.hierarchical() && static_cast<std::size_t>(total) * 4 >= hier_min_bytes();
        for (std::int64_t i = 0; i < q; ++i) {
          const std::int64_t e = rank * q + i;
          double exact = 0, mag = 0;
          for (int r = 0; r < n; ++r) {
            const double v = static_cast<float>(value(ls::DType::f32, ls::ReduceOp::sum, r, e));
            exact += v;
            mag += std::abs(v);
          }
          const double div = op == ls::ReduceOp::avg ? n : 1;
          const double got = out.data<float>()[i];
          wrong += std::abs(got - exact / div) <= ((hosts + 1) * u * mag + 1e-6) / div ? 0 : 1;
          if (two_hosts && on_path) {
            const int k = n / 2;
            float p[2] = {0, 0};
            for (int h = 0; h < 2; ++h) {
              p[h] = static_cast<float>(value(ls::DType::f32, ls::ReduceOp::sum, h * k, e));
              for (int r = h * k + 1; r < h * k + k; ++r) p[h] += static_cast<float>(value(ls::DType::f32, ls::ReduceOp::sum, r, e));
            }
            float want = round16(w, round16(w, p[0]) + round16(w, p[1]));
            if (op == ls::ReduceOp::avg) want /= static_cast<float>(n);
            wrong_order += static_cast<float>(got) == want ? 0 : 1;
          }
        }
        INFO("reduce_scatter_wire16 " << ls::name(w) << " " << ls::name(op) << " block " << q << " rank " << rank);
        CHECK(wrong == 0);
        CHECK(wrong_order == 0);
      }
    }
  }
}

// allreduce_wire16 across machines (the replicated optimizer's wire_dtype; issue 26 item 3): each
// machine sums its ranks' f32 values in f32 (local rank order), rounds that once to the wire
// dtype, the machines' values are added in 16-bit in machine order (each addition rounded),
// the sum is widened and divided for avg. Checked bitwise against that reference at any
// placement and number of machines (with ppr:k:node, round robin and LOCKSTEP_TEST_HOST_SIZE
// alike: machine h is the h-th in the order of its ranks of each local rank), at sizes from one
// element to several MiB, across chunks, in place; against the exact sum within (H + 1) u
// sum|x| (u: the wire's unit roundoff; the flat three passes: (n + 1) u sum|x|); the same bits
// on every rank. Tagged [hier_ar16]: the multihost stage runs it on real hosts.
TEST_CASE("allreduce_wire16 across machines: node sums in f32, the 16-bit wire between machines", "[hier_ar16]") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  // Each rank's machine (its place among the ranks of its local rank, which is its rank in the
  // path's communicator of that local rank) and the ranks of each machine in local rank order.
  std::vector<int> local(static_cast<std::size_t>(n));
  const int mine = b.local_rank();
  MPI_Allgather(&mine, 1, MPI_INT, local.data(), 1, MPI_INT, MPI_COMM_WORLD);
  const int L = b.local_size(), H = b.hierarchical() ? n / L : n;
  std::vector<std::vector<int>> members(static_cast<std::size_t>(H), std::vector<int>(static_cast<std::size_t>(L), -1));
  if (b.hierarchical())
    for (int r = 0; r < n; ++r) {
      int h = 0;
      for (int q = 0; q < r; ++q) h += local[static_cast<std::size_t>(q)] == local[static_cast<std::size_t>(r)] ? 1 : 0;
      members[static_cast<std::size_t>(h)][static_cast<std::size_t>(local[static_cast<std::size_t>(r)])] = r;
    }
  const std::int64_t chunk = env_int("LOCKSTEP_TEST_HIER_CHUNK_BYTES", 4 << 20) / 4;
  // Below and above the threshold, a multiple of the chunk's unit (L x H elements) and not,
  // and just over one chunk (4 MiB by default; with small chunks, several of them).
  std::vector<std::int64_t> counts = {1, 3, 1001, 16411, 65536, chunk + 1};
  if (chunk < 100000) counts.push_back(30 * chunk + 5);
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  auto v = [](int r, std::int64_t i) { return static_cast<float>(value(ls::DType::f32, ls::ReduceOp::sum, r, i)); };
  for (std::int64_t count : counts) {
    // What does not depend on the wire or the op, once per count: the exact sum of every rank's
    // value, the sum of their magnitudes, and each machine's f32 sum (local rank order).
    const auto m = static_cast<std::size_t>(count);
    std::vector<double> exact(m, 0.0), mag(m, 0.0);
    std::vector<float> host_sum(b.hierarchical() ? m * static_cast<std::size_t>(H) : 0);
    for (std::size_t i = 0; i < m; ++i) {
      const auto e = static_cast<std::int64_t>(i);
      for (int r = 0; r < n; ++r) {
        exact[i] += v(r, e);
        mag[i] += std::abs(v(r, e));
      }
      if (b.hierarchical())
        for (int h = 0; h < H; ++h) {
          const auto& on = members[static_cast<std::size_t>(h)];
          float sum = v(on[0], e);
          for (int j = 1; j < L; ++j) sum += v(on[static_cast<std::size_t>(j)], e);
          host_sum[i * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)] = sum;
        }
    }
    const bool on_path = b.hierarchical() && static_cast<std::size_t>(count) * 4 >= hier_min_bytes();
    const int terms = on_path ? H : n;  // values rounded to the wire, each a term of the error
    for (ls::DType w : {ls::DType::bf16, ls::DType::f16}) {
      const double u = w == ls::DType::bf16 ? 1.0 / 256 : 1.0 / 2048;
      for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg}) {
        ls::Tensor x(ls::Shape{count});
        fill<float>(x, ls::DType::f32, ls::ReduceOp::sum, rank);
        b.allreduce_wire16(x.view(), w, op);
        const float* got = x.data<float>();
        const double div = op == ls::ReduceOp::avg ? n : 1;
        std::int64_t wrong = 0, wrong_bits = 0;
        for (std::size_t i = 0; i < m; ++i) {
          wrong += std::abs(got[i] - exact[i] / div) <= ((terms + 1) * u * mag[i] + 1e-6) / div ? 0 : 1;
          if (on_path) {
            // Each machine's sum rounded once, added in 16-bit in machine order, widened, / n.
            float acc = 0;
            for (int h = 0; h < H; ++h) {
              const float r16 = round16(w, host_sum[i * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)]);
              acc = h == 0 ? r16 : round16(w, r16 + acc);
            }
            if (op == ls::ReduceOp::avg) acc /= static_cast<float>(n);
            wrong_bits += std::memcmp(&acc, got + i, 4) == 0 ? 0 : 1;
          }
        }
        INFO("allreduce_wire16 " << ls::name(w) << " " << ls::name(op) << " count " << count << " rank " << rank
                                 << (on_path ? " (hierarchical)" : " (flat)"));
        CHECK(wrong == 0);
        CHECK(wrong_bits == 0);
        CHECK(same_on_every_rank(got, static_cast<std::size_t>(count) * 4));
      }
    }
  }
}

TEST_CASE("machines that disagree about allreduce_wire16 get MismatchError on every rank", "[hier_ar16]") {
  ls::MPIBackend& b = backend();
  if (!b.hierarchical()) return;  // the flat path's own checks are tested elsewhere
  const int n = b.size(), rank = b.rank();
  // Machine 0: the ranks whose local rank 0 is the lowest rank (any placement).
  const bool first = [&] {
    std::vector<int> local(static_cast<std::size_t>(n));
    const int lr = b.local_rank();
    MPI_Allgather(&lr, 1, MPI_INT, local.data(), 1, MPI_INT, MPI_COMM_WORLD);
    int before = 0;  // ranks below this one with its local rank
    for (int q = 0; q < rank; ++q) before += local[static_cast<std::size_t>(q)] == lr ? 1 : 0;
    return before == 0;
  }();
  const std::int64_t count = (std::int64_t{1} << 18) + 3;
  int round = 0;
  auto expect_mismatch = [&](const char* what, const char* part, auto&& call) {
    refused_untouched(rank, count, what, part, call);
    // Still in step: a correct call works (small integers: exact on either wire).
    ls::Tensor y(ls::Shape{count});
    for (std::int64_t i = 0; i < count; ++i) y.data<float>()[i] = static_cast<float>(i % 7);
    b.allreduce_wire16(y.view(), ls::DType::bf16, ls::ReduceOp::sum);
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < count; ++i) wrong += y.data<float>()[i] == static_cast<float>(n * (i % 7)) ? 0 : 1;
    CHECK(all_ranks(wrong == 0));
    ++round;
  };
  const auto sum = ls::ReduceOp::sum;
  expect_mismatch("one machine's wire dtype", "dtype", [&](ls::Tensor& x) {
    b.allreduce_wire16(x.view().slice(0, count), first ? ls::DType::bf16 : ls::DType::f16, sum);
  });
  expect_mismatch("one machine's op", "op", [&](ls::Tensor& x) {
    b.allreduce_wire16(x.view().slice(0, count), ls::DType::bf16, first ? ls::ReduceOp::sum : ls::ReduceOp::avg);
  });
  expect_mismatch("one rank's element count", "element count", [&](ls::Tensor& x) {
    b.allreduce_wire16(x.view().slice(0, rank == n - 1 ? count + 1 : count), ls::DType::f16, sum);
  });
  expect_mismatch("one machine's plain f32 allreduce", "dtype", [&](ls::Tensor& x) {
    if (first)
      b.allreduce_wire16(x.view().slice(0, count), ls::DType::bf16, sum);
    else
      b.allreduce(x.view().slice(0, count), sum);
  });
  CHECK(round == 4);
}

TEST_CASE("machines that disagree about reduce_scatter and allgather get MismatchError on every rank", "[hier_rs]") {
  ls::MPIBackend& b = backend();
  if (!b.hierarchical()) return;  // the flat path's own checks are tested elsewhere
  const int n = b.size(), rank = b.rank(), k = b.local_size();
  const std::int64_t q = (std::int64_t{1} << 16) + 3;
  ls::Tensor x(ls::Shape{q * n});
  for (std::int64_t i = 0; i < q * n; ++i) x.data<float>()[i] = static_cast<float>(rank * 1000 + i % 1000);
  std::string text;
  bool threw = false;
  try {
    // The first machine reduce-scatters, the others all-gather the same block count.
    if (rank < k)
      b.reduce_scatter(x.view(), x.view().slice(rank * q, q), ls::ReduceOp::sum);
    else
      b.allgather(x.view().slice(rank * q, q), x.view());
  } catch (const ls::MismatchError& e) {
    threw = true;
    text = e.what();
  }
  INFO("rank " << rank << " got: " << (threw ? text : std::string("no exception")));
  CHECK(all_ranks(threw));
  std::int64_t changed = 0;
  for (std::int64_t i = 0; i < q * n; ++i) changed += x.data<float>()[i] == static_cast<float>(rank * 1000 + i % 1000) ? 0 : 1;
  CHECK(all_ranks(changed == 0));
  // Still in step: a correct call works.
  b.reduce_scatter(x.view(), x.view().slice(rank * q, q), ls::ReduceOp::max);
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < q; ++i)
    wrong += x.data<float>()[rank * q + i] == static_cast<float>((n - 1) * 1000 + (rank * q + i) % 1000) ? 0 : 1;
  CHECK(all_ranks(wrong == 0));
}
