// The Flux-style entry points and the TorchOpt-style world vocabulary, under mpiexec with the
// test main having called initialize<MPIBackend>(). Expected ranks and sizes come straight from
// MPI, not from Lockstep. Results are combined across ranks with plain MPI calls.
#include <catch2/catch.hpp>

#include <mpi.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>

#include <optional>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace {

int mpi_world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int mpi_world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
// How many ranks had `flag` set.
int count_ranks(bool flag) {
  int mine = flag ? 1 : 0, total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  return total;
}

}  // namespace

TEST_CASE("initialize is idempotent and the global backend is stable") {
  CHECK(ls::is_available());
  CHECK(ls::initialized<ls::MPIBackend>());
  ls::MPIBackend& b1 = ls::get_distributed_backend<ls::MPIBackend>();
  ls::initialize<ls::MPIBackend>();
  ls::initialize<ls::MPIBackend>();
  ls::MPIBackend& b2 = ls::get_distributed_backend<ls::MPIBackend>();
  CHECK(&b1 == &b2);
  CHECK(ls::initialized<ls::MPIBackend>());
  CHECK(b1.name() == "mpi");
  int provided = 0;
  MPI_Query_thread(&provided);
  CHECK(provided == MPI_THREAD_MULTIPLE);
}

TEST_CASE("after initialize a write to a pipe nobody reads fails with EPIPE instead of ending the process") {
  // initialize<MPIBackend> ignores SIGPIPE where it had its default action (a rank writing to a
  // killed host's reset connection used to die of it; docs/reliability.md). Were it still the
  // default, the write below would end this process and the test would fail.
  struct sigaction now {};
  REQUIRE(::sigaction(SIGPIPE, nullptr, &now) == 0);
  CHECK((now.sa_flags & SA_SIGINFO) == 0);
  CHECK(now.sa_handler == SIG_IGN);
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  ::close(fds[0]);
  const char byte = 'x';
  const ssize_t n = ::write(fds[1], &byte, 1);
  const int err = errno;
  ::close(fds[1]);
  CHECK(n == -1);
  CHECK(err == EPIPE);
}

TEST_CASE("rank, size, local_rank, local_size and world_info agree with MPI") {
  ls::Backend& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int r = mpi_world_rank(), n = mpi_world_size();
  CHECK(ls::rank(b) == r);
  CHECK(ls::size(b) == n);

  // Node-local numbers, independently from MPI_Comm_split_type.
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &node);
  int lr = -1, ln = -1;
  MPI_Comm_rank(node, &lr);
  MPI_Comm_size(node, &ln);
  MPI_Comm_free(&node);
  CHECK(ls::local_rank(b) == lr);
  CHECK(ls::local_size(b) == ln);
  CHECK(ls::local_rank(b) < ls::local_size(b));
  // The 0.2 names forward, deprecated, for one release.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  CHECK(ls::total_workers(b) == n);
  CHECK(ls::local_workers(b) == ln);
#pragma GCC diagnostic pop

  const ls::WorldInfo w = ls::world_info();
  CHECK(w.rank == r);
  CHECK(w.size == n);
  CHECK(w.local_rank == lr);
  CHECK(w.local_size == ln);

  // The node-local numbers, a third time from the host names (MPI_Get_processor_name): ranks
  // whose host names are equal share a node, numbered in rank order. On one machine that is one
  // node holding every rank; across hosts (scripts/cluster.sh: one UTS namespace per simulated
  // host) it proves that ranks of different hosts are never taken for neighbours.
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::vector<char> names(static_cast<std::size_t>(n) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                MPI_COMM_WORLD);
  const auto host = [&](int k) { return std::string(&names[static_cast<std::size_t>(k) * MPI_MAX_PROCESSOR_NAME]); };
  int expect_rank = 0, expect_size = 0;
  for (int k = 0; k < n; ++k) {
    if (host(k) != host(r)) continue;
    if (k < r) ++expect_rank;
    ++expect_size;
  }
  CHECK(w.local_rank == expect_rank);
  CHECK(w.local_size == expect_size);
}

TEST_CASE("rank_zero_only and rank_non_zero_only") {
  const int r = mpi_world_rank(), n = mpi_world_size();
  int calls = 0;
  std::optional<int> v = ls::rank_zero_only([&] {
    ++calls;
    return 42;
  });
  CHECK(v.has_value() == (r == 0));
  if (v) CHECK(*v == 42);
  CHECK(count_ranks(calls == 1) == 1);

  std::optional<ls::Done> d = ls::rank_zero_only([&] { ++calls; });
  CHECK(d.has_value() == (r == 0));

  int others = 0;
  std::optional<std::string> s = ls::rank_non_zero_only([&] {
    ++others;
    return std::string("rank ") + std::to_string(r);
  });
  CHECK(s.has_value() == (r != 0));
  if (s) CHECK(*s == "rank " + std::to_string(r));
  CHECK(count_ranks(others == 1) == n - 1);
  std::optional<ls::Done> dn = ls::rank_non_zero_only([] {});
  CHECK(dn.has_value() == (r != 0));
}

TEST_CASE("on_rank and not_on_rank with void and non-void functions") {
  const int r = mpi_world_rank(), n = mpi_world_size();
  const std::vector<int> chosen{0, 2};
  const bool in = r == 0 || r == 2;

  auto a = ls::on_rank(chosen, [&] { return r * 10; });
  CHECK(a.has_value() == in);
  if (a) CHECK(*a == r * 10);
  auto b = ls::on_rank({0, 2}, [] {});
  CHECK(b.has_value() == in);
  auto c = ls::on_rank(n - 1, [&] { return r; });
  CHECK(c.has_value() == (r == n - 1));
  CHECK(count_ranks(c.has_value()) == 1);

  auto d = ls::not_on_rank(chosen, [&] { return 1.5 * r; });
  CHECK(d.has_value() == !in);
  if (d) CHECK(*d == 1.5 * r);
  int ran = 0;
  auto e = ls::not_on_rank({0, 2}, [&] { ++ran; });
  CHECK(e.has_value() == !in);
  CHECK(ran == (in ? 0 : 1));
  // A rank outside the world matches nobody; an empty list excludes nobody.
  CHECK_FALSE(ls::on_rank({n + 5}, [] { return 1; }).has_value());
  CHECK(ls::not_on_rank(std::vector<int>{}, [] { return 1; }).has_value());

  // Not collectives: calling them on a subset of ranks must not block.
  bool ok = true;
  if (r == n - 1) ok = ls::on_rank(n - 1, [] { return true; }).value_or(false);
  CHECK(ok);
}

TEST_CASE("the rank helpers given a backend test its rank, not the MPI_COMM_WORLD rank") {
  // A backend whose communicator numbers the ranks backwards: its rank 0 is world rank n-1.
  const int r = mpi_world_rank(), n = mpi_world_size();
  MPI_Comm reversed = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_split(MPI_COMM_WORLD, 0, n - 1 - r, &reversed) == MPI_SUCCESS);
  {
    ls::MPIBackend b(reversed);
    REQUIRE(b.rank() == n - 1 - r);
    REQUIRE(ls::size(b) == n);

    int calls = 0;
    const std::optional<int> z = ls::rank_zero_only(b, [&] {
      ++calls;
      return r;
    });
    CHECK(z.has_value() == (r == n - 1));
    if (z) CHECK(*z == n - 1);
    CHECK(count_ranks(calls == 1) == 1);
    CHECK(ls::rank_non_zero_only(b, [] {}).has_value() == (r != n - 1));

    // Backend rank 0 and 1 are world ranks n-1 and n-2.
    const bool in = r == n - 1 || (n > 1 && r == n - 2);
    CHECK(ls::on_rank(b, {0, n > 1 ? 1 : 0}, [] {}).has_value() == in);
    CHECK(ls::on_rank(b, std::vector<int>{n - 1}, [] { return 1; }).has_value() == (r == 0));
    CHECK(ls::not_on_rank(b, 0, [] { return 2; }).has_value() == (r != n - 1));
    CHECK(ls::not_on_rank(b, {0}, [] {}).has_value() == (r != n - 1));

    // The forms without a backend keep the world's (the global backend's) rank.
    CHECK(ls::rank_zero_only([] {}).has_value() == (r == 0));
    CHECK(ls::on_rank(n - 1, [] {}).has_value() == (r == n - 1));

    // A rank the backend does not have is bad input, named, on every rank; not a silent no-op.
    CHECK_THROWS_AS(ls::on_rank(b, {0, n}, [] {}), ls::InvalidArgument);
    CHECK_THROWS_WITH(ls::on_rank(b, {0, n}, [] {}), Catch::Matchers::Contains("on_rank: rank " + std::to_string(n) +
                                                                             " is not a rank of the mpi backend given"));
    CHECK_THROWS_AS(ls::not_on_rank(b, -1, [] {}), ls::InvalidArgument);
    int ran = 0;
    ls::MPIBackend moved(std::move(b));
    CHECK_THROWS_AS(ls::rank_zero_only(b, [&] { ++ran; }), ls::InvalidArgument);
    CHECK_THROWS_WITH(ls::rank_zero_only(b, [&] { ++ran; }), Catch::Matchers::Contains("has no ranks"));
    CHECK(ran == 0);
  }
  MPI_Comm_free(&reversed);
}

TEST_CASE("AutoInit inside an initialised program runs the worker init and owns nothing") {
  int inits = 0;
  {
    ls::AutoInit guard([&] { ++inits; });
    CHECK(ls::initialized<ls::MPIBackend>());
  }
  CHECK(inits == 1);
  CHECK(ls::initialized<ls::MPIBackend>());  // did not finalise what it did not initialise
  CHECK(count_ranks(inits == 1) == mpi_world_size());
  {
    ls::AutoInit no_function;
  }
  CHECK(ls::initialized<ls::MPIBackend>());
}

TEST_CASE("MPIBackend duplicates the communicator it is given") {
  const int r = mpi_world_rank(), n = mpi_world_size();
  ls::MPIBackend world(MPI_COMM_WORLD);
  int cmp = -1;
  MPI_Comm_compare(world.comm(), MPI_COMM_WORLD, &cmp);
  CHECK(cmp == MPI_CONGRUENT);
  CHECK(world.rank() == r);
  CHECK(world.size() == n);

  ls::MPIBackend self(MPI_COMM_SELF);
  CHECK(self.size() == 1);
  CHECK(self.rank() == 0);
  ls::Tensor x = ls::Tensor::full({3}, r + 1.0, ls::DType::f64);
  ls::allreduce(self, x, ls::ReduceOp::sum);
  CHECK(x.data<double>()[0] == r + 1.0);

  // Even and odd ranks in two groups: an allreduce sums within the group only.
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, r % 2, r, &half);
  {
    ls::MPIBackend group(half);
    MPI_Comm_free(&half);  // the backend holds its own duplicate
    ls::Tensor y = ls::Tensor::full({5}, static_cast<double>(r), ls::DType::i64);
    group.allreduce(y, ls::ReduceOp::sum);
    std::int64_t want = 0;
    for (int q = r % 2; q < n; q += 2) want += q;
    CHECK(y.data<std::int64_t>()[4] == want);
    CHECK(group.size() == (n + 1 - r % 2) / 2);

    ls::MPIBackend moved = std::move(group);
    CHECK(moved.size() == (n + 1 - r % 2) / 2);
    moved.barrier();
  }
  CHECK_THROWS_AS(ls::MPIBackend(MPI_COMM_NULL), ls::InvalidArgument);
}

TEST_CASE("Backend& is enough: the free functions dispatch through the interface") {
  ls::Backend& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size();
  ls::Tensor x = ls::Tensor::full({4}, 2.0, ls::DType::f32);
  ls::allreduce(b, x, ls::ReduceOp::prod);
  float want = 1;
  for (int k = 0; k < n; ++k) want *= 2;
  CHECK(x.data<float>()[3] == want);
  ls::Tensor y = ls::Tensor::full({4}, static_cast<double>(b.rank()), ls::DType::f32);
  ls::broadcast(b, y);  // root defaults to 0
  CHECK(y.data<float>()[0] == 0.0f);
  ls::reduce(b, y, ls::ReduceOp::max);
  ls::barrier(b);
  CHECK(std::string(ls::name(ls::ReduceOp::avg)) == "avg");
}
