// lockstep::torch::Join (see lockstep/torch/join.hpp).
#include "lockstep/torch/join.hpp"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "internal.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/reliability/call_site.hpp"

namespace lockstep::torch {

namespace internal {
namespace {
std::mutex g_joined_mutex;
std::vector<const Backend*> g_joined;  // the backends whose Join loop this rank takes without a batch
}  // namespace

void set_joined(const Backend* backend, bool joined) {
  std::lock_guard lock(g_joined_mutex);
  const auto it = std::find(g_joined.begin(), g_joined.end(), backend);
  if (joined && it == g_joined.end()) g_joined.push_back(backend);
  if (!joined && it != g_joined.end()) g_joined.erase(it);
}

bool joined(const Backend* backend) {
  std::lock_guard lock(g_joined_mutex);
  return std::find(g_joined.begin(), g_joined.end(), backend) != g_joined.end();
}
}  // namespace internal

bool Join::next(bool has_batch, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::Join::next");
  // [ranks with a batch, ranks that have one again after a step without]: one allreduce, so
  // that every rank learns of a rejoin at the same step and throws the same error.
  const bool rejoins = has_batch && joined_at_ >= 0;
  std::int32_t counts[2] = {has_batch ? 1 : 0, rejoins ? 1 : 0};
  backend_->allreduce(TensorView{counts, 2, DType::i32, Device::cpu()}, ReduceOp::sum, loc);
  if (counts[1] > 0) {
    // Only on the error path: which ranks, and where each joined (an allgather every rank makes).
    const int n = backend_->size();
    std::vector<std::int64_t> mine{rejoins ? 1 : 0, joined_at_}, all(2 * static_cast<std::size_t>(n));
    backend_->allgather(TensorView{mine.data(), 2, DType::i64, Device::cpu()},
                        TensorView{all.data(), 2 * n, DType::i64, Device::cpu()}, loc);
    int first = -1;
    std::string others;
    for (int r = 0; r < n; ++r) {
      if (all[2 * static_cast<std::size_t>(r)] == 0) continue;
      if (first < 0)
        first = r;
      else
        others += detail::concat(others.empty() ? " (also rank " : ", ", r);
    }
    if (!others.empty()) others += ")";
    const std::int64_t joined = all[2 * static_cast<std::size_t>(first) + 1];
    detail::throw_invalid(detail::concat(
        "lockstep::torch::Join::next: rank ", first, " has a batch for step ", steps_, " but had none for step ",
        joined, others, " (it joined there): a rank that ran out of data cannot rejoin the loop (usually a data "
        "loader restarted by mistake, which would train on its data twice); pass false for every later step of this "
        "loop, or let it end (next() returns false once no rank has a batch) and start a new one"),
        loc);
  }
  active_ = counts[0];
  internal::set_joined(backend_, active_ > 0 && !has_batch);
  if (active_ == 0) {
    joined_at_ = -1;  // the loop has ended on every rank: the next call starts a new one
    return false;
  }
  if (!has_batch) {
    if (joined_at_ < 0) joined_at_ = steps_;
    ++joined_steps_;
  }
  ++steps_;
  return true;
}

}  // namespace lockstep::torch
