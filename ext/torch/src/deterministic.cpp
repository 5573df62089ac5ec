// lockstep::torch in deterministic mode (DistributedOptions::deterministic; docs/torch.md,
// "Deterministic training"): LibTorch's settings while a deterministic DistributedOptimizer lives,
// the refusal of SyncBatchNorm, and lt::model_hash. The exact sum itself is the core's
// (GradientReducer in deterministic mode); distributed_optimizer.cpp drives it.
#include "internal.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "lockstep/io/model_hash.hpp"
#include "lockstep/torch/sync_batchnorm.hpp"

namespace lockstep::torch {

namespace internal {

namespace {
// OpenBLAS's thread count, where LibTorch does its products in OpenBLAS (Debian's build): its own
// pool, which at::set_num_threads does not limit. Looked up at run time, so that another BLAS
// (or none) needs nothing.
using SetThreads = void (*)(int);
using GetThreads = int (*)();
SetThreads openblas_set() { return reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")); }
GetThreads openblas_get() { return reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads")); }

// Invariant: live > 0 exactly while some DeterministicSettings object exists; the saved values
// are those from before the first of them, restored when the last one goes.
std::mutex g_mutex;
int g_live = 0;
int g_saved_threads = 0, g_saved_blas = 0;
bool g_saved_det = false, g_saved_warn = false;
}  // namespace

DeterministicSettings::DeterministicSettings(int threads) {
  std::lock_guard lock(g_mutex);
  auto& ctx = at::globalContext();
  if (g_live == 0) {
    g_saved_threads = at::get_num_threads();
    g_saved_det = ctx.deterministicAlgorithms();
    g_saved_warn = ctx.deterministicAlgorithmsWarnOnly();
    g_saved_blas = openblas_get() ? openblas_get()() : 0;
  }
  ++g_live;
  // The same count on every rank and in every run compared: an operator's parallel reduction
  // may cut its sum by thread, so the count is part of how a micro-batch's gradient is computed.
  at::set_num_threads(threads);
  if (auto set = openblas_set()) set(threads);
  // Operators without a deterministic implementation throw instead of running (warn_only false).
  ctx.setDeterministicAlgorithms(true, false);
}

DeterministicSettings::~DeterministicSettings() {
  std::lock_guard lock(g_mutex);
  if (--g_live > 0) return;
  at::set_num_threads(std::max(g_saved_threads, 1));
  if (auto set = openblas_set(); set && g_saved_blas > 0) set(g_saved_blas);
  at::globalContext().setDeterministicAlgorithms(g_saved_det, g_saved_warn);
}

bool deterministic_live() {
  std::lock_guard lock(g_mutex);
  return g_live > 0;
}

std::string find_sync_batchnorm(const ::torch::nn::Module& m) {
  auto is_sync = [](const ::torch::nn::Module& x) {
    return dynamic_cast<const SyncBatchNormImpl<1>*>(&x) != nullptr ||
           dynamic_cast<const SyncBatchNormImpl<2>*>(&x) != nullptr ||
           dynamic_cast<const SyncBatchNormImpl<3>*>(&x) != nullptr;
  };
  if (is_sync(m)) return "(the module itself)";
  for (const auto& item : m.named_modules("", /*include_self=*/false))
    if (is_sync(*item.value())) return item.key();
  return {};
}

}  // namespace internal

std::string model_hash(const ::torch::nn::Module& module) {
  // Each parameter as a borrowed Lockstep tensor (a contiguous copy where it is not), hashed by
  // the core in name order: the same function, so the same hash, as ls::model_hash.
  std::vector<at::Tensor> keep;
  std::vector<Tensor> views;
  std::vector<std::string> names;
  const auto params = module.named_parameters(/*recurse=*/true);
  keep.reserve(params.size());
  std::unordered_set<const void*> seen;  // a tied weight once, under its first name (as saved)
  for (const auto& item : params) {
    if (!item.value().defined() || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    at::Tensor t = item.value().detach();
    if (!t.device().is_cpu()) t = t.cpu();
    keep.push_back(t.contiguous());
    names.push_back(item.key());
  }
  views.reserve(keep.size());
  for (const auto& t : keep) views.push_back(borrow(t));
  std::vector<std::pair<std::string, const Tensor*>> tensors;
  for (std::size_t i = 0; i < views.size(); ++i) tensors.emplace_back(names[i], &views[i]);
  return lockstep::detail::model_hash_of(std::move(tensors));
}

}  // namespace lockstep::torch
