// Backend::allocate_reduce_buffer and the in-place allreduce over it (MPIBackend's shared-memory
// path: src/mpi/mpi_backend_reduce_buffers.cpp, src/mpi/shm/shm_regions.cpp,
// ShmCollectives::reduce_in_place_share), tried the ways a user or a bug could break it: mixed
// placements (one rank at another offset, in another allocation, in ordinary memory, with the
// odd rank first, last or in the middle), buffers that run past their allocation, allocations
// freed on one rank, every dtype and op at awkward sizes and offsets, mismatched calls,
// out-of-place calls that touch an allocation, the gradient reducer's communication thread, and
// memory that outlives its backend. Every result is compared bit for bit with the same call on
// ordinary memory, the bytes around each buffer must stay as they were, and the in-place count
// (MPIBackend::in_place_allreduces) must move exactly when every rank holds its buffer at the
// same offset of the same allocation. No /dev/shm/lockstep-buf-* name may be left behind.
// ctest runs it at 2, 3 and 4 ranks, with 4 KiB slices, with LOCKSTEP_SHM=0 (not the [dtypes] and
// [shm] cases), and with a delayed rank under a deadline (the [.deadline] case); one rank is a
// backend over MPI_COMM_SELF inside the runs.
#include <catch2/catch.hpp>

#include <dirent.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

namespace ls = lockstep;

namespace {

ls::MPIBackend& backend() { return ls::get_distributed_backend<ls::MPIBackend>(); }

bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v == 1;
}

bool no_segment_fault() {
  const char* f = std::getenv("LOCKSTEP_FAULT");
  return f != nullptr && std::string(f).find("kind=no_segment") != std::string::npos;
}

// Whether in-place calls can happen at all here (the shared-memory path, segments made).
bool in_place_possible(ls::MPIBackend& b) { return b.shared_memory() && !no_segment_fault(); }

// This process's reduce-buffer segment names still in /dev/shm (there must be none: every name
// is removed once the ranks have mapped the segments).
int leftover_segments() {
  const std::string prefix = "lockstep-buf-" + std::to_string(static_cast<long>(getpid())) + "-";
  int found = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) found += std::string(e->d_name).rfind(prefix, 0) == 0 ? 1 : 0;
    closedir(d);
  }
  return found;
}

// Mappings of reduce-buffer segments in this process (/proc/self/maps names them, deleted):
// every one must go when the last pointer into its allocation does.
int mapped_segments() {
  std::FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return -1;
  int found = 0;
  char line[4096];
  while (std::fgets(line, sizeof line, f) != nullptr) found += std::strstr(line, "/lockstep-buf-") != nullptr ? 1 : 0;
  std::fclose(f);
  return found;
}

// Rank r's input for element i of a call with `op`: values that keep prod finite (and integer
// products from overflowing), and non-integers for the floating sums, so that the order shows.
void fill_input(void* p, ls::DType t, std::int64_t n, int r, ls::ReduceOp op, std::uint64_t salt) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint64_t h = (static_cast<std::uint64_t>(i) * 2654435761u + salt * 97 + static_cast<std::uint64_t>(r) * 7919) % 1000;
    const double x = op == ls::ReduceOp::prod ? (h % 3 == 0 ? -1.0 : h % 3 == 1 ? 1.0 : 2.0)
                                              : static_cast<double>(h) / 7.0 - 60.0 + 0.3 * r;
    switch (t) {
      case ls::DType::f32: static_cast<float*>(p)[i] = static_cast<float>(x); break;
      case ls::DType::f64: static_cast<double*>(p)[i] = x * 1.000001; break;
      case ls::DType::i32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(std::lround(x * 3)); break;
      // Large values for the sums, but not for prod: their product would overflow (signed
      // overflow in the reduction is undefined; the sanitizer stage stops at it).
      case ls::DType::i64:
        static_cast<std::int64_t*>(p)[i] = op == ls::ReduceOp::prod ? std::llround(x) : std::llround(x * 3) * 1000000007LL;
        break;
      case ls::DType::bf16: static_cast<std::uint16_t*>(p)[i] = ls::to_bfloat16(static_cast<float>(x)).bits; break;
      case ls::DType::f16: static_cast<std::uint16_t*>(p)[i] = ls::to_half(static_cast<float>(x)).bits; break;
      default: FAIL("unexpected dtype");
    }
  }
}

constexpr unsigned char kGuard = 0xA5;

// Where this rank's buffer lies for one call.
struct Place {
  char* whole = nullptr;    // the allocation (or plain vector) it lies in
  std::size_t bytes = 0;    // of `whole`
  std::size_t offset = 0;   // of the buffer in `whole`
};

// One allreduce of `numel` elements at `where` on this rank: the result must be bitwise that of
// the same call on ordinary memory, nothing outside the buffer may change, and the in-place count
// must move by `in_place` (0 or 1). Returns an empty string or what went wrong on this rank.
std::string check_call(ls::MPIBackend& b, Place where, ls::DType t, ls::ReduceOp op, std::int64_t numel,
                       bool in_place, std::uint64_t salt) {
  const int rank = b.rank();
  const std::size_t bytes = static_cast<std::size_t>(numel) * ls::size_of(t);
  std::vector<std::uint64_t> ref((bytes + 7) / 8);
  fill_input(ref.data(), t, numel, rank, op, salt);
  b.allreduce(ls::TensorView{ref.data(), numel, t, ls::Device::cpu()}, op);
  std::memset(where.whole, kGuard, where.bytes);
  char* buf = where.whole + where.offset;
  fill_input(buf, t, numel, rank, op, salt);
  const std::uint64_t before = b.in_place_allreduces();
  b.allreduce(ls::TensorView{buf, numel, t, ls::Device::cpu()}, op);
  const std::uint64_t went = b.in_place_allreduces() - before;
  std::string bad;
  if (std::memcmp(buf, ref.data(), bytes) != 0) {
    std::int64_t first = -1, count = 0;
    const std::size_t es = ls::size_of(t);
    for (std::int64_t i = 0; i < numel; ++i)
      if (std::memcmp(buf + i * es, reinterpret_cast<char*>(ref.data()) + i * es, es) != 0) {
        if (first < 0) first = i;
        ++count;
      }
    bad += ls::detail::concat(count, " elements differ from ordinary memory's result (first ", first, "); ");
  }
  const std::vector<char> guard(std::max(where.offset, where.bytes - where.offset - bytes), static_cast<char>(kGuard));
  // memcmp of 0 bytes still needs valid pointers (the guard may be empty: no data()).
  auto same = [](const char* a, const char* g, std::size_t n) { return n == 0 || std::memcmp(a, g, n) == 0; };
  if (!same(where.whole, guard.data(), where.offset) ||
      !same(where.whole + where.offset + bytes, guard.data(), where.bytes - where.offset - bytes))
    bad += "bytes written outside the buffer; ";
  if (went != (in_place ? 1u : 0u)) bad += ls::detail::concat("in place ", went, " times, expected ", in_place ? 1 : 0, "; ");
  if (!bad.empty())
    bad = ls::detail::concat("rank ", rank, ": ", ls::name(t), " ", ls::name(op), " of ", numel, " at offset ",
                             where.offset, ": ", bad);
  return bad;
}

std::vector<ls::ReduceOp> ops_for(ls::DType t) {
  if (t == ls::DType::bf16 || t == ls::DType::f16) return {ls::ReduceOp::sum, ls::ReduceOp::avg};
  if (t == ls::DType::i32 || t == ls::DType::i64)
    return {ls::ReduceOp::sum, ls::ReduceOp::prod, ls::ReduceOp::min, ls::ReduceOp::max};
  return {ls::ReduceOp::sum, ls::ReduceOp::avg, ls::ReduceOp::prod, ls::ReduceOp::min, ls::ReduceOp::max};
}

// Collects failures across ranks: every rank learns whether any failed; the messages are this
// rank's own.
struct Failures {
  std::vector<std::string> mine;
  int cases = 0;
  void add(const std::string& s) {
    ++cases;
    if (!s.empty()) mine.push_back(s);
  }
  void check() {
    INFO(ls::detail::concat(mine.size(), " of ", cases, " cases failed on this rank; first: ",
                            mine.empty() ? std::string() : mine.front()));
    CHECK(all_ranks(mine.empty()));
  }
};

}  // namespace

TEST_CASE("reduce buffers: every dtype and op, sizes just above the floor and not divisible by the ranks, odd offsets",
          "[dtypes]") {
  ls::MPIBackend& b = backend();
  const int n = b.size();
  const bool can = in_place_possible(b);
  const std::size_t cap = 100003 * 8 + 256;
  std::shared_ptr<void> mem = b.allocate_reduce_buffer(cap);
  REQUIRE(mem != nullptr);
  auto* whole = static_cast<char*>(mem.get());
  Failures f;
  std::uint64_t salt = 0;
  for (ls::DType t : {ls::DType::f32, ls::DType::f64, ls::DType::i32, ls::DType::i64, ls::DType::bf16, ls::DType::f16}) {
    const std::int64_t es = static_cast<std::int64_t>(ls::size_of(t));
    // Just above the 64 KiB floor, just below it, and a count that no rank count divides.
    const std::int64_t above = (64 << 10) / es + 1, below = (64 << 10) / es - 1, odd = 100003;
    for (ls::ReduceOp op : ops_for(t)) {
      for (std::int64_t numel : {above, below, odd}) {
        if (numel == below && op != ls::ReduceOp::sum) continue;
        // Offsets: aligned, one element in, and an odd number of elements past a cache line
        // (elements stay aligned to their size: the sanitizer stage checks alignment).
        for (std::size_t offset : {std::size_t{0}, static_cast<std::size_t>(es), static_cast<std::size_t>(64 + 13 * es)}) {
          if (offset == static_cast<std::size_t>(es) && numel != odd) continue;
          const bool expect = can && numel * es >= (64 << 10);
          f.add(check_call(b, Place{whole, cap, offset}, t, op, numel, expect, ++salt));
        }
      }
    }
  }
  (void)n;
  f.check();
  CHECK(all_ranks(leftover_segments() == 0));
}

TEST_CASE("reduce buffers: one rank elsewhere (another offset, another allocation, ordinary memory), "
          "the odd rank first, last or in the middle") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const bool can = in_place_possible(b);
  const std::int64_t numel = 70001;
  const std::size_t cap = 8 * static_cast<std::size_t>(numel) + 8192;
  std::shared_ptr<void> a = b.allocate_reduce_buffer(cap);
  std::shared_ptr<void> c = b.allocate_reduce_buffer(cap);
  std::vector<char> plain(cap);
  REQUIRE(a != nullptr);
  REQUIRE(c != nullptr);
  Failures f;
  std::uint64_t salt = 1000;
  std::vector<int> odd_ranks = {0, n - 1};
  if (n >= 3) odd_ranks.push_back(n / 2);
  for (int odd : odd_ranks) {
    for (int how = 0; how < 5; ++how) {
      for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg, ls::ReduceOp::max}) {
        Place p{static_cast<char*>(a.get()), cap, 128};
        if (rank == odd) {
          switch (how) {
            case 0: p.offset = 128 + 64; break;                          // another offset, same allocation
            case 1: p.offset = 124; break;                               // another offset, by one element
            case 2: p.whole = static_cast<char*>(c.get()); break;        // another allocation, same offset
            case 3: p.whole = plain.data(); break;                       // ordinary memory
            case 4: p.offset = 128 + 4 * static_cast<std::size_t>(numel); break;  // past the others' buffers
          }
        }
        f.add(check_call(b, p, ls::DType::f32, op, numel, false, ++salt));
      }
    }
    // And every rank in the second allocation: in place again.
    f.add(check_call(b, Place{static_cast<char*>(c.get()), cap, 256}, ls::DType::f32, ls::ReduceOp::sum, numel, can,
                     ++salt));
  }
  // Every rank but one in the other allocation, the rest at the same offset of the first one.
  for (int odd : odd_ranks) {
    Place p{static_cast<char*>(rank == odd ? a.get() : c.get()), cap, 0};
    f.add(check_call(b, p, ls::DType::f32, ls::ReduceOp::sum, numel, false, ++salt));
  }
  f.check();
  CHECK(all_ranks(leftover_segments() == 0));
}

TEST_CASE("reduce buffers: a buffer that runs past the end of its allocation is not reduced in place") {
  ls::MPIBackend& b = backend();
  const bool can = in_place_possible(b);
  // 64 KiB + 100 bytes: the segment's last page is only partly the allocation's, so a buffer
  // that starts inside it and runs 64 bytes past its end is still mapped memory.
  const std::size_t bytes = (64 << 10) + 100;
  std::shared_ptr<void> mem = b.allocate_reduce_buffer(bytes);
  REQUIRE(mem != nullptr);
  Failures f;
  auto* whole = static_cast<char*>(mem.get());
  // Exactly to the end: in place.
  f.add(check_call(b, Place{whole, bytes, 100}, ls::DType::f32, ls::ReduceOp::sum, (64 << 10) / 4, can, 1));
  if (can) {
    // 64 bytes past the end on every rank (within the segment's last page; ordinary memory
    // has no such room): the slots.
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::size_t mapped = (bytes + page - 1) / page * page;
    REQUIRE(mapped >= bytes + 64);
    f.add(check_call(b, Place{whole, bytes + 64, 116}, ls::DType::f32, ls::ReduceOp::sum, (64 << 10) / 4 + 12,
                     false, 2));
  }
  f.check();
}

TEST_CASE("reduce buffers: allocations freed on one rank, new ones made, ids never confused") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const bool can = in_place_possible(b);
  const std::int64_t numel = 40000;  // 160 KB
  const std::size_t cap = 4 * static_cast<std::size_t>(numel);
  Failures f;
  std::shared_ptr<void> a = b.allocate_reduce_buffer(cap);
  f.add(check_call(b, Place{static_cast<char*>(a.get()), cap, 0}, ls::DType::f32, ls::ReduceOp::sum, numel, can, 1));
  // The last rank lets go of its allocation; then every rank makes two new ones (the freed
  // addresses may come back for them on that rank).
  std::vector<char> keep_a(cap);
  if (rank == n - 1) a.reset();
  std::shared_ptr<void> c = b.allocate_reduce_buffer(cap);
  std::shared_ptr<void> d = b.allocate_reduce_buffer(cap);
  if (can) CHECK(all_ranks(mapped_segments() >= 2 * n));  // c and d: every rank's segment of each
  // The last rank in the new allocation, the others in the old one (same offset): the slots.
  {
    char* w = static_cast<char*>(rank == n - 1 ? c.get() : a.get());
    f.add(check_call(b, Place{w, cap, 0}, ls::DType::f32, ls::ReduceOp::sum, numel, false, 2));
  }
  // Every rank in c, then in d: in place.
  f.add(check_call(b, Place{static_cast<char*>(c.get()), cap, 0}, ls::DType::f32, ls::ReduceOp::sum, numel, can, 3));
  f.add(check_call(b, Place{static_cast<char*>(d.get()), cap, 0}, ls::DType::f32, ls::ReduceOp::sum, numel, can, 4));
  // Every rank frees everything, then allocates again, many times: no names left, results right.
  a.reset();
  c.reset();
  d.reset();
  for (int round = 0; round < 20; ++round) {
    std::shared_ptr<void> e = b.allocate_reduce_buffer(cap);
    f.add(check_call(b, Place{static_cast<char*>(e.get()), cap, 0}, ls::DType::f32, ls::ReduceOp::sum, numel, can,
                     10 + static_cast<std::uint64_t>(round)));
  }
  f.check();
  CHECK(all_ranks(leftover_segments() == 0));
  // Nothing of them is mapped any more (each allocation maps every rank's segment).
  CHECK(all_ranks(mapped_segments() == 0));
}

TEST_CASE("reduce buffers: another backend's allocations, and a communicator with the ranks reversed") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const std::int64_t numel = 30001;
  const std::size_t cap = 4 * static_cast<std::size_t>(numel) + 64;
  Failures f;
  MPI_Comm reversed;
  MPI_Comm_split(MPI_COMM_WORLD, 0, n - 1 - rank, &reversed);
  {
    ls::MPIBackend r(reversed);
    const bool can_r = r.shared_memory() && !no_segment_fault();
    REQUIRE(r.rank() == n - 1 - rank);
    std::shared_ptr<void> mine = b.allocate_reduce_buffer(cap);
    std::shared_ptr<void> theirs = r.allocate_reduce_buffer(cap);
    // The other backend's allocation, the same offset on every rank: not in place, right.
    f.add(check_call(b, Place{static_cast<char*>(theirs.get()), cap, 0}, ls::DType::f32, ls::ReduceOp::sum, numel,
                     false, 1));
    f.add(check_call(r, Place{static_cast<char*>(mine.get()), cap, 0}, ls::DType::f32, ls::ReduceOp::sum, numel,
                     false, 2));
    // Its own, with the ranks in the other order: in place, the same bits as its slots.
    for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg, ls::ReduceOp::min})
      f.add(check_call(r, Place{static_cast<char*>(theirs.get()), cap, 0}, ls::DType::f32, op, numel, can_r, 3));
  }
  MPI_Comm_free(&reversed);
  f.check();
  CHECK(all_ranks(leftover_segments() == 0));
}

TEST_CASE("reduce buffers: out-of-place allreduces with send or recv in an allocation go through the slots, right") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank();
  const std::int64_t numel = 50001;
  const std::size_t bytes = 4 * static_cast<std::size_t>(numel);
  std::shared_ptr<void> mem = b.allocate_reduce_buffer(2 * bytes + 4096);
  REQUIRE(mem != nullptr);
  auto* base = static_cast<float*>(mem.get());
  std::vector<float> plain_send(static_cast<std::size_t>(numel)), plain_recv(static_cast<std::size_t>(numel));
  std::vector<float> ref(static_cast<std::size_t>(numel));
  bool ok = true;
  std::string why;
  for (int mode = 0; mode < 3; ++mode) {
    float* send = mode == 1 ? plain_send.data() : base;
    float* recv = mode == 0 ? plain_recv.data() : base + numel + 16;
    fill_input(send, ls::DType::f32, numel, rank, ls::ReduceOp::sum, 77 + mode);
    fill_input(ref.data(), ls::DType::f32, numel, rank, ls::ReduceOp::sum, 77 + mode);
    std::vector<float> send_before(send, send + numel);
    b.allreduce(ls::TensorView{ref.data(), numel, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum);
    const std::uint64_t before = b.in_place_allreduces();
    b.allreduce(ls::TensorView{send, numel, ls::DType::f32, ls::Device::cpu()},
                ls::TensorView{recv, numel, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum);
    if (b.in_place_allreduces() != before) ok = false, why += "went in place; ";
    if (std::memcmp(recv, ref.data(), bytes) != 0) ok = false, why += ls::detail::concat("mode ", mode, " wrong; ");
    if (std::memcmp(send, send_before.data(), bytes) != 0) ok = false, why += ls::detail::concat("mode ", mode, " changed send; ");
  }
  INFO(why);
  CHECK(all_ranks(ok));
}

TEST_CASE("reduce buffers: mismatched calls give MismatchError on every rank, and the backend goes on", "[shm]") {
  ls::MPIBackend& b = backend();
  REQUIRE(b.shared_memory());  // the disagreements below are seen by the shared-memory path (not run without it)
  const int n = b.size(), rank = b.rank();
  const bool can = in_place_possible(b);
  const std::int64_t numel = 60000;
  const std::size_t cap = 4 * static_cast<std::size_t>(numel) + 4096;
  std::shared_ptr<void> mem = b.allocate_reduce_buffer(cap);
  REQUIRE(mem != nullptr);
  auto* base = static_cast<float*>(mem.get());
  Failures f;
  int rounds = 0;
  for (int odd : {0, n - 1}) {
    for (int how = 0; how < 5; ++how) {
      for (std::int64_t i = 0; i < numel; ++i) base[i] = static_cast<float>(rank * 10 + 1);
      std::string text;
      bool threw = false;
      try {
        ls::TensorView v{base, numel, ls::DType::f32, ls::Device::cpu()};
        if (rank != odd) {
          b.allreduce(v, ls::ReduceOp::sum);
        } else if (how == 0) {
          b.broadcast(v, 0);
        } else if (how == 1) {
          b.allreduce(ls::TensorView{base, numel - 1, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum);
        } else if (how == 2) {
          b.allreduce(v, ls::ReduceOp::max);
        } else if (how == 3) {
          b.allreduce(ls::TensorView{base, numel, ls::DType::i32, ls::Device::cpu()}, ls::ReduceOp::sum);
        } else {
          // The same bytes as a count the others do not use, below the in-place floor.
          b.allreduce(ls::TensorView{base, 1000, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum);
        }
      } catch (const ls::MismatchError& e) {
        threw = true;
        text = e.what();
      }
      ++rounds;
      std::int64_t changed = 0;
      for (std::int64_t i = 0; i < numel; ++i) changed += base[i] == static_cast<float>(rank * 10 + 1) ? 0 : 1;
      f.add(threw ? std::string() : ls::detail::concat("rank ", rank, ": case ", how, " odd ", odd, ": no MismatchError"));
      f.add(changed == 0 ? std::string()
                         : ls::detail::concat("rank ", rank, ": case ", how, " odd ", odd, ": ", changed,
                                              " elements changed by the refused call"));
      // Usable afterwards, in place.
      f.add(check_call(b, Place{static_cast<char*>(mem.get()), cap, 0}, ls::DType::f32, ls::ReduceOp::sum, numel, can,
                       static_cast<std::uint64_t>(rounds)));
    }
  }
  f.check();
  CHECK(all_ranks(leftover_segments() == 0));
}

TEST_CASE("reduce buffers: the gradient reducer (communication thread or nonblocking) and the main thread's collectives") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank();
  const bool can = in_place_possible(b);
  std::vector<ls::Tensor> shapes;
  shapes.push_back(ls::Tensor::zeros({300, 100}));
  shapes.push_back(ls::Tensor::zeros({9}));
  shapes.push_back(ls::Tensor::zeros({70000}));
  shapes.push_back(ls::Tensor::zeros({40000}, ls::DType::f64));
  ls::Flat<std::vector<ls::Tensor>> grads = ls::flat_zeros_like(b, shapes);
  ls::Flat<std::vector<ls::Tensor>> plain = ls::flat_zeros_like(shapes);
  std::shared_ptr<void> other = b.allocate_reduce_buffer(1 << 20);
  Failures f;
  for (bool thread : {true, false}) {
  ls::DistributedOptions opts;
  opts.bucket_bytes = 128 << 10;
  opts.op = ls::ReduceOp::avg;
  opts.comm_thread = thread;  // false: nonblocking MPI collectives on the shared memory
  ls::GradientReducer red(b, *grads, opts);
  ls::GradientReducer red_plain(b, *plain, opts);
  for (int step = 0; step < 4; ++step) {
    for (auto* g : {&*grads, &*plain})
      for (std::size_t t = 0; t < g->size(); ++t)
        fill_input((*g)[t].raw_data(), (*g)[t].dtype(), (*g)[t].numel(), rank, ls::ReduceOp::sum,
                   static_cast<std::uint64_t>(step * 10) + t);
    const std::uint64_t before = b.in_place_allreduces();
    for (std::size_t t = grads->size(); t-- > 0;) red.grad_ready((*grads)[t]);
    if (step % 2 == 1) {
      // A collective of the main thread while the buckets are in flight (it waits for them).
      std::vector<float> y(70000, 1.0f);
      b.allreduce(ls::TensorView{y.data(), 70000, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum);
      f.add(y[69999] == static_cast<float>(b.size()) ? std::string() : "main-thread allreduce wrong");
    }
    CHECK(red.reduce());
    const std::uint64_t went = b.in_place_allreduces() - before;
    CHECK(red_plain.reduce());
    bool same = true;
    for (std::size_t t = 0; t < grads->size(); ++t)
      same = same && std::memcmp((*grads)[t].raw_data(), (*plain)[t].raw_data(), (*grads)[t].nbytes()) == 0;
    f.add(same ? std::string() : ls::detail::concat("rank ", rank, " step ", step, ": reduced gradients differ"));
    f.add(!can || !thread || went > 0 ? std::string() : ls::detail::concat("rank ", rank, " step ", step, ": nothing in place"));
    // The main thread's own collectives right after: in place on another allocation, a broadcast.
    f.add(check_call(b, Place{static_cast<char*>(other.get()), 1 << 20, 64}, ls::DType::f32, ls::ReduceOp::sum, 100000,
                     can, 500 + static_cast<std::uint64_t>(step)));
    std::vector<float> x(1000, static_cast<float>(rank));
    b.broadcast(ls::TensorView{x.data(), 1000, ls::DType::f32, ls::Device::cpu()}, step % b.size());
    f.add(x[999] == static_cast<float>(step % b.size()) ? std::string() : "broadcast wrong");
  }
  }
  f.check();
}

TEST_CASE("reduce buffers: memory that outlives its backend, one rank, and zero bytes") {
  const int world = backend().size();
  std::shared_ptr<void> kept;
  std::size_t bytes = 256 << 10;
  {
    ls::MPIBackend b2(MPI_COMM_WORLD);
    kept = b2.allocate_reduce_buffer(bytes);
    REQUIRE(kept != nullptr);
    auto* p = static_cast<float*>(kept.get());
    for (std::size_t i = 0; i < bytes / 4; ++i) p[i] = 1.0f;
    b2.allreduce(ls::TensorView{p, static_cast<std::int64_t>(bytes / 4), ls::DType::f32, ls::Device::cpu()},
                 ls::ReduceOp::sum);
    CHECK(all_ranks(p[0] == static_cast<float>(world) && p[bytes / 4 - 1] == static_cast<float>(world)));
  }
  // The backend is gone: the memory is still this rank's, readable and writable.
  auto* p = static_cast<float*>(kept.get());
  bool ok = p[0] == static_cast<float>(world);
  for (std::size_t i = 0; i < bytes / 4; ++i) p[i] = static_cast<float>(i);
  for (std::size_t i = 0; i < bytes / 4; ++i) ok = ok && p[i] == static_cast<float>(i);
  CHECK(all_ranks(ok));
  kept.reset();
  // One rank (MPI_COMM_SELF): ordinary memory, zeroed, aligned; an allreduce leaves it as it is.
  {
    ls::MPIBackend one(MPI_COMM_SELF);
    std::shared_ptr<void> m = one.allocate_reduce_buffer(100001);
    REQUIRE(m != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(m.get()) % 64 == 0);
    auto* c = static_cast<unsigned char*>(m.get());
    std::size_t nonzero = 0;
    for (std::size_t i = 0; i < 100001; ++i) nonzero += c[i] != 0 ? 1 : 0;
    CHECK(nonzero == 0);
    auto* f = static_cast<float*>(m.get());
    for (int i = 0; i < 25000; ++i) f[i] = 0.5f * static_cast<float>(i);
    one.allreduce(ls::TensorView{f, 25000, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::avg);
    CHECK(f[24999] == 0.5f * 24999.0f);
    CHECK(one.in_place_allreduces() == 0);
    CHECK(one.allocate_reduce_buffer(0) == nullptr);
  }
  CHECK(all_ranks(leftover_segments() == 0));
}

TEST_CASE("reduce buffers: without the shared-memory path, ordinary zeroed memory that reduces right") {
  ls::MPIBackend& b = backend();
  std::shared_ptr<void> m = b.allocate_reduce_buffer(300000);
  REQUIRE(m != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(m.get()) % 64 == 0);
  Failures f;
  f.add(check_call(b, Place{static_cast<char*>(m.get()), 300000, 0}, ls::DType::f32, ls::ReduceOp::avg, 70000,
                   in_place_possible(b), 9));
  f.check();
  if (!b.shared_memory()) CHECK(b.in_place_allreduces() == 0);
  CHECK(all_ranks(leftover_segments() == 0));
}

TEST_CASE("reduce buffers: sizes no allocation can have are an InvalidArgument on every rank, naming them") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank();
  constexpr std::size_t kHuge = ~std::size_t{0};
  for (int odd : {-1, 0, b.size() - 1}) {
    // Every rank, or only one, asks for more bytes than an i64 holds (sizes that turned negative
    // in the exchange before: "different sizes (from -1 to 4096 bytes)", or std::bad_alloc).
    const std::size_t bytes = odd < 0 || rank == odd ? kHuge - static_cast<std::size_t>(rank) : 4096;
    const std::string what = lstest::expect_throw<ls::InvalidArgument>([&] { (void)b.allocate_reduce_buffer(bytes); });
    INFO("rank " << rank << ": " << what);
    CHECK(all_ranks(what.find("asked for more than 9223372036854775807 bytes") != std::string::npos));
    CHECK(all_ranks(what.find("-") == std::string::npos));
  }
  // Still usable.
  std::shared_ptr<void> m = b.allocate_reduce_buffer(1 << 16);
  CHECK(all_ranks(m != nullptr));
  CHECK(all_ranks(leftover_segments() == 0));
}

TEST_CASE("reduce buffers: back-to-back calls, each buffer rewritten the moment its call returns") {
  // A rank that returned while a peer still wrote its share into that rank's buffer (or read it)
  // would see its next input changed, or give the peer a wrong one: the sums would be off.
  ls::MPIBackend& b = backend();
  const int n = b.size(), rank = b.rank();
  const std::int64_t numel = 20000;  // 80 KB, above the floor
  std::shared_ptr<void> mem = b.allocate_reduce_buffer(4 * static_cast<std::size_t>(numel) * 2);
  REQUIRE(mem != nullptr);
  auto* p = static_cast<std::int32_t*>(mem.get());
  std::vector<std::int32_t> plain(static_cast<std::size_t>(numel));
  std::int64_t wrong = 0;
  const std::uint64_t before = b.in_place_allreduces();
  int in_place = 0;
  for (int it = 0; it < 150; ++it) {
    // Mostly in place; every fifth call rank 0 in ordinary memory, every seventh at another offset.
    const bool odd_plain = it % 5 == 4 && rank == 0, odd_shift = it % 7 == 6 && rank == n - 1;
    std::int32_t* buf = odd_plain ? plain.data() : p + (odd_shift ? 16 : 0);
    in_place += it % 5 == 4 || it % 7 == 6 ? 0 : 1;
    for (std::int64_t i = 0; i < numel; ++i) buf[i] = static_cast<std::int32_t>(rank * 1000 + it + i);
    b.allreduce(ls::TensorView{buf, numel, ls::DType::i32, ls::Device::cpu()}, ls::ReduceOp::sum);
    for (std::int64_t i = 0; i < numel; ++i)
      wrong += buf[i] == static_cast<std::int32_t>(1000 * n * (n - 1) / 2 + n * (it + i)) ? 0 : 1;
    for (std::int64_t i = 0; i < numel; ++i) buf[i] = -1;  // at once
  }
  INFO("rank " << rank << ": " << wrong << " wrong elements");
  CHECK(all_ranks(wrong == 0));
  if (in_place_possible(b)) CHECK(b.in_place_allreduces() - before == static_cast<std::uint64_t>(in_place));
}

// Run by ctest with LOCKSTEP_TIMEOUT and a delayed rank (LOCKSTEP_FAULT=rank=1,kind=delay,after=3:
// collectives 0-2 are allocate_reduce_buffer's, 3 the in-place allreduce of its memory). Every
// rank must get a TimeoutError (none hangs), and no peer may write into a rank's buffer after
// that rank's call has thrown: the ranks that gave up mark their buffers, wait (over a plain MPI
// communicator) until the late rank has been through its own call too, and look again.
TEST_CASE("reduce buffers: a delayed rank under a deadline", "[.deadline]") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank();
  MPI_Comm side;
  MPI_Comm_dup(MPI_COMM_WORLD, &side);
  const std::int64_t numel = 1 << 18;
  std::shared_ptr<void> mem = b.allocate_reduce_buffer(4 * static_cast<std::size_t>(numel));
  REQUIRE(mem != nullptr);
  auto* p = static_cast<float*>(mem.get());
  for (std::int64_t i = 0; i < numel; ++i) p[i] = 1.0f;
  std::string what;
  bool timed_out = false;
  try {
    b.allreduce(ls::TensorView{p, numel, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum);
  } catch (const ls::TimeoutError& e) {
    timed_out = true;
    what = e.what();
  } catch (const std::exception& e) {
    what = e.what();
  }
  INFO("rank " << rank << ": " << (what.empty() ? std::string("no exception") : what));
  CHECK(timed_out);
  for (std::int64_t i = 0; i < numel; ++i) p[i] = -3.0f;
  MPI_Barrier(side);  // every rank is past its call (the late one included)
  std::int64_t changed = 0;
  for (std::int64_t i = 0; i < numel; ++i) changed += p[i] == -3.0f ? 0 : 1;
  INFO("rank " << rank << ": " << changed << " elements written by a peer after the call threw");
  CHECK(changed == 0);
  MPI_Comm_free(&side);
  mem.reset();
  CHECK(leftover_segments() == 0);
  CHECK(mapped_segments() == 0);
}

TEST_CASE("reduce buffers: flat_zeros_like(backend, x) of structures that differ between ranks is an InvalidArgument "
          "on every rank") {
  ls::MPIBackend& b = backend();
  const int rank = b.rank();
  for (int odd : {0, b.size() - 1}) {
    // The odd rank has one more group (an f64 tensor): as many allocations as groups, so the
    // sizes alone do not tell.
    std::vector<ls::Tensor> x;
    x.push_back(ls::Tensor::zeros({70000}));
    if (rank == odd) x.push_back(ls::Tensor::zeros({10}, ls::DType::f64));
    const std::string what = lstest::expect_throw<ls::InvalidArgument>([&] { (void)ls::flat_zeros_like(b, x); });
    INFO("rank " << rank << ": " << what);
    CHECK(all_ranks(what.find("flat_zeros_like") != std::string::npos));
    // Usable afterwards.
    std::vector<float> y(70000, 1.0f);
    b.allreduce(ls::TensorView{y.data(), 70000, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum);
    CHECK(all_ranks(y[0] == static_cast<float>(b.size())));
  }
}
