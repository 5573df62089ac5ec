// Buddy copies of a sharded optimizer state (buddy_copy.hpp): the host map, the plan, and the
// copy taken at the end of each step.
#include "lockstep/train/buddy_copy.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/env.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/train/distributed_optimizer.hpp"

namespace lockstep::detail {

namespace {
std::string this_host(int rank) {
  char buf[256] = {};
  std::string h = ::gethostname(buf, sizeof buf - 1) == 0 && buf[0] != '\0' ? buf : "unknown-host";
  // MPIBackend refuses this setting outside fault-injection builds, before any optimizer exists.
  if (const auto k = env::get("LOCKSTEP_TEST_HOST_SIZE")) {
    const long size = std::strtol(k->c_str(), nullptr, 10);
    if (size > 0) h += "/simulated-host-" + std::to_string(rank / size);
  }
  return h;
}
std::int64_t hash_name(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (const unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}
}  // namespace

BuddyPlan plan_buddies(Backend& backend) {
  const int n = backend.size(), me = backend.rank();
  BuddyPlan plan;
  plan.host = this_host(me);
  Tensor mine = Tensor::zeros({1}, DType::i64), all = Tensor::zeros({n}, DType::i64);
  *mine.data<std::int64_t>() = hash_name(plan.host);
  backend.allgather(mine.view(), all.view());
  const std::int64_t* h = all.data<std::int64_t>();
  // Hosts in order of their lowest rank; ranks ordered by host, then rank.
  std::vector<std::int64_t> hosts;
  for (int r = 0; r < n; ++r)
    if (std::find(hosts.begin(), hosts.end(), h[r]) == hosts.end()) hosts.push_back(h[r]);
  std::vector<int> order;
  int most = 0;
  for (const std::int64_t host : hosts) {
    int count = 0;
    for (int r = 0; r < n; ++r)
      if (h[r] == host) {
        order.push_back(r);
        ++count;
      }
    most = std::max(most, count);
  }
  plan.one_host = hosts.size() == 1;
  int shift = most;
  if (plan.one_host) {
    shift = n > 1 ? 1 : 0;
  } else {
    LOCKSTEP_CHECK_ARG(2 * most <= n, "DistributedOptimizer setup: rescue_buddy keeps each shard's copy on another "
                       "host, but one host runs ", most, " of the ", n, " ranks (more than half), so some copy "
                       "would stay on its own host; place at most ", n / 2, " ranks on each host, or turn "
                       "rescue_buddy off");
  }
  const int pos = static_cast<int>(std::find(order.begin(), order.end(), me) - order.begin());
  plan.holder = order[static_cast<std::size_t>((pos + shift) % n)];
  plan.source = order[static_cast<std::size_t>((pos - shift + n) % n)];
  if (plan.one_host && me == 0 && n > 1) {
    std::fprintf(stderr,
                 "lockstep: rescue_buddy: every rank is on one host (%s): each shard's copy is kept by the next "
                 "rank, which survives a lost rank but not a lost host\n",
                 plan.host.c_str());
    std::fflush(stderr);
  }
  return plan;
}

void take_buddy_copy(GradientReducer& red, const BuddyPlan& plan, const std::vector<Tensor*>& params,
                     const std::vector<std::vector<Tensor*>>& fields, const std::vector<std::size_t>& field_bytes,
                     std::int64_t rule_step, BuddyCopy& copy) {
  Backend& b = red.backend();
  const int n = b.size();
  const std::size_t pe = params.empty() ? 4 : size_of(params[0]->dtype());
  std::size_t per = pe;
  for (const std::size_t fb : field_bytes) per += fb;
  // Every rank's shard size, as every rank computes it: the block is the largest.
  std::int64_t most = 0;
  for (int r = 0; r < n; ++r) {
    std::int64_t c = 0;
    for (const auto& x : red.shard_ranges(r)) c += x.end - x.begin;
    most = std::max(most, c);
  }
  // Sent as 4-byte words (every element size here is 4 or 8 bytes): MPI moves i32 faster than u8.
  const auto block = static_cast<std::int64_t>(static_cast<std::size_t>(most) * per);
  const std::int64_t words = (block + 3) / 4;
  // The buffers are made at the first step and kept (fresh ones each step cost page faults over
  // the whole block, many times the exchange itself): this step's own shard and the source's are
  // packed and received into spares, swapped with the copy once the exchange is done; the
  // allgather goes in chunks of at most kChunkWords per rank, so that its scratch (N chunks)
  // stays small whatever the state's size.
  constexpr std::int64_t kChunkWords = std::int64_t{1} << 20;  // 4 MiB
  const std::int64_t chunk = std::min(std::max<std::int64_t>(words, 1), kChunkWords);
  auto keep = [](Tensor& t, std::int64_t numel) {
    if (t.numel() != numel || t.dtype() != DType::i32) t = Tensor::zeros({numel}, DType::i32);
  };
  keep(copy.send, std::max<std::int64_t>(words, 1));
  keep(copy.recv, std::max<std::int64_t>(words, 1));
  keep(copy.all, chunk * n);
  std::byte* at = static_cast<std::byte*>(copy.send.raw_data());
  for (const auto& x : red.shard_ranges()) {
    copy_flat_range(params, red.leaf_offsets(), x.begin, x.end - x.begin, at, true);
    at += static_cast<std::size_t>(x.end - x.begin) * pe;
  }
  for (std::size_t f = 0; f < fields.size(); ++f)
    for (const Tensor* p : fields[f]) {
      std::memcpy(at, p->raw_data(), p->nbytes());
      at += p->nbytes();
    }
  for (std::int64_t off = 0; off < words; off += chunk) {
    const std::int64_t c = std::min(chunk, words - off);
    b.allgather(copy.send.view().slice(off, c), copy.all.view().slice(0, c * n));
    std::memcpy(copy.recv.data<std::int32_t>() + off, copy.all.data<std::int32_t>() + static_cast<std::int64_t>(plan.source) * c,
                static_cast<std::size_t>(c) * 4);
  }
  // Only now, the exchange done, is the previous copy replaced.
  if (copy.world != n) {
    copy.world = n;
    copy.owner[0] = b.rank();
    copy.owner[1] = plan.source;
    copy.ranges[0] = red.shard_ranges();
    copy.ranges[1] = red.shard_ranges(plan.source);
    copy.leaf_numel.clear();
    for (const Tensor* p : params) copy.leaf_numel.push_back(p->numel());
    copy.param_bytes = pe;
    copy.field_bytes = field_bytes;
  }
  std::swap(copy.blob[0], copy.send);
  std::swap(copy.blob[1], copy.recv);
  copy.rule_step = rule_step;
}

}  // namespace lockstep::detail
