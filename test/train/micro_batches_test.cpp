// Micro-batches by global index (MPI, 1 to 4 ranks): micro_batches_of deals contiguous blocks
// (30 over 4: 8, 8, 7, 7; more ranks than micro-batches: some none) and checks its arguments;
// DistributedDataContainer with DataOptions::micro_batch_size gives every micro-batch the same
// samples at any rank count (the epoch's permutation, which depends only on seed and epoch, is
// the one the container always used), every rank its block, and refuses bad options on every
// rank.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "training_common.hpp"

using namespace lstest;

namespace {

std::string thrown_by(const std::function<void()>& f) {
  try {
    f();
    return "";
  } catch (const ls::InvalidArgument& e) {
    return std::string("InvalidArgument: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("other: ") + e.what();
  }
}
bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

ls::DataOptions micro_options(std::int64_t g, std::int64_t m, std::uint64_t seed = 7) {
  return ls::DataOptions{.shuffle = true, .seed = seed, .remainder = ls::Remainder::uneven,
                         .global_batch_size = g, .micro_batch_size = m};
}

// A hash of every micro-batch's dataset indices of an epoch, in (b, m) order: what must not
// depend on the rank count.
std::uint64_t epoch_hash(const ls::DistributedDataContainer<>& d) {
  std::vector<std::int64_t> all;
  for (std::int64_t b = 0; b < d.num_batches(); ++b)
    for (std::int64_t m = 0; m < d.micro_batches(b).total; ++m) {
      auto s = d.micro_batch(b, m);
      all.push_back(-1);  // a separator, so that the cut points count too
      all.insert(all.end(), s.begin(), s.end());
    }
  return ls::detail::hash_bytes(all.data(), all.size() * sizeof(std::int64_t));
}

}  // namespace

TEST_CASE("micro_batches_of deals contiguous blocks, the first ranks one more", "[micro]") {
  // 30 micro-batches over 4 ranks: 8, 8, 7, 7 starting at 0, 8, 16, 23.
  const std::vector<ls::MicroBatches> want = {{0, 8, 30}, {8, 8, 30}, {16, 7, 30}, {23, 7, 30}};
  for (int r = 0; r < 4; ++r) CHECK(ls::micro_batches_of(300, 10, r, 4) == want[static_cast<std::size_t>(r)]);
  // More ranks than micro-batches: 3 over 5 gives 1, 1, 1, 0, 0.
  for (int r = 0; r < 5; ++r) {
    const auto mb = ls::micro_batches_of(30, 10, r, 5);
    CHECK(mb.count == (r < 3 ? 1 : 0));
    CHECK(mb.total == 3);
    CHECK(mb.empty() == (r >= 3));
  }
  // Every (count, size): the blocks cover [0, count) once, in rank order, and differ by <= 1.
  for (std::int64_t count = 0; count <= 40; ++count)
    for (int size = 1; size <= 9; ++size) {
      std::int64_t next = 0, lo = count, hi = 0;
      for (int r = 0; r < size; ++r) {
        const auto mb = ls::split_micro_batches(count, r, size);
        REQUIRE(mb.first == next);
        next += mb.count;
        lo = std::min(lo, mb.count);
        hi = std::max(hi, mb.count);
        std::vector<std::int64_t> seen(mb.begin(), mb.end());
        std::vector<std::int64_t> expect(static_cast<std::size_t>(mb.count));
        std::iota(expect.begin(), expect.end(), mb.first);
        REQUIRE(seen == expect);
        if (mb.count > 0) REQUIRE(mb[mb.count - 1] == mb.first + mb.count - 1);
      }
      REQUIRE(next == count);
      REQUIRE(hi - lo <= 1);
    }
}

TEST_CASE("micro_batches_of refuses bad arguments, naming them", "[micro]") {
  const auto e = thrown_by([] { (void)ls::micro_batches_of(250, 16, 0, 2); });
  CHECK(has(e, "InvalidArgument: "));
  CHECK(has(e, "global batch 250 is not a multiple of the micro-batch 16"));
  CHECK(has(thrown_by([] { (void)ls::micro_batches_of(240, 0, 0, 1); }), "micro-batch must be >= 1 sample, got 0"));
  CHECK(has(thrown_by([] { (void)ls::micro_batches_of(0, 10, 0, 1); }), "global batch must be >= 1 sample, got 0"));
  CHECK(has(thrown_by([] { (void)ls::micro_batches_of(240, 10, 4, 4); }), "rank 4 is not in [0, 4)"));
  CHECK(has(thrown_by([] { (void)ls::micro_batches_of(240, 10, -1, 4); }), "rank -1 is not in [0, 4)"));
  CHECK(has(thrown_by([] { (void)ls::micro_batches_of(240, 10, 0, 0); }), "rank 0 is not in [0, 0)"));
  CHECK(has(thrown_by([] { (void)ls::split_micro_batches(-1, 0, 1); }), "count must be >= 0, got -1"));
}

TEST_CASE("Micro-batches hold the same samples at any rank count", "[micro]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size(), r = b.rank();
  // 1000 samples, global batch 240 of micro-batches of 10: 4 full global batches (24
  // micro-batches each) and a last one of 40 samples (4 micro-batches: some ranks have none).
  ls::DistributedDataContainer d(b, 1000, micro_options(240, 10));
  bool ok = true;
  std::string why;
  auto fail = [&](std::string w) {
    if (ok) why = std::move(w);
    ok = false;
  };
  for (std::int64_t epoch : {0, 1, 5}) {
    d.set_epoch(epoch);
    if (d.num_batches() != 5) fail("num_batches " + std::to_string(d.num_batches()));
    // The permutation is the container's usual one: the plain container with Remainder::uneven
    // deals positions r, r + n, ... of it, and those are the micro-batches' samples there.
    ls::DistributedDataContainer plain(b, 1000, ls::DataOptions{.shuffle = true, .seed = 7,
                                                                .remainder = ls::Remainder::uneven});
    plain.set_epoch(epoch);
    std::vector<std::int64_t> perm;  // positions 0..999, from the micro-batches
    std::vector<std::int64_t> mine;  // this rank's micro-batches, in order
    for (std::int64_t gb = 0; gb < d.num_batches(); ++gb) {
      const auto deal = d.micro_batches(gb);
      if (deal != ls::split_micro_batches(gb < 4 ? 24 : 4, r, n)) fail("deal of batch " + std::to_string(gb));
      for (std::int64_t m = 0; m < deal.total; ++m) {
        const auto s = d.micro_batch(gb, m);
        if (static_cast<std::int64_t>(s.size()) != 10) fail("micro-batch size");
        perm.insert(perm.end(), s.begin(), s.end());
      }
      std::vector<std::int64_t> rows;
      for (std::int64_t m : deal) {
        const auto s = d.micro_batch(gb, m);
        rows.insert(rows.end(), s.begin(), s.end());
      }
      const auto batch = d.batch(gb);
      if (!std::equal(batch.begin(), batch.end(), rows.begin(), rows.end())) fail("batch(b) of batch " + std::to_string(gb));
      mine.insert(mine.end(), rows.begin(), rows.end());
    }
    if (perm.size() != 1000) fail("positions " + std::to_string(perm.size()));
    for (std::int64_t k = 0; ok && k < plain.size(); ++k)
      if (plain.global_index(k) != perm[static_cast<std::size_t>(r + k * n)]) fail("not the container's permutation");
    if (d.indices() != mine) fail("indices() is not this rank's micro-batches");
    std::vector<std::int64_t> sorted = perm;
    std::sort(sorted.begin(), sorted.end());
    for (std::int64_t i = 0; ok && i < 1000; ++i)
      if (sorted[static_cast<std::size_t>(i)] != i) fail("not a permutation");
  }
  // Together the ranks' samples are the epoch, each once: sum of sizes.
  double count = static_cast<double>(d.size());
  b.allreduce(ls::TensorView{&count, 1, ls::DType::f64, ls::Device::cpu()}, ls::ReduceOp::sum);
  if (count != 1000) fail("the ranks hold " + std::to_string(count) + " samples");
  INFO(why);
  CHECK(all_ranks(b, ok));

  // One value at every rank count: the hash of epoch 3's micro-batches (computed at -n 1 and
  // checked at 1-4 ranks; it changes only if the documented shuffle changes).
  d.set_epoch(3);
  const std::uint64_t h = epoch_hash(d);
  INFO("epoch hash " << h);
  CHECK(h == 0xe51f7c84ba2f3ad6ull);
  // With drop_last the partial last global batch is left out.
  auto dl = micro_options(240, 10);
  dl.drop_last = true;
  ls::DistributedDataContainer d2(b, 1000, dl);
  CHECK(d2.num_batches() == 4);
  CHECK(all_ranks(b, d2.size() == (d.size() - static_cast<std::int64_t>(d.batch(4).size()))));
}

TEST_CASE("A partial last micro-batch, and ranks without micro-batches", "[micro]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int n = b.size(), r = b.rank();
  // 100 samples, global 40, micro 8: batches of 40, 40, 20; the last has micro-batches 8, 8, 4.
  ls::DistributedDataContainer d(b, 100, micro_options(40, 8));
  CHECK(d.num_batches() == 3);
  CHECK(d.global_rows(2) == 20);
  CHECK(d.micro_batches(2).total == 3);
  CHECK(d.micro_batch(2, 2).size() == 4u);
  CHECK(d.micro_batch(2, 1).size() == 8u);
  const auto deal = d.micro_batches(2);
  const std::int64_t expect_rows =
      deal.empty() ? 0 : std::min<std::int64_t>((deal.first + deal.count) * 8, 20) - deal.first * 8;
  CHECK(static_cast<std::int64_t>(d.batch(2).size()) == expect_rows);
  CHECK(deal.empty() == (r >= std::min(n, 3)));
  CHECK(has(thrown_by([&] { (void)d.micro_batch(2, 3); }), "micro-batch 3 is out of range (global batch 2 has 3)"));
  CHECK(has(thrown_by([&] { (void)d.micro_batches(3); }), "out of range"));
  // A container without micro_batch_size has none.
  ls::DistributedDataContainer plain(b, 100, ls::DataOptions{.global_batch_size = 40});
  CHECK(has(thrown_by([&] { (void)plain.micro_batches(0); }), "micro_batches: DataOptions::micro_batch_size is not set"));
  // Moves keep the micro-batches and leave none behind.
  auto moved = std::move(d);
  CHECK(moved.micro_batch(0, 0).size() == 8u);
  CHECK(d.size() == 0);
}

TEST_CASE("Bad micro-batch options are refused on every rank", "[micro]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  auto refused = [&](ls::DataOptions o, const std::string& part) {
    const std::string e = thrown_by([&] { ls::DistributedDataContainer d(b, 1000, o); });
    INFO(e);
    return all_ranks(b, has(e, "InvalidArgument: ") && has(e, part));
  };
  CHECK(refused(micro_options(250, 16), "global_batch_size 250 is not a multiple of micro_batch_size 16"));
  CHECK(refused(ls::DataOptions{.remainder = ls::Remainder::uneven, .micro_batch_size = 10},
                "micro_batch_size (10) needs global_batch_size"));
  CHECK(refused(ls::DataOptions{.global_batch_size = 240, .micro_batch_size = 10},
                "micro_batch_size needs remainder = Remainder::uneven"));
  CHECK(refused(micro_options(240, -1), "micro_batch_size must be >= 0"));
  // Ranks that disagree on the micro-batch size: a MismatchError on every rank (n > 1).
  if (b.size() > 1) {
    const std::string e = thrown_by([&] {
      ls::DistributedDataContainer d(b, 1000, micro_options(240, b.rank() == 0 ? 10 : 20));
    });
    CHECK(all_ranks(b, has(e, "micro_batch_size=10") || has(e, "micro_batch_size=20")));
  }
}
