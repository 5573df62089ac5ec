// The hierarchical path's tests, continued (hierarchical_test.cpp: the same program, the same
// runs): the reducer's split of a bucket's large tensors across machines ([reducer_split]) and
// Lockstep's Open MPI TCP default.
#include <catch2/catch.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"
#include "mpi/hierarchical_support.hpp"

namespace ls = lockstep;
using namespace hier_test;

// ---- The reducer across machines: a bucket's large tensors reduced where they lie -----------

namespace {
// A backend over MPIBackend that logs the element count of every allreduce (any other
// collective as a negative code), from any thread: the reducer's communication thread included,
// since it forwards concurrent_collectives().
class CallLog final : public lstest::ForwardingBackend {
 public:
  explicit CallLog(ls::Backend& inner) : ForwardingBackend(inner), mpi_(inner) {}
  bool concurrent_collectives() const override { return mpi_.concurrent_collectives(); }
  std::vector<std::int64_t> take() {
    std::lock_guard lk(m_);
    return std::exchange(counts_, {});
  }
  // Whether a call came from another thread than the one that made this backend (since asked).
  bool took_other_thread() {
    std::lock_guard lk(m_);
    return std::exchange(other_thread_, false);
  }

 protected:
  void on_call(Call call, const ls::TensorView& v) override {
    std::lock_guard lk(m_);
    counts_.push_back(call == Call::allreduce || call == Call::iallreduce ? v.numel : -1 - static_cast<int>(call));
    other_thread_ = other_thread_ || std::this_thread::get_id() != owner_;
  }
  void abandon(const CallInfo& call, const std::exception& e) override { forward_abandon(inner(), call, e); }

 private:
  ls::Backend& mpi_;
  std::mutex m_;
  std::vector<std::int64_t> counts_;
  std::thread::id owner_ = std::this_thread::get_id();
  bool other_thread_ = false;
};

// A value with a full mantissa (sums of them round), from (rank, tensor, element, step).
float grad_value(int rank, std::size_t t, std::int64_t i, int step) {
  std::uint64_t h = (static_cast<std::uint64_t>(rank) * 1000003u + t * 7919u + static_cast<std::uint64_t>(step)) *
                        0x9E3779B97F4A7C15ull +
                    static_cast<std::uint64_t>(i);
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  return static_cast<float>(static_cast<double>(h >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}
}  // namespace

// Across machines the reducer's host buckets are 16 MiB, and a bucket that holds tensors of
// 1 MiB or more among others reduces each of those where it lies (one call each) and packs only
// its small tensors, together, into one call (src/train/bucket_plan.cpp). One bucket of seven
// f32 tensors (3.25 MiB): large ones of exactly 1 MiB and of 1 MiB + 4 bytes (an odd count: the
// hierarchical path's padded chunk), small ones up to 1 MiB - 4 bytes, 7 elements among them.
// Even ranks hold separate tensors, odd ranks one buffer with the tensors back to back: the calls
// follow from the sizes alone, so every rank makes the same ones (a rank reducing its bucket
// whole because it lies back to back would leave the others waiting) and the results agree
// bitwise. At two machines they are bitwise the packed bucket's (one allreduce of the whole
// bucket, what the reducer did before): each element is summed in local rank order within its
// machine and the two machines' sums are added (one addition: commutative), wherever it lies in
// its call. Elsewhere (3 ranks: uneven machines, the flat path) MPI may sum in an order that
// depends on an element's place in its call: within rounding of it, the same bits on every rank.
// Within rounding of one process's mean everywhere. The same through ready reports (the
// communication thread), with accumulation and with bf16 on the wire. On one machine nothing is
// split (ctest runs this case without LOCKSTEP_TEST_HOST_SIZE too).
TEST_CASE("a bucket's tensors of 1 MiB or more are reduced in place across machines, the same calls on every rank",
          "[reducer_split]") {
  auto& mpi = backend();
  const int n = mpi.size(), r = mpi.rank(), k = env_int("LOCKSTEP_TEST_HOST_SIZE", 0);
  const bool across = mpi.local_size() < n;
  const bool two_machines = mpi.hierarchical() && k > 0 && n == 2 * k;
  const std::vector<std::int64_t> sizes = {3000, 262144, 5000, 262145, 7, 262143, 20000};
  const std::size_t nt = sizes.size();
  std::int64_t total = 0;
  for (auto c : sizes) total += c;
  // Separate tensors, or one buffer with the tensors back to back (borrowed views of it).
  std::vector<ls::Tensor> separate;
  ls::Tensor flat_buf = ls::Tensor::zeros({total});
  std::vector<ls::Tensor> views;
  for (std::int64_t c : sizes) separate.push_back(ls::Tensor::zeros({c}));
  for (std::int64_t off = 0, t = 0; t < static_cast<std::int64_t>(nt); off += sizes[static_cast<std::size_t>(t)], ++t)
    views.push_back(ls::Tensor::borrow(flat_buf.data<float>() + off, {sizes[static_cast<std::size_t>(t)]}, ls::DType::f32));
  std::vector<ls::Tensor>& grads = r % 2 == 0 ? separate : views;
  std::vector<ls::Tensor*> ptrs;
  std::vector<std::string> names;
  for (std::size_t t = 0; t < nt; ++t) {
    ptrs.push_back(&grads[t]);
    names.push_back("t" + std::to_string(t));
  }
  auto fill = [&](int step) {
    for (std::size_t t = 0; t < nt; ++t)
      for (std::int64_t i = 0; i < sizes[t]; ++i) grads[t].data<float>()[i] = grad_value(r, t, i, step);
  };
  // One process's mean of the steps' sums (accumulation: several steps, divided by their number).
  auto one_process = [&](std::size_t t, std::int64_t i, std::initializer_list<int> steps) {
    double s = 0;
    for (int q = 0; q < n; ++q)
      for (int st : steps) s += grad_value(q, t, i, st);
    return s / (n * static_cast<double>(steps.size()));
  };
  std::string why;
  auto expect = [&](bool c, const std::string& what) {
    if (!c && why.empty()) why = what;
  };
  auto within = [&](std::initializer_list<int> steps, const char* pass) {
    double worst = 0;
    for (std::size_t t = 0; t < nt; ++t)
      for (std::int64_t i = 0; i < sizes[t]; ++i)
        worst = std::max(worst, std::abs(grads[t].data<float>()[i] - one_process(t, i, steps)));
    expect(worst <= 1e-6, ls::detail::concat(pass, ": off one process's mean by ", worst));
  };
  auto agree = [&](const char* pass) {
    for (std::size_t t = 0; t < nt; ++t)
      expect(same_on_every_rank(grads[t].raw_data(), grads[t].nbytes()),
             ls::detail::concat(pass, ": tensor ", t, " differs between ranks"));
  };
  // What every rank should send: the packed small tensors, then each large one, forward order;
  // the smallest call also carries the micro-step count's trailer (src/train/micro_steps.cpp).
  constexpr std::int64_t trailer = 64;
  const std::vector<std::int64_t> split_calls = {3000 + 5000 + 7 + 262143 + 20000, 262144 + trailer, 262145};

  CallLog log(mpi);
  ls::GradientReducer red(log, ptrs, names);
  CHECK(red.bucket_count() == (across ? 1u : 7u));  // one machine: 1 MiB buckets, one tensor each here
  // The packed path's result: the bucket packed in order, one allreduce (what reduce() did
  // before for a bucket this size), straight on the MPIBackend.
  fill(0);
  std::vector<float> packed(static_cast<std::size_t>(total));
  for (std::int64_t off = 0, t = 0; t < static_cast<std::int64_t>(nt); off += sizes[static_cast<std::size_t>(t)], ++t)
    std::memcpy(packed.data() + off, grads[static_cast<std::size_t>(t)].raw_data(), grads[static_cast<std::size_t>(t)].nbytes());
  mpi.allreduce(ls::TensorView{packed.data(), total, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::avg);

  // 1. update's path: reduce() reduces the bucket itself, blocking.
  log.take();
  REQUIRE(red.reduce());
  const std::vector<std::int64_t> calls = log.take();
  const std::string calls_text = [&] {
    std::string s;
    for (auto c : calls) s += ls::detail::concat(s.empty() ? "" : " ", c);
    return s;
  }();
  INFO("rank " << r << (r % 2 ? " (back to back)" : " (separate)") << ", calls: " << calls_text);
  expect(same_on_every_rank(calls.data(), calls.size() * sizeof(std::int64_t)), "the ranks made different calls");
  expect(!log.took_other_thread(), "reduce() without reports used the communication thread");
  if (across) {
    expect(calls == split_calls, "not the split bucket's calls");
    expect(red.zero_copy_buckets() == 0, "a split bucket with small tensors counted as zero copy");
  } else {
    expect(std::none_of(calls.begin(), calls.end(), [](std::int64_t c) { return c == 3000 + 5000 + 7 + 262143 + 20000; }),
           "one machine's buckets were split");
  }
  agree("blocking");
  within({0}, "blocking");
  double off_packed = 0;
  bool bitwise = true;
  for (std::int64_t off = 0, t = 0; t < static_cast<std::int64_t>(nt); off += sizes[static_cast<std::size_t>(t)], ++t) {
    const auto& g = grads[static_cast<std::size_t>(t)];
    bitwise = bitwise && std::memcmp(g.raw_data(), packed.data() + off, g.nbytes()) == 0;
    for (std::int64_t i = 0; i < g.numel(); ++i)
      off_packed = std::max(off_packed, static_cast<double>(std::abs(g.data<float>()[i] - packed[static_cast<std::size_t>(off + i)])));
  }
  if (two_machines) expect(bitwise, ls::detail::concat("not bitwise the packed bucket's result (off by ", off_packed, ")"));
  expect(off_packed <= 1e-6, ls::detail::concat("off the packed bucket's result by ", off_packed));
  auto snapshot = [&] {
    std::vector<float> all;
    for (const auto& g : grads) all.insert(all.end(), g.data<float>(), g.data<float>() + g.numel());
    return all;
  };
  const std::vector<float> first = snapshot();

  // 2. Ready reports during "backward" (last tensor first): the communication thread where the
  // backend allows it. The same calls and the same bits.
  fill(0);
  log.took_other_thread();
  for (std::size_t t = nt; t-- > 0;) red.grad_ready(grads[t]);
  REQUIRE(red.reduce());
  expect(log.take() == calls, "ready reports made other calls");
  expect(log.took_other_thread() == mpi.concurrent_collectives(), "the communication thread did not reduce the bucket");
  expect(snapshot() == first, "ready reports changed the result");
  agree("reported");
  within({0}, "reported");

  // 3. Accumulation over two micro-steps: the large tensors reduced in the accumulator.
  ls::GradientReducer acc(log, ptrs, names, {.accumulation_steps = 2});
  fill(1);
  log.take();
  REQUIRE_FALSE(acc.reduce());
  fill(2);
  REQUIRE(acc.reduce());
  const std::vector<std::int64_t> acc_calls = log.take();
  // The micro-step counts ride on the step's smallest call: no call of their own.
  expect(acc_calls == calls, "accumulation made other calls");
  agree("accumulated");
  within({1, 2}, "accumulated");

  // 4. bf16 on the wire (allreduce_wire16 of each part): the same bits on every rank, within
  // bf16's rounding of one process's mean.
  ls::GradientReducer w16(mpi, ptrs, names, {.wire_dtype = ls::DType::bf16});
  fill(3);
  REQUIRE(w16.reduce());
  agree("bf16 wire");
  double worst = 0;
  for (std::size_t t = 0; t < nt; ++t)
    for (std::int64_t i = 0; i < sizes[t]; ++i)
      worst = std::max(worst, std::abs(grads[t].data<float>()[i] - one_process(t, i, {3})));
  expect(worst <= 1.0 / 64, ls::detail::concat("bf16 wire: off one process's mean by ", worst));
  INFO(why);
  CHECK(all_ranks(why.empty()));
}

// Open MPI's TCP transport gets two connections per pair of processes by default when Lockstep
// starts MPI (with one, traffic both ways at once, every allreduce's, shares a connection whose
// acknowledgements queue behind the data: about half the link's rate per direction). The test
// environments set neither OMPI_MCA_btl_tcp_links nor LOCKSTEP_OMPI_DEFAULTS=0.
TEST_CASE("Lockstep's Open MPI defaults: two TCP connections per pair of processes") {
  const char* links = std::getenv("OMPI_MCA_btl_tcp_links");
  REQUIRE(links != nullptr);
  CHECK(std::string(links) == "2");
}
