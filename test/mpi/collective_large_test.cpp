// Messages above 2^31 elements, which a single MPI call cannot count (MPI counts are int):
// u8 broadcast and allreduce of 2^31 + 13 elements, so the last chunk is a short one. Each rank
// needs 2 GiB for the buffer; run at -n 2 (label `large`).
#include <catch2/catch.hpp>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace {
constexpr std::int64_t kN = (std::int64_t{1} << 31) + 13;
constexpr std::int64_t kBlock = 4096;

// The broadcast pattern is constant within each 4096-byte block and differs between blocks
// (modulo a prime, so a misplaced 2^30-element chunk shows); blocks make filling and checking
// memset and memcmp fast, so the time goes into MPI. The 13-byte tail is a block of its own.
std::uint8_t block_value(std::int64_t blk) { return static_cast<std::uint8_t>(blk % 251); }

void fill_pattern(std::uint8_t* p) {
  for (std::int64_t off = 0; off < kN; off += kBlock)
    std::memset(p + off, block_value(off / kBlock), static_cast<std::size_t>(std::min(kBlock, kN - off)));
}

// Number of blocks of p[0, n) that are not entirely value(block).
template <class Value>
std::int64_t bad_blocks(const std::uint8_t* p, std::int64_t n, Value&& value) {
  std::vector<std::uint8_t> ref(kBlock);
  std::int64_t bad = 0;
  for (std::int64_t off = 0; off < n; off += kBlock) {
    const std::size_t len = static_cast<std::size_t>(std::min(kBlock, n - off));
    std::memset(ref.data(), value(off / kBlock), len);
    bad += std::memcmp(p + off, ref.data(), len) != 0;
  }
  return bad;
}
}  // namespace

TEST_CASE("broadcast and allreduce of more than 2^31 u8 elements") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int r = b.rank(), n = b.size();
  ls::Tensor buf({kN}, ls::DType::u8);
  std::uint8_t* p = buf.data<std::uint8_t>();

  // Broadcast from the last rank: the root writes the pattern, the others zeros.
  const int root = n - 1;
  if (r == root) fill_pattern(p);
  else std::memset(p, 0, static_cast<std::size_t>(kN));
  b.broadcast(buf, root);
  const std::int64_t bad_bcast = bad_blocks(p, kN, block_value);
  const bool tail_ok = p[kN - 1] == block_value((kN - 1) / kBlock) && p[kN - 14] == block_value((kN - 14) / kBlock);

  // Allreduce sum: rank q contributes 1 + q at every element but the last, where it
  // contributes 2 (1 + q); expected n (n + 1) / 2 and twice that.
  std::memset(p, 1 + r, static_cast<std::size_t>(kN));
  p[kN - 1] = static_cast<std::uint8_t>(2 * (1 + r));
  b.allreduce(buf, ls::ReduceOp::sum);
  const std::uint8_t want = static_cast<std::uint8_t>(n * (n + 1) / 2);
  const std::int64_t bad_sum = bad_blocks(p, kN - 1, [&](std::int64_t) { return want; });
  const bool last_ok = p[kN - 1] == 2 * want;

  CHECK(bad_bcast == 0);
  CHECK(tail_ok);
  CHECK(bad_sum == 0);
  CHECK(last_ok);
}
