// MPIBackend's shared-memory path for large host allreduce and broadcast (src/mpi/shm/shm_collectives.*),
// and for reduce_scatter and allgather (in place and not):
// when it is on, results at slice boundaries and across many calls, bitwise agreement with a
// rank-order reference, out-of-place calls, and ranks that disagree about a call getting
// MismatchError on every rank with the backend still usable afterwards. ctest runs this binary
// with the default slice, with 4 KiB slices (every call crosses many slices), and with
// LOCKSTEP_SHM=0 (the MPI path; the [shm] cases are left out there).
#include <catch2/catch.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

namespace ls = lockstep;

namespace {

ls::MPIBackend& backend() { return ls::get_distributed_backend<ls::MPIBackend>(); }

bool shm_disabled_by_env() {
  const char* v = std::getenv("LOCKSTEP_SHM");
  return v != nullptr && (std::string(v) == "0" || std::string(v) == "off");
}

std::size_t env_size(const char* name, std::size_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  std::size_t x = std::strtoull(v, nullptr, 10);
  std::string s = v;
  if (!s.empty() && (s.back() == 'K' || s.back() == 'k')) x <<= 10;
  if (!s.empty() && (s.back() == 'M' || s.back() == 'm')) x <<= 20;
  return x;
}

// Element counts around the slice boundaries (f32), all above the shared-memory threshold.
std::vector<std::int64_t> boundary_sizes() {
  const std::int64_t slice = static_cast<std::int64_t>(env_size("LOCKSTEP_SHM_SLICE_BYTES", 1 << 20)) / 4;
  const std::int64_t floor = static_cast<std::int64_t>(env_size("LOCKSTEP_SHM_MIN_BYTES", 4 << 10)) / 4 + 1;
  std::vector<std::int64_t> out;
  for (std::int64_t s : {slice - 1, slice, slice + 1, 2 * slice, 3 * slice + 5, std::int64_t{1} << 20})
    out.push_back(std::max(s, floor));
  return out;
}

// Rank r's input: non-integer values, so that the order of the sum shows in the last bits.
// Memoized: the references read every rank's values again and again, and computing them (a sine
// each) was most of this program's time at 3 and 4 ranks.
float input(int r, std::int64_t i) {
  static std::vector<std::vector<float>> memo;
  if (static_cast<std::size_t>(r) >= memo.size()) memo.resize(static_cast<std::size_t>(r) + 1);
  auto& m = memo[static_cast<std::size_t>(r)];
  if (static_cast<std::size_t>(i) >= m.size()) {
    const std::size_t from = m.size();
    m.resize(std::max(static_cast<std::size_t>(i) + 1, 2 * from));
    for (std::size_t k = from; k < m.size(); ++k)
      m[k] = static_cast<float>(std::sin(0.001 * static_cast<double>(k) + r)) * (1.0f + 0.37f * r);
  }
  return m[static_cast<std::size_t>(i)];
}

// What every rank must get: the fold over ranks in rank order, then / n for avg.
float fold(ls::ReduceOp op, int n, std::int64_t i) {
  float acc = input(0, i);
  for (int r = 1; r < n; ++r) {
    float x = input(r, i);
    switch (op) {
      case ls::ReduceOp::sum:
      case ls::ReduceOp::avg: acc = acc + x; break;
      case ls::ReduceOp::prod: acc = acc * x; break;
      case ls::ReduceOp::min: acc = std::min(acc, x); break;
      case ls::ReduceOp::max: acc = std::max(acc, x); break;
    }
  }
  if (op == ls::ReduceOp::avg) acc = acc / static_cast<float>(n);
  return acc;
}

using lstest::same_on_every_rank;  // test_support.hpp

// Rank-combined verdict, so that no rank stops before the others.
bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v == 1;
}

}  // namespace

TEST_CASE("the shared-memory path is on exactly where it can be") {
  ls::MPIBackend& b = backend();
  // On one machine only: across hosts (scripts/cluster.sh) local_size() < size(), and it is off.
  const bool expected = b.size() >= 2 && b.size() <= 8 && b.local_size() == b.size() && !shm_disabled_by_env();
  CHECK(b.shared_memory() == expected);
  ls::MPIBackend self(MPI_COMM_SELF);  // one rank: nothing to share
  CHECK_FALSE(self.shared_memory());
}

TEST_CASE("allreduce: every op at the slice boundaries, in place and out of place") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const bool bitwise = b.shared_memory();  // MPI may sum in another order for n > 2
  std::vector<std::string> bad;
  for (std::int64_t count : boundary_sizes()) {
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg, ls::ReduceOp::prod, ls::ReduceOp::min,
                            ls::ReduceOp::max}) {
      for (bool in_place : {true, false}) {
        ls::Tensor x(ls::Shape{count}), out(ls::Shape{count});
        float* px = x.data<float>();
        for (std::int64_t i = 0; i < count; ++i) px[i] = input(rank, i);
        if (in_place) b.allreduce(x.view(), op);
        else b.allreduce(x.view(), out.view(), op);
        const float* got = in_place ? px : out.data<float>();
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < count; ++i) {
          const float want = fold(op, n, i);
          const bool ok = bitwise ? std::memcmp(&got[i], &want, 4) == 0
                                  : std::fabs(got[i] - want) <= 1e-5f * (1.0f + std::fabs(want));
          wrong += ok ? 0 : 1;
        }
        if (!in_place)
          for (std::int64_t i = 0; i < count; ++i) wrong += px[i] == input(rank, i) ? 0 : 1;  // send untouched
        const bool same = same_on_every_rank(got, count * 4);  // collective: every rank calls it
        if (wrong != 0 || (bitwise && !same))
          bad.push_back(ls::detail::concat(ls::name(op), " count ", count, in_place ? " in place" : " out of place",
                                           ": ", wrong, " wrong elements"));
      }
    }
  }
  INFO(ls::detail::concat(bad.size(), " failing cases, first: ", bad.empty() ? "" : bad.front()));
  CHECK(bad.empty());
}

TEST_CASE("allreduce: integers and doubles are exact") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const std::int64_t count = (std::int64_t{1} << 18) + 3;
  ls::Tensor a = ls::Tensor::zeros({count}, ls::DType::i32), l = ls::Tensor::zeros({count}, ls::DType::i64),
             d = ls::Tensor::zeros({count}, ls::DType::f64);
  for (std::int64_t i = 0; i < count; ++i) {
    a.data<std::int32_t>()[i] = static_cast<std::int32_t>(i % 1000) - rank;
    l.data<std::int64_t>()[i] = (std::int64_t{1} << 40) + i * (rank + 1);
    d.data<double>()[i] = 0.5 * static_cast<double>(i % 77) + rank;
  }
  b.allreduce(a.view(), ls::ReduceOp::min);
  b.allreduce(l.view(), ls::ReduceOp::sum);
  b.allreduce(d.view(), ls::ReduceOp::max);
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < count; ++i) {
    wrong += a.data<std::int32_t>()[i] == static_cast<std::int32_t>(i % 1000) - (n - 1) ? 0 : 1;
    wrong += l.data<std::int64_t>()[i] == n * (std::int64_t{1} << 40) + i * n * (n + 1) / 2 ? 0 : 1;
    wrong += d.data<double>()[i] == 0.5 * static_cast<double>(i % 77) + (n - 1) ? 0 : 1;
  }
  CHECK(wrong == 0);
}

TEST_CASE("broadcast: every root at the slice boundaries, several dtypes") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  std::int64_t wrong = 0;
  for (std::int64_t count : boundary_sizes()) {
    for (ls::DType t : {ls::DType::f32, ls::DType::u8, ls::DType::f16}) {
      const std::int64_t elems = count * 4 / static_cast<std::int64_t>(ls::size_of(t)) + 1;  // odd byte counts
      for (int root = 0; root < n; ++root) {
        ls::Tensor x = ls::Tensor::zeros({elems}, t);
        auto* bytes = static_cast<unsigned char*>(x.raw_data());
        const std::size_t nb = x.nbytes();
        for (std::size_t i = 0; i < nb; ++i) bytes[i] = static_cast<unsigned char>(rank == root ? i * 7 + root : 0xEE);
        b.broadcast(x.view(), root);
        for (std::size_t i = 0; i < nb; ++i) wrong += bytes[i] == static_cast<unsigned char>(i * 7 + root) ? 0 : 1;
      }
    }
  }
  CHECK(wrong == 0);
}

TEST_CASE("broadcast: small sizes ride in the agreement slice, every root, around the 8 KiB limit") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  std::int64_t wrong = 0;
  for (std::int64_t nb : {1, 3, 8, 17, 255, 4096, 8191, 8192, 8193, 12289}) {
    for (int root = 0; root < n; ++root) {
      ls::Tensor x = ls::Tensor::zeros({nb}, ls::DType::u8);
      auto* bytes = static_cast<unsigned char*>(x.raw_data());
      for (std::int64_t i = 0; i < nb; ++i) bytes[i] = static_cast<unsigned char>(rank == root ? i * 13 + root : 0xEE);
      b.broadcast(x.view(), root);
      for (std::int64_t i = 0; i < nb; ++i) wrong += bytes[i] == static_cast<unsigned char>(i * 13 + root) ? 0 : 1;
    }
  }
  CHECK(wrong == 0);
  // A count below the limit on one rank and above it on another is a disagreement like any other.
  if (b.shared_memory()) {
    ls::Tensor x(ls::Shape{2049});
    bool threw = false;
    try {
      b.broadcast(x.view().slice(0, rank == 0 ? 2048 : 2049), 0);
    } catch (const ls::MismatchError& e) {
      threw = std::string(e.what()).find("elements") != std::string::npos;
    }
    CHECK(all_ranks(threw));
  }
}

TEST_CASE("hundreds of calls in a row: sizes, roots and kinds alternate") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const auto sizes = boundary_sizes();
  std::int64_t wrong = 0;
  for (int call = 0; call < 120; ++call) {
    const std::int64_t count = sizes[static_cast<std::size_t>(call) % sizes.size()] + call;
    ls::Tensor x(ls::Shape{count});
    float* p = x.data<float>();
    if (call % 3 == 2) {
      const int root = call % n;
      for (std::int64_t i = 0; i < count; ++i) p[i] = rank == root ? static_cast<float>(i % 4099 + call) : -1.0f;
      b.broadcast(x.view(), root);
      for (std::int64_t i = 0; i < count; ++i) wrong += p[i] == static_cast<float>(i % 4099 + call) ? 0 : 1;
    } else {
      for (std::int64_t i = 0; i < count; ++i) p[i] = static_cast<float>((i + call) % 1024 + rank);
      b.allreduce(x.view(), ls::ReduceOp::sum);
      for (std::int64_t i = 0; i < count; ++i)
        wrong += p[i] == static_cast<float>(n * ((i + call) % 1024) + n * (n - 1) / 2) ? 0 : 1;
    }
  }
  CHECK(wrong == 0);
}

// Legal in MPI: every rank starts the nonblocking allreduce before the blocking call, but rank 0
// enters the blocking call before it waits, and the others wait first. Open MPI moves a large
// nonblocking allreduce only inside MPI calls, so rank 0's wait on the shared-memory path must
// keep it going, or the others wait for it until the deadline (the barrier was MPI_Barrier once,
// which did). A deadline turns a regression into a TimeoutError instead of a hang.
TEST_CASE("a nonblocking allreduce in flight while one rank enters a shared-memory barrier or allreduce first") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const double before = ls::timeout();
  ls::set_timeout(30);
  const std::int64_t count = std::int64_t{1} << 20;  // 4 MiB: Open MPI's rendezvous protocol
  std::int64_t wrong = 0;
  for (int form = 0; form < 2; ++form) {
    ls::Tensor x(ls::Shape{count}), y(ls::Shape{4096});
    for (std::int64_t i = 0; i < count; ++i) x.data<float>()[i] = static_cast<float>(rank + i % 5);
    for (std::int64_t i = 0; i < 4096; ++i) y.data<float>()[i] = static_cast<float>(rank);
    auto blocking = [&] { form == 0 ? b.barrier() : b.allreduce(y.view(), ls::ReduceOp::sum); };
    auto r = b.iallreduce(x.view(), ls::ReduceOp::sum);
    if (rank == 0) {
      blocking();
      r.wait();
    } else {
      r.wait();
      blocking();
    }
    for (std::int64_t i = 0; i < count; ++i)
      wrong += x.data<float>()[i] == static_cast<float>(n * (n - 1) / 2 + n * (i % 5)) ? 0 : 1;
    if (form == 1)
      for (std::int64_t i = 0; i < 4096; ++i) wrong += y.data<float>()[i] == static_cast<float>(n * (n - 1) / 2) ? 0 : 1;
  }
  ls::set_timeout(before);
  CHECK(wrong == 0);
}

TEST_CASE("a deadline keeps large calls correct (they go through MPI, which can time out)") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const double before = ls::timeout();
  ls::set_timeout(60);
  const std::int64_t count = std::int64_t{1} << 20;
  ls::Tensor x(ls::Shape{count});
  for (std::int64_t i = 0; i < count; ++i) x.data<float>()[i] = static_cast<float>(rank + i % 3);
  b.allreduce(x.view(), ls::ReduceOp::sum);
  ls::set_timeout(before);
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < count; ++i)
    wrong += x.data<float>()[i] == static_cast<float>(n * (n - 1) / 2 + n * (i % 3)) ? 0 : 1;
  CHECK(wrong == 0);
}

TEST_CASE("ranks that disagree about a call get MismatchError on every rank, and can go on", "[shm]") {
  ls::MPIBackend& b = backend();
  REQUIRE(b.shared_memory());  // this case runs only where the path is on (see the ctest list)
  const int rank = b.rank();
  const std::int64_t count = std::int64_t{1} << 18;
  int round = 0;
  auto expect_mismatch = [&](const char* what, const char* part, auto&& call) {
    const lstest::Refusal r = lstest::refusal_on_marked_buffer(rank, count, call);
    INFO(what << ": rank " << rank << " got: " << (r.threw ? r.text : std::string("no exception")));
    CHECK(all_ranks(r.threw));
    CHECK(all_ranks(r.text.find(part) != std::string::npos));
    CHECK(all_ranks(r.text.find("rank") != std::string::npos));
    // The buffer is as it was: nothing was written before the disagreement was seen.
    CHECK(all_ranks(r.changed == 0));
    // And the backend is still in step: a correct call works.
    ls::Tensor y(ls::Shape{count});
    for (std::int64_t i = 0; i < count; ++i) y.data<float>()[i] = 1.0f;
    b.allreduce(y.view(), ls::ReduceOp::sum);
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < count; ++i) wrong += y.data<float>()[i] == static_cast<float>(b.size()) ? 0 : 1;
    CHECK(all_ranks(wrong == 0));
    ++round;
  };
  expect_mismatch("element count", "elements", [&](ls::Tensor& x) {
    b.allreduce(x.view().slice(0, rank == 0 ? count : count + 1), ls::ReduceOp::sum);
  });
  expect_mismatch("op", "op", [&](ls::Tensor& x) {
    b.allreduce(x.view(), rank == 0 ? ls::ReduceOp::sum : ls::ReduceOp::max);
  });
  expect_mismatch("root", "root", [&](ls::Tensor& x) { b.broadcast(x.view(), rank == 0 ? 0 : 1); });
  expect_mismatch("allreduce against broadcast", "disagree on the collective", [&](ls::Tensor& x) {
    if (rank == 0) b.allreduce(x.view(), ls::ReduceOp::sum);
    else b.broadcast(x.view(), 0);
  });
  expect_mismatch("allreduce_wire16 against a 16-bit allreduce", "disagree on the collective", [&](ls::Tensor& x) {
    // The same bytes would move (16-bit slots), but the calls differ.
    if (rank == 0) b.allreduce_wire16(x.view(), ls::DType::bf16, ls::ReduceOp::sum);
    else b.allreduce(ls::TensorView{x.raw_data(), count, ls::DType::bf16, ls::Device::cpu()}, ls::ReduceOp::sum);
  });
  expect_mismatch("allreduce_wire16 with another wire dtype", "sent as", [&](ls::Tensor& x) {
    b.allreduce_wire16(x.view(), rank == 0 ? ls::DType::bf16 : ls::DType::f16, ls::ReduceOp::avg);
  });
  expect_mismatch("reduce_scatter_wire16 against allreduce_wire16", "disagree on the collective", [&](ls::Tensor& x) {
    const std::int64_t c = count / b.size();
    if (rank == 0) b.allreduce_wire16(x.view().slice(0, c), ls::DType::bf16, ls::ReduceOp::sum);
    else b.reduce_scatter_wire16(x.view().slice(0, c * b.size()), x.view().slice(rank * c, c), ls::DType::bf16,
                                 ls::ReduceOp::sum);
  });
  expect_mismatch("reduce_scatter against allreduce", "disagree on the collective", [&](ls::Tensor& x) {
    const std::int64_t c = count / b.size();
    if (rank == 0) b.allreduce(x.view().slice(0, c), ls::ReduceOp::sum);
    else b.reduce_scatter(x.view().slice(0, c * b.size()), x.view().slice(rank * c, c), ls::ReduceOp::sum);
  });
  // A 16-bit call that one rank makes with no elements: every rank agrees on the call before
  // any of them decides whether the path moves it, so every rank's record is the 16-bit form's,
  // and the report names the element count (not the three passes' 16-bit allreduce).
  expect_mismatch("allreduce_wire16 with no elements on other ranks", "allreduce_wire16 of 0 f32 elements",
                  [&](ls::Tensor& x) {
                    b.allreduce_wire16(x.view().slice(0, rank == 0 ? count : 0), ls::DType::bf16,
                                       ls::ReduceOp::sum);
                  });
  expect_mismatch("reduce_scatter_wire16 with no elements on other ranks", "reduce_scatter_wire16 of 0 f32 elements",
                  [&](ls::Tensor& x) {
                    const std::int64_t c = rank == 0 ? count / b.size() : 0;
                    b.reduce_scatter_wire16(x.view().slice(0, c * b.size()), x.view().slice(rank * c, c),
                                            ls::DType::f16, ls::ReduceOp::avg);
                  });
  // A barrier is agreed on the path too: against an allreduce it is the same MismatchError,
  // found by the path (its record's field is "the collective"). With fingerprints on
  // (LOCKSTEP_CHECK) the monitor finds it first (its field is "the operation"), with the call
  // number and site.
  auto barrier_against_allreduce = [&](ls::Tensor& x) {
    if (rank == 0) b.barrier();
    else b.allreduce(x.view(), ls::ReduceOp::sum);
  };
  expect_mismatch("barrier against allreduce", "disagree on the collective (rank 0: barrier;",
                  barrier_against_allreduce);
  const ls::CheckLevel level = ls::check_level();
  ls::set_check_level(ls::CheckLevel::always);
  expect_mismatch("barrier against allreduce, checked", "disagree on the operation (rank 0: barrier;",
                  barrier_against_allreduce);
  ls::set_check_level(level);
  CHECK(round == 12);
  // The report is built from every rank's header: each field that differs with the ranks
  // holding each value, what each rank called, and the odd ones out where a majority agrees.
  const lstest::Refusal r = lstest::refusal_on_marked_buffer(rank, count, [&](ls::Tensor& x) {
    b.allreduce(x.view().slice(0, rank == 0 ? count : count - 1), ls::ReduceOp::sum);
  });
  std::string others = b.size() == 2 ? "rank 1" : "ranks 1";
  for (int p = 2; p < b.size(); ++p) others += ", " + std::to_string(p);
  INFO(r.text);
  CHECK(all_ranks(r.threw));
  CHECK(all_ranks(r.text.find("disagree on the element count (rank 0: " + std::to_string(count) + "; " + others +
                              ": " + std::to_string(count - 1) + ")") != std::string::npos));
  bool lines = r.text.find("What each rank called:\n  rank 0: allreduce of " + std::to_string(count) +
                           " f32 elements with op sum") != std::string::npos;
  for (int p = 1; p < b.size(); ++p)
    lines = lines && r.text.find("\n  rank " + std::to_string(p) + ": allreduce of " + std::to_string(count - 1) +
                                 " f32 elements with op sum\n") != std::string::npos;
  CHECK(all_ranks(lines));
  CHECK(all_ranks((r.text.find("Odd one(s) out: rank 0.") != std::string::npos) == (b.size() > 2)));
}

TEST_CASE("allreduce of bf16 and f16: sums in f32, rounded once, on the shared-memory path", "[shm]") {
  ls::MPIBackend& b = backend();
  REQUIRE(b.shared_memory());
  const int n = b.size(), rank = b.rank();
  for (ls::DType w : {ls::DType::bf16, ls::DType::f16}) {
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg}) {
      for (std::int64_t count : boundary_sizes()) {
        ls::Tensor t = ls::Tensor::zeros({count}, w);
        auto* p = static_cast<std::uint16_t*>(t.raw_data());
        auto bits = [&](float f) { return w == ls::DType::bf16 ? ls::to_bfloat16(f).bits : ls::to_half(f).bits; };
        auto value = [&](std::uint16_t u) { return w == ls::DType::bf16 ? ls::to_float(ls::bfloat16{u}) : ls::to_float(ls::half{u}); };
        for (std::int64_t i = 0; i < count; ++i) p[i] = bits(input(rank, i));
        b.allreduce(t.view(), op);
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < count; ++i) {
          float acc = value(bits(input(0, i)));
          for (int r = 1; r < n; ++r) acc += value(bits(input(r, i)));
          if (op == ls::ReduceOp::avg) acc = (n & (n - 1)) == 0 ? acc * (1.0f / static_cast<float>(n)) : acc / static_cast<float>(n);
          wrong += p[i] == bits(acc) ? 0 : 1;
        }
        INFO(ls::name(w) << " " << ls::name(op) << " of " << count << " elements: " << wrong << " wrong");
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("reduce_scatter: each rank's block of the allreduce, bit for bit, in place and out of place") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const bool bitwise = b.shared_memory();  // the same fold as allreduce's there
  std::vector<std::string> bad;
  std::vector<std::int64_t> counts = boundary_sizes();
  for (std::int64_t c : {1, 2, 3, 1000}) counts.push_back(c);  // below one slice per rank, and tiny
  for (std::int64_t count : counts) {
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg, ls::ReduceOp::max}) {
      for (bool in_place : {true, false}) {
        const std::int64_t all = count * n;
        ls::Tensor x(ls::Shape{all}), out(ls::Shape{count});
        float* px = x.data<float>();
        for (std::int64_t i = 0; i < all; ++i) px[i] = input(rank, i);
        ls::TensorView recv = in_place ? x.view().slice(rank * count, count) : out.view();
        b.reduce_scatter(x.view(), recv, op);
        const float* got = static_cast<const float*>(recv.data);
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < count; ++i) {
          const float want = fold(op, n, rank * count + i);
          const bool ok = bitwise ? std::memcmp(&got[i], &want, 4) == 0
                                  : std::fabs(got[i] - want) <= 1e-5f * (1.0f + std::fabs(want));
          wrong += ok ? 0 : 1;
        }
        // Out of place, send is untouched (in place, the other blocks are left undefined: MPI's
        // in-place form leaves its result in the first block).
        if (!in_place)
          for (std::int64_t i = 0; i < all; ++i) wrong += px[i] == input(rank, i) ? 0 : 1;
        if (wrong != 0)
          bad.push_back(ls::detail::concat(ls::name(op), " count ", count, in_place ? " in place" : " out of place",
                                           ": ", wrong, " wrong elements"));
      }
    }
  }
  INFO(ls::detail::concat(bad.size(), " failing cases, first: ", bad.empty() ? "" : bad.front()));
  CHECK(all_ranks(bad.empty()));
}

TEST_CASE("allgather in place: send is this rank's block of recv") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  std::vector<std::int64_t> counts = boundary_sizes();
  for (std::int64_t c : {1, 3, 1000}) counts.push_back(c);
  std::int64_t wrong = 0;
  for (std::int64_t count : counts) {
    for (bool in_place : {true, false}) {
      ls::Tensor all(ls::Shape{count * n}), mine(ls::Shape{count});
      float* pa = all.data<float>();
      for (std::int64_t i = 0; i < count * n; ++i) pa[i] = i / count == rank ? static_cast<float>(i % 8191 + rank) : -1.0f;
      for (std::int64_t i = 0; i < count; ++i) mine.data<float>()[i] = static_cast<float>((rank * count + i) % 8191 + rank);
      b.allgather(in_place ? all.view().slice(rank * count, count) : mine.view(), all.view());
      for (std::int64_t i = 0; i < count * n; ++i) wrong += pa[i] == static_cast<float>(i % 8191 + i / count) ? 0 : 1;
    }
  }
  CHECK(all_ranks(wrong == 0));
  // Any other overlap of send and recv is still refused, on every rank alike.
  ls::Tensor t(ls::Shape{4 * n + 1});
  bool refused = false;
  try {
    b.allgather(t.view().slice(1, 4), t.view().slice(0, 4 * n));  // no rank's own block
  } catch (const ls::InvalidArgument& e) {
    refused = std::string(e.what()).find("overlap") != std::string::npos;
  }
  CHECK(all_ranks(refused));
}

TEST_CASE("reduce_scatter of bf16 and f16: each block as the allreduce has it", "[shm]") {
  ls::MPIBackend& b = backend();
  REQUIRE(b.shared_memory());
  const int n = b.size(), rank = b.rank();
  std::int64_t wrong = 0;
  for (ls::DType w : {ls::DType::bf16, ls::DType::f16}) {
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg}) {
      for (std::int64_t count : boundary_sizes()) {
        ls::Tensor a = ls::Tensor::zeros({count * n}, w), r = ls::Tensor::zeros({count * n}, w);
        auto* pa = static_cast<std::uint16_t*>(a.raw_data());
        auto* pr = static_cast<std::uint16_t*>(r.raw_data());
        for (std::int64_t i = 0; i < count * n; ++i) {
          const float f = input(rank, i);
          pa[i] = pr[i] = w == ls::DType::bf16 ? ls::to_bfloat16(f).bits : ls::to_half(f).bits;
        }
        b.allreduce(a.view(), op);
        b.reduce_scatter(r.view(), r.view().slice(rank * count, count), op);
        for (std::int64_t i = rank * count; i < (rank + 1) * count; ++i) wrong += pa[i] == pr[i] ? 0 : 1;
      }
    }
  }
  CHECK(all_ranks(wrong == 0));
}

namespace {

std::uint16_t wire_bits(ls::DType w, float f) { return w == ls::DType::bf16 ? ls::to_bfloat16(f).bits : ls::to_half(f).bits; }
float wire_value(ls::DType w, std::uint16_t u) {
  return w == ls::DType::bf16 ? ls::to_float(ls::bfloat16{u}) : ls::to_float(ls::half{u});
}

// Sizes for the 16-bit collectives: the slice boundaries (of f32), and odd sizes below a slice.
std::vector<std::int64_t> wire_sizes() {
  std::vector<std::int64_t> counts = boundary_sizes();
  for (std::int64_t c : {1, 2, 3, 1000, 4097, 16411}) counts.push_back(c);
  return counts;
}

// The three passes, with the backend's own 16-bit allreduce: x rounded into a 16-bit copy, the
// copy allreduced with sum, widened back and divided by n for avg.
std::vector<float> three_passes(ls::MPIBackend& b, const std::vector<float>& x, ls::DType w, ls::ReduceOp op) {
  const auto count = static_cast<std::int64_t>(x.size());
  ls::Tensor t = ls::Tensor::zeros({count}, w);
  auto* p = static_cast<std::uint16_t*>(t.raw_data());
  for (std::int64_t i = 0; i < count; ++i) p[i] = wire_bits(w, x[static_cast<std::size_t>(i)]);
  b.allreduce(t.view(), ls::ReduceOp::sum);
  std::vector<float> out(x.size());
  const float div = op == ls::ReduceOp::avg ? static_cast<float>(b.size()) : 1.0f;
  for (std::int64_t i = 0; i < count; ++i) out[static_cast<std::size_t>(i)] = wire_value(w, p[i]) / div;
  return out;
}

// Rank r's values for the 16-bit cases: gradients of assorted magnitudes, a few exact ties of
// the rounding, and (at index 7) values whose 16-bit sum overflows f16.
float wire_input(int r, std::int64_t i) {
  if (i % 1009 == 7) return 40000.0f + static_cast<float>(r);
  if (i % 97 == 5) return 1.0f + std::ldexp(1.0f, -8) * static_cast<float>(r + 1);  // halfway cases of bf16
  return input(r, i) * std::ldexp(1.0f, static_cast<int>(i % 9) - 6);
}

}  // namespace

TEST_CASE("allreduce_wire16: the bits of the three passes, every size, bf16 and f16, sum and avg") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  std::vector<std::string> bad;
  for (ls::DType w : {ls::DType::bf16, ls::DType::f16}) {
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg}) {
      for (std::int64_t count : wire_sizes()) {
        std::vector<float> x(static_cast<std::size_t>(count));
        for (std::int64_t i = 0; i < count; ++i) x[static_cast<std::size_t>(i)] = wire_input(rank, i);
        const std::vector<float> want = three_passes(b, x, w, op);
        ls::Tensor t = ls::Tensor::zeros({count});
        std::copy(x.begin(), x.end(), t.data<float>());
        b.allreduce_wire16(t.view(), w, op);
        const float* got = t.data<float>();
        std::int64_t wrong = 0, wrong_fold = 0;
        for (std::int64_t i = 0; i < count; ++i) {
          wrong += std::memcmp(&got[i], &want[static_cast<std::size_t>(i)], 4) == 0 ? 0 : 1;
          // On the shared-memory path the sum is in f32, in rank order, rounded once.
          if (b.shared_memory()) {
            float acc = wire_value(w, wire_bits(w, wire_input(0, i)));
            for (int r = 1; r < n; ++r) acc += wire_value(w, wire_bits(w, wire_input(r, i)));
            const float f = wire_value(w, wire_bits(w, acc)) / (op == ls::ReduceOp::avg ? static_cast<float>(n) : 1.0f);
            wrong_fold += std::memcmp(&got[i], &f, 4) == 0 ? 0 : 1;
          }
        }
        if (wrong + wrong_fold != 0)
          bad.push_back(ls::detail::concat(ls::name(w), " ", ls::name(op), " of ", count, ": ", wrong,
                                           " differ from the three passes, ", wrong_fold, " from the rank-order fold"));
        if (!same_on_every_rank(got, static_cast<std::size_t>(count) * 4))
          bad.push_back(ls::detail::concat(ls::name(w), " ", ls::name(op), " of ", count, ": ranks differ"));
      }
    }
  }
  INFO(ls::detail::concat(bad.size(), " failing cases, first: ", bad.empty() ? "" : bad.front()));
  CHECK(all_ranks(bad.empty()));
}

TEST_CASE("reduce_scatter_wire16: each block as allreduce_wire16 has it, in place and out of place") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  // The same additions as allreduce_wire16 on the shared-memory path; over MPI up to 2 ranks (one
  // addition); from 3 ranks up MPI's reduce-scatter may round its partial sums in another order.
  const bool bitwise = b.shared_memory() || n <= 2;
  std::vector<std::string> bad;
  for (ls::DType w : {ls::DType::bf16, ls::DType::f16}) {
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg}) {
      for (std::int64_t count : wire_sizes()) {
        for (bool in_place : {true, false}) {
          const std::int64_t all = count * n;
          ls::Tensor a = ls::Tensor::zeros({all}), x = ls::Tensor::zeros({all}), out = ls::Tensor::zeros({count});
          for (std::int64_t i = 0; i < all; ++i) a.data<float>()[i] = x.data<float>()[i] = wire_input(rank, i);
          b.allreduce_wire16(a.view(), w, op);
          ls::TensorView recv = in_place ? x.view().slice(rank * count, count) : out.view();
          b.reduce_scatter_wire16(x.view(), recv, w, op);
          const float* got = static_cast<const float*>(recv.data);
          const float* want = a.data<float>() + rank * count;
          std::int64_t wrong = 0;
          for (std::int64_t i = 0; i < count; ++i) {
            if (bitwise) {
              wrong += std::memcmp(&got[i], &want[i], 4) == 0 ? 0 : 1;
              continue;
            }
            // Otherwise within a few roundings to the wire dtype of the terms' magnitude (f16 sums
            // of the large values overflow to infinity on every path).
            float scale = 0;
            for (int r = 0; r < n; ++r) scale += std::fabs(wire_input(r, rank * count + i));
            const float tol = (w == ls::DType::bf16 ? 1.0f / 64 : 1.0f / 512) * scale;
            wrong += got[i] == want[i] || std::fabs(got[i] - want[i]) <= tol ? 0 : 1;
          }
          if (!in_place)  // send is untouched
            for (std::int64_t i = 0; i < all; ++i) wrong += x.data<float>()[i] == wire_input(rank, i) ? 0 : 1;
          if (wrong != 0)
            bad.push_back(ls::detail::concat(ls::name(w), " ", ls::name(op), " of ", count,
                                             in_place ? " in place" : " out of place", ": ", wrong, " wrong"));
        }
      }
    }
  }
  INFO(ls::detail::concat(bad.size(), " failing cases, first: ", bad.empty() ? "" : bad.front()));
  CHECK(all_ranks(bad.empty()));
}

TEST_CASE("allreduce_wire16 and reduce_scatter_wire16 refuse what they cannot compress, on every rank") {
  ls::MPIBackend& b = backend();
  const int n = b.size();
  auto refused = [&](auto&& call, const char* part) {
    std::string text;
    try {
      call();
    } catch (const ls::InvalidArgument& e) {
      text = e.what();
    }
    INFO("got: " << text);
    return all_ranks(text.find(part) != std::string::npos);
  };
  ls::Tensor f32 = ls::Tensor::zeros({8 * n}), f64 = ls::Tensor::zeros({8}, ls::DType::f64);
  CHECK(refused([&] { b.allreduce_wire16(f64.view(), ls::DType::bf16, ls::ReduceOp::sum); }, "must be f32"));
  CHECK(refused([&] { b.allreduce_wire16(f32.view(), ls::DType::f32, ls::ReduceOp::sum); }, "bf16 or f16"));
  CHECK(refused([&] { b.allreduce_wire16(f32.view(), ls::DType::bf16, ls::ReduceOp::max); }, "sum or avg"));
  CHECK(refused([&] { b.reduce_scatter_wire16(f32.view(), f32.view().slice(0, 3), ls::DType::f16, ls::ReduceOp::avg); },
                "overlap"));
  // The backend is still in step.
  for (std::int64_t i = 0; i < 8 * n; ++i) f32.data<float>()[i] = 1.0f;
  b.allreduce_wire16(f32.view(), ls::DType::bf16, ls::ReduceOp::sum);
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < 8 * n; ++i) wrong += f32.data<float>()[i] == static_cast<float>(n) ? 0 : 1;
  CHECK(all_ranks(wrong == 0));
}

TEST_CASE("allocate_reduce_buffer: in-place allreduces of it reduce the buffers where they lie, the same bits",
          "[shm]") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const std::int64_t slice = static_cast<std::int64_t>(env_size("LOCKSTEP_SHM_SLICE_BYTES", 1 << 20)) / 4;
  const std::int64_t count = std::max<std::int64_t>(3 * slice + 5, 70000);  // above the 64 KiB floor
  const std::int64_t pad = 16;
  std::shared_ptr<void> mem = b.allocate_reduce_buffer(static_cast<std::size_t>(count + 2 * pad) * 4);
  REQUIRE(mem != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(mem.get()) % 64 == 0);
  auto* base = static_cast<float*>(mem.get());
  std::int64_t nonzero = 0;
  for (std::int64_t i = 0; i < count + 2 * pad; ++i) nonzero += base[i] != 0.0f ? 1 : 0;
  CHECK(nonzero == 0);  // zeroed
  const std::uint64_t before = b.in_place_allreduces();
  // LOCKSTEP_FAULT=rank=R,kind=no_segment (ctest shm_collectives.no_segment): rank R could not
  // make its segment, so every rank got ordinary memory and nothing goes in place.
  const char* fault = std::getenv("LOCKSTEP_FAULT");
  const bool no_segment = fault != nullptr && std::string(fault).find("kind=no_segment") != std::string::npos;
  // Offsets and placements: the same offset on every rank (in place), a different offset on the
  // ranks above 0, and rank 0 with an ordinary buffer (both through the slots, same bits).
  enum class Where { same, shifted, rank0_plain };
  std::vector<std::string> bad;
  std::uint64_t expect_in_place = 0;
  for (Where where : {Where::same, Where::shifted, Where::rank0_plain}) {
    for (std::int64_t offset : {std::int64_t{0}, pad}) {
      for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg, ls::ReduceOp::max}) {
        std::vector<float> plain(static_cast<std::size_t>(count + 2 * pad), -7.0f);
        std::int64_t off = offset;
        if (where == Where::shifted && rank > 0) off = offset == 0 ? pad : 0;
        float* buf = where == Where::rank0_plain && rank == 0 ? plain.data() + off : base + off;
        float* whole = where == Where::rank0_plain && rank == 0 ? plain.data() : base;
        for (std::int64_t i = 0; i < count + 2 * pad; ++i) whole[i] = -7.0f;  // what must stay
        for (std::int64_t i = 0; i < count; ++i) buf[i] = input(rank, i);
        b.allreduce(ls::TensorView{buf, count, ls::DType::f32, ls::Device::cpu()}, op);
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < count; ++i) {
          const float want = fold(op, n, i);
          wrong += std::memcmp(&buf[i], &want, 4) == 0 ? 0 : 1;
        }
        std::int64_t touched = 0;
        for (std::int64_t i = 0; i < count + 2 * pad; ++i)
          if (whole + i < buf || whole + i >= buf + count) touched += whole[i] == -7.0f ? 0 : 1;
        if (where == Where::same && b.shared_memory() && !no_segment) ++expect_in_place;
        if (!all_ranks(wrong == 0 && touched == 0))
          bad.push_back(ls::detail::concat(ls::name(op), " offset ", offset, " placement ", static_cast<int>(where),
                                           ": ", wrong, " wrong elements, ", touched, " written outside"));
      }
    }
  }
  INFO(ls::detail::concat(bad.size(), " failing cases, first: ", bad.empty() ? "" : bad.front()));
  CHECK(bad.empty());
  // Only the calls with the same offset of the same allocation on every rank went in place.
  CHECK(b.in_place_allreduces() - before == expect_in_place);
  // Integers and doubles too, and below the floor (through the slots, still right).
  {
    auto* d = static_cast<double*>(mem.get());
    const std::int64_t dc = (count + 2 * pad) / 2;
    for (std::int64_t i = 0; i < dc; ++i) d[i] = 0.5 * static_cast<double>(i % 77) + rank;
    b.allreduce(ls::TensorView{d, dc, ls::DType::f64, ls::Device::cpu()}, ls::ReduceOp::sum);
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < dc; ++i)
      wrong += d[i] == n * 0.5 * static_cast<double>(i % 77) + n * (n - 1) / 2.0 ? 0 : 1;
    auto* k = static_cast<std::int32_t*>(mem.get());
    for (std::int64_t i = 0; i < 100; ++i) k[i] = static_cast<std::int32_t>(i) - rank;
    b.allreduce(ls::TensorView{k, 100, ls::DType::i32, ls::Device::cpu()}, ls::ReduceOp::min);
    for (std::int64_t i = 0; i < 100; ++i) wrong += k[i] == static_cast<std::int32_t>(i) - (n - 1) ? 0 : 1;
    CHECK(all_ranks(wrong == 0));
  }
}

TEST_CASE("allocate_reduce_buffer: ranks that ask for different sizes get InvalidArgument on every rank") {
  ls::MPIBackend& b = backend();
  if (b.size() < 2) return;
  std::string what;
  try {
    (void)b.allocate_reduce_buffer(b.rank() == 0 ? 4096 : 8192);
  } catch (const ls::InvalidArgument& e) {
    what = e.what();
  }
  CHECK(what.find("different sizes (from 4096 to 8192 bytes)") != std::string::npos);
  // Usable afterwards, and the memory outlives its use: a later allocation works.
  std::shared_ptr<void> m = b.allocate_reduce_buffer(1 << 20);
  CHECK(m != nullptr);
  CHECK(b.allocate_reduce_buffer(0) == nullptr);
}
