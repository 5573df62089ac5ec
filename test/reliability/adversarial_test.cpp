// Adversarial tests of the trust mechanisms (docs/reliability.md, "The promises and how they are
// kept"): mixed forms of one collective across ranks, refusals in bulk, the shared-memory path's
// agreement at its size boundaries, several backends at once, extreme settings. As in
// trust_test.cpp, each rank records its outcome locally and the pass flags are combined after the
// last collective (no REQUIRE between collectives).
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace ls = lockstep;
using namespace lstest;

namespace {
ls::MPIBackend& backend() { return world_backend(); }
}  // namespace

TEST_CASE("reduce: ranks may mix the in-place and the out-of-place form") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), r = b.rank();
  bool ok = true;
  std::string log;
  for (int root = 0; root < n; ++root) {
    for (int pattern = 0; pattern < 4; ++pattern) {
      // pattern bit 0: root out of place; bit 1: the others out of place (even ranks only).
      const bool out_of_place = r == root ? (pattern & 1) != 0 : (pattern & 2) != 0 && r % 2 == 0;
      ls::Tensor send = ls::Tensor::full({64}, r + 1.0);
      ls::Tensor recv = ls::Tensor::zeros({64});
      ls::Tensor garbage = ls::Tensor::zeros({3}, ls::DType::i64);  // ignored off root
      if (out_of_place) b.reduce(send, r == root ? recv.view() : garbage.view(), ls::ReduceOp::sum, root);
      else b.reduce(send, ls::ReduceOp::sum, root);
      const float want = static_cast<float>(n * (n + 1) / 2);
      if (r == root) {
        const float got = (out_of_place ? recv : send).data<float>()[63];
        if (got != want) {
          ok = false;
          log += "root " + std::to_string(root) + " pattern " + std::to_string(pattern) + ": got " +
                 std::to_string(got) + "\n";
        }
      } else if (send.data<float>()[0] != r + 1.0f) {
        ok = false;
        log += "non-root buffer changed\n";
      }
      // A broadcast right after must carry root's bytes (not a stale verdict).
      std::vector<std::uint8_t> bytes(256, r == root ? 7 : 0);
      b.broadcast(ls::TensorView{bytes.data(), 256, ls::DType::u8, ls::Device::cpu()}, root);
      if (bytes[0] != 7 || bytes[255] != 7) {
        ok = false;
        log += "broadcast after reduce gave " + std::to_string(bytes[0]) + "\n";
      }
    }
  }
  INFO("rank " << r << ":\n" << log);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("reduce: root passes send == recv, the others pass a recv that would be refused") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), r = b.rank();
  ls::Tensor x = ls::Tensor::full({8}, r + 1.0);
  ls::TensorView bad_recv = r == 0 ? x.view() : ls::TensorView{x.view().data, 7, ls::DType::f32, ls::Device::cpu()};
  const std::string got = outcome([&] { b.reduce(x, bad_recv, ls::ReduceOp::sum, 0); });
  bool ok = got == "no exception";
  if (r == 0) ok = ok && x.data<float>()[7] == static_cast<float>(n * (n + 1) / 2);
  else ok = ok && x.data<float>()[0] == r + 1.0f;
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("symmetric refusals in bulk leave the backend usable and in step") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), r = b.rank();
  ls::TensorView null_view{nullptr, 8, ls::DType::f32, ls::Device::cpu()};
  int refused = 0;
  // At 2 ranks, more than the 4096 refusals the first implementation remembered: a late notice
  // for an early one made the receiving rank mark its backend unusable. At 3 and 4 ranks (about
  // 3.5 ms a refusal there, oversubscribed) fewer: the 4096 window is also guarded at 4 ranks
  // by reliability.adversarial.refuse_flood.np4 (6000 refusals).
  const int bulk = n <= 2 ? 5000 : 600;
  for (int i = 0; i < bulk; ++i) {
    try {
      if (i % 3 == 0) b.allreduce(null_view, ls::ReduceOp::sum);
      else if (i % 3 == 1) b.broadcast(null_view, 0);
      else b.allreduce(null_view, null_view, ls::ReduceOp::sum);
    } catch (const ls::InvalidArgument&) {
      ++refused;
    }
  }
  ls::Tensor x = ls::Tensor::full({2048}, 1.0);
  std::string got = outcome([&] {
    for (int i = 0; i < 3; ++i) b.allreduce(x, ls::ReduceOp::sum);
    b.barrier();
  });
  bool ok = refused == bulk && got == "no exception" && b.usable() &&
            x.data<float>()[2047] == static_cast<float>(n * n * n);
  INFO("rank " << r << ": refused " << refused << ", then " << got);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("refusal at the first unchecked call of a site after first:N, symmetric") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  const ls::CheckLevel level = ls::check_level();
  const int calls = ls::check_first_calls();
  ls::set_check_level(ls::CheckLevel::first, 2);
  ls::TensorView null_view{nullptr, 8, ls::DType::f32, ls::Device::cpu()};
  std::vector<std::string> got;
  for (int i = 0; i < 4; ++i)  // calls 1-2 checked, 3-4 not; every rank refuses
    got.push_back(expect_throw<ls::InvalidArgument>([&] { b.allreduce(null_view, ls::ReduceOp::sum); }));
  ls::Tensor x = ls::Tensor::ones({16});
  b.allreduce(x, ls::ReduceOp::sum);
  bool ok = x.data<float>()[0] == static_cast<float>(b.size()) && b.usable();
  for (const auto& g : got) ok = ok && is_ok(g);
  ls::set_check_level(level, calls);
  INFO("rank " << r << ": " << got[0] << " / " << got[3]);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("a refused argument on one rank at call N of first:N is a MismatchError on every rank") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  if (b.size() == 1) return;
  const ls::CheckLevel level = ls::check_level();
  const int calls = ls::check_first_calls();
  ls::set_check_level(ls::CheckLevel::first, 3);
  ls::Tensor x = ls::Tensor::ones({16});
  ls::TensorView null_view{nullptr, 16, ls::DType::f32, ls::Device::cpu()};
  const bool last = r == b.size() - 1;
  std::string got;
  for (int i = 0; i < 3; ++i) {  // the third call is the last checked one; the last rank refuses it
    const std::string g = expect_throw<ls::MismatchError>(
        [&] { b.allreduce(i == 2 && last ? null_view : x.view(), ls::ReduceOp::sum); });
    if (i == 2) got = g;
  }
  bool ok = is_ok(got) && got.find("refused") != std::string::npos;
  const float after_two = static_cast<float>(b.size() * b.size());
  ok = ok && x.data<float>()[0] == after_two;  // the refused call moved nothing
  ls::set_check_level(level, calls);
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("shared-memory path: every mismatched pair of calls is a MismatchError on every rank") {
  ls::MPIBackend& b = backend();
  if (!b.shared_memory()) {
    SUCCEED("no shared-memory path");
    return;
  }
  const int r = b.rank();
  const std::int64_t min_elems = 4096 / 4;  // the default LOCKSTEP_SHM_MIN_BYTES, in f32
  struct Case {
    const char* what;
    std::int64_t n0, n1;  // element counts on rank 0 and on the others
    bool bcast0, bcast1;  // broadcast (true) or allreduce
  };
  const Case cases[] = {
      {"0 against 1024 elements", 0, 1024, false, false},
      {"1024 against 0 elements", 1024, 0, false, false},
      {"just below against at LOCKSTEP_SHM_MIN_BYTES", min_elems - 1, min_elems, false, false},
      {"allreduce against broadcast of the same bytes, small", 64, 64, false, true},
      {"allreduce against broadcast of the same bytes, large", 1 << 18, 1 << 18, false, true},
      {"broadcast against allreduce, zero size", 0, 0, true, false},
  };
  bool ok = true;
  std::string log;
  for (const Case& c : cases) {
    const std::int64_t mine = r == 0 ? c.n0 : c.n1;
    const bool bcast = r == 0 ? c.bcast0 : c.bcast1;
    ls::Tensor x = ls::Tensor::full({mine}, 2.0);
    const std::string got = expect_throw<ls::MismatchError>([&] {
      if (bcast) b.broadcast(x, 0);
      else b.allreduce(x, ls::ReduceOp::sum);
    });
    bool intact = true;
    for (std::int64_t i = 0; i < mine; ++i) intact = intact && x.data<float>()[i] == 2.0f;
    if (!is_ok(got) || !intact) {
      ok = false;
      log += std::string(c.what) + ": " + got.substr(0, 200) + (intact ? "" : " (buffer written)") + "\n";
    }
  }
  // Still usable and in step.
  ls::Tensor y = ls::Tensor::ones({4096});
  b.allreduce(y, ls::ReduceOp::sum);
  ok = ok && y.data<float>()[4095] == static_cast<float>(b.size());
  INFO("rank " << r << ":\n" << log);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("shared-memory path: in-place and out-of-place ranks mixed, sizes across every boundary") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), r = b.rank();
  bool ok = true;
  std::string log;
  const std::int64_t sizes[] = {0, 1, 1023, 1024, 1025, 4095, 4096, 4097, (1 << 14) + 3, (1 << 16) + 17};
  for (std::int64_t m : sizes) {
    for (int op = 0; op < 2; ++op) {
      const ls::ReduceOp rop = op == 0 ? ls::ReduceOp::sum : ls::ReduceOp::max;
      ls::Tensor send = ls::Tensor::zeros({m}, ls::DType::i32);
      for (std::int64_t i = 0; i < m; ++i) send.data<std::int32_t>()[i] = static_cast<std::int32_t>(i % 97 + r);
      ls::Tensor recv = ls::Tensor::zeros({m}, ls::DType::i32);
      const bool in_place = (r + m) % 2 == 0;
      if (in_place) b.allreduce(send, rop);
      else b.allreduce(send, recv, rop);
      const ls::Tensor& out = in_place ? send : recv;
      for (std::int64_t i = 0; i < m; ++i) {
        const std::int32_t base = static_cast<std::int32_t>(i % 97);
        const std::int32_t want = op == 0 ? base * n + n * (n - 1) / 2 : base + n - 1;
        if (out.data<std::int32_t>()[i] != want) {
          ok = false;
          log += "size " + std::to_string(m) + " op " + std::to_string(op) + " element " + std::to_string(i) +
                 ": got " + std::to_string(out.data<std::int32_t>()[i]) + " want " + std::to_string(want) + "\n";
          break;
        }
      }
      // Broadcast of the same size from a rotating root.
      const int root = static_cast<int>(m % n);
      ls::Tensor bc = ls::Tensor::full({m}, r == root ? 5.0 : -1.0, ls::DType::f64);
      b.broadcast(bc, root);
      for (std::int64_t i = 0; i < m; ++i)
        if (bc.data<double>()[i] != 5.0) {
          ok = false;
          log += "broadcast size " + std::to_string(m) + " element " + std::to_string(i) + "\n";
          break;
        }
    }
  }
  INFO("rank " << r << ":\n" << log);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("two backends on MPI_COMM_WORLD and backends on split communicators, used alternately") {
  ls::MPIBackend& g = backend();
  const int n = g.size(), r = g.rank();
  ls::MPIBackend a(MPI_COMM_WORLD);
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, r % 2, r, &half);
  ls::MPIBackend h(half);
  MPI_Comm_free(&half);  // the backend holds its own duplicate
  int half_size = 0;
  for (int q = 0; q < n; ++q) half_size += q % 2 == r % 2;
  bool ok = h.size() == half_size;
  std::string log;
  for (int i = 0; i < 50; ++i) {
    const std::int64_t m = i % 2 == 0 ? 16 : 8192;
    ls::Tensor x = ls::Tensor::full({m}, 1.0);
    ls::Tensor y = ls::Tensor::full({m}, 2.0);
    ls::Tensor z = ls::Tensor::full({m}, 3.0);
    // Refusals on one backend (every rank alike) must not disturb the others.
    if (i % 10 == 0)
      (void)expect_throw<ls::InvalidArgument>(
          [&] { a.allreduce(ls::TensorView{nullptr, 4, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum); });
    a.allreduce(x, ls::ReduceOp::sum);
    h.allreduce(y, ls::ReduceOp::sum);
    g.allreduce(z, ls::ReduceOp::sum);
    if (x.data<float>()[m - 1] != n || y.data<float>()[m - 1] != 2.0f * half_size || z.data<float>()[m - 1] != 3.0f * n) {
      ok = false;
      log += "iteration " + std::to_string(i) + " wrong\n";
    }
  }
  ok = ok && a.usable() && h.usable() && g.usable();
  INFO("rank " << r << ":\n" << log);
  CHECK(all_ranks(g, ok));
}

TEST_CASE("a moved-from MPIBackend: every method") {
  ls::initialize<ls::MPIBackend>();
  ls::MPIBackend a(MPI_COMM_WORLD);
  ls::MPIBackend b(std::move(a));
  ls::Tensor x = ls::Tensor::ones({4});
  ls::Tensor y = ls::Tensor::ones({4});
  ls::Tensor big = ls::Tensor::ones({4 * 64});
  CHECK(a.rank() == 0);
  CHECK(a.size() == 0);
  CHECK(a.local_rank() == 0);
  CHECK(a.local_size() == 0);
  CHECK(a.comm() == MPI_COMM_NULL);
  CHECK_FALSE(a.cuda_aware());
  a.set_cuda_aware(true);
  CHECK_FALSE(a.cuda_aware());
  CHECK_FALSE(a.shared_memory());
  CHECK_FALSE(a.usable());
  CHECK(a.name() == "mpi");
  CHECK_THROWS_AS(a.broadcast(x, 0), ls::InvalidArgument);
  CHECK_THROWS_AS(a.allreduce(x, ls::ReduceOp::sum), ls::InvalidArgument);
  CHECK_THROWS_AS(a.allreduce(x, y, ls::ReduceOp::sum), ls::InvalidArgument);
  CHECK_THROWS_AS(a.reduce(x, ls::ReduceOp::sum, 0), ls::InvalidArgument);
  CHECK_THROWS_AS(a.reduce(x, y, ls::ReduceOp::sum, 0), ls::InvalidArgument);
  CHECK_THROWS_AS(a.allgather(x, big), ls::InvalidArgument);
  CHECK_THROWS_AS(a.reduce_scatter(big, x, ls::ReduceOp::sum), ls::InvalidArgument);
  CHECK_THROWS_AS(a.barrier(), ls::InvalidArgument);
  CHECK_THROWS_AS(a.iallreduce(x, ls::ReduceOp::sum), ls::InvalidArgument);
  CHECK_THROWS_AS(a.ibroadcast(x, 0), ls::InvalidArgument);
  // Bad arguments too: still the moved-from error, nothing sent to anyone.
  CHECK_THROWS_AS(a.allreduce(ls::TensorView{nullptr, 4, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum),
                  ls::InvalidArgument);
  // Moving into the moved-from one and back.
  a = std::move(b);
  CHECK(a.usable());
  CHECK_FALSE(b.usable());
  a.allreduce(x, ls::ReduceOp::sum);
  CHECK(x.data<float>()[0] == static_cast<float>(a.size()));
  CHECK(all_ranks(backend(), true));
}

TEST_CASE("set_timeout with a huge finite value does not time out at once") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  // Last in this file: there is no way back to the default deadline afterwards (0 turns it off).
  ls::set_timeout(1e300);
  ls::Tensor x = ls::Tensor::full({16}, 1.0);
  ls::Tensor big = ls::Tensor::ones({1 << 20});
  const std::string got = outcome([&] {
    for (int i = 0; i < 20; ++i) b.allreduce(x, ls::ReduceOp::sum);
    b.allreduce(big, ls::ReduceOp::sum);
    ls::Request q = b.iallreduce(x, ls::ReduceOp::sum);
    q.wait();
    b.barrier();
  });
  ls::set_timeout(0);
  INFO("rank " << r << ": " << got);
  CHECK(got == "no exception");
  if (got == "no exception") CHECK(all_ranks(b, true));
}
