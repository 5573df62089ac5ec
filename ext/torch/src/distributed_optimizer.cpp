// lockstep::torch::DistributedOptimizer: a LibTorch optimizer whose gradients are reduced across
// ranks in flat buckets by GradientReducer, filled by autograd hooks as backward produces them;
// accumulation, unused parameters, skipped steps, the sharded step (each parameter's state on
// one rank, the updated parameters broadcast), and deterministic mode (every micro-batch's
// gradient into the core's exact sum, reduced once per step).
#include "internal.hpp"
#include "test_hooks.hpp"

#include <torch/torch.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "lockstep/core/errors.hpp"
#include "lockstep/reliability/settings.hpp"
#include "lockstep/train/replicas.hpp"
#include "lockstep/train/synchronize.hpp"

namespace lockstep::torch {

using detail::concat;
using namespace internal;

namespace {
// The parameters some live DistributedOptimizer has hooks on: a second one over the same
// parameter would fight the first over its gradient.
std::mutex g_wrapped_mutex;
std::unordered_map<const void*, std::string>& wrapped() {
  static std::unordered_map<const void*, std::string> m;
  return m;
}

// The ranks' check of everything that decides which gradient meets which (see the constructor).
void check_same_structure_for_reduction(Backend& backend, const std::vector<OptParam>& all,
                                        const DistributedOptions& options, const TorchOptions& topts) {
  const char* unused = topts.unused_parameters == UnusedParameters::error ? "error" : "zero";
  const std::string opts = concat("op ", name(options.op), ", accumulation_steps ", options.accumulation_steps,
                                  ", unused_parameters ", unused, ", shard_optimizer_state ",
                                  options.shard_optimizer_state ? "true" : "false", ", wire_dtype ",
                                  options.wire_dtype ? name(*options.wire_dtype) : "none", ", deterministic ",
                                  options.deterministic ? "true" : "false", ", deterministic_threads ",
                                  options.deterministic ? topts.deterministic_threads : 0, ", max_grad_norm ",
                                  topts.max_grad_norm ? *topts.max_grad_norm : 0.0);
  auto desc = [](const OptParam& p) { return param_desc(p); };
  std::string sig = concat("lockstep::torch ", opts, ";");
  for (const auto& p : all) sig += concat(p.name, "=", desc(p), ";");
  detail::check_same_structure(
      backend, sig, 0, 0,
      "lockstep::torch::DistributedOptimizer: no optimizer was wrapped, the ranks' gradients would be averaged "
      "with other parameters' (every rank must train the same parameters, by name)",
      [&] {
        std::vector<detail::StructureEntry> e;
        e.push_back({"options", opts});
        for (const auto& p : all) e.push_back({p.name, desc(p)});
        return e;
      });
}

// Whether gradient g is the slot over the bucket buffer (a sparse gradient, which LibTorch stores
// when the gradient was none, has no data pointer to compare).
bool holds(const at::Tensor& g, const at::Tensor& slot) {
  return g.defined() && g.layout() == c10::kStrided && g.data_ptr() == slot.data_ptr();
}

// testing::fail_next_gradient (test_hooks.hpp, not installed): the next gradient hook in this
// process fails.
std::mutex g_fail_mutex;
std::atomic<bool> g_fail_next{false};
std::string g_fail_message;
void maybe_fail_for_testing() {
  if (!g_fail_next.load(std::memory_order_relaxed)) return;
  std::string msg;
  {
    std::lock_guard lock(g_fail_mutex);
    if (!g_fail_next.exchange(false)) return;
    msg = std::move(g_fail_message);
  }
  throw InvalidArgument(msg);
}
}  // namespace

namespace testing {
void fail_next_gradient(std::string message) {
  std::lock_guard lock(g_fail_mutex);
  g_fail_message = std::move(message);
  g_fail_next.store(true);
}
}  // namespace testing

struct DistributedOptimizer::Impl {
  struct Hook final : ::torch::autograd::FunctionPostHook {
    Impl* owner;
    std::size_t index;
    Hook(Impl* o, std::size_t i) : owner(o), index(i) {}
    ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                                const ::torch::autograd::variable_list& /*inputs*/) override {
      owner->on_gradient(index);
      return outputs;
    }
  };

  Backend* backend = nullptr;
  ::torch::optim::Optimizer* optimizer = nullptr;
  DistributedOptions options;
  TorchOptions topts;
  std::vector<OptParam> params;        // the trainable parameters, in optimizer order
  std::vector<at::Tensor> buffers;     // flat gradient buffers
  std::vector<at::Tensor> slots;       // each parameter's gradient: a tensor over its buffer
  std::vector<Tensor> slot_views;      // the same, as Lockstep tensors (what the reducer reduces)
  std::vector<std::pair<std::shared_ptr<::torch::autograd::Node>, std::uintptr_t>> hooks;
  std::unique_ptr<GradientReducer> reducer;

  // per step
  std::vector<int> reports;  // gradients received this micro-step, per parameter
  std::vector<char> used;    // got a gradient in some micro-step of this cycle
  std::vector<char> launched;  // handed to the reducer in this (final) micro-step
  int micro = 0;             // micro-steps of this cycle done (accumulation)
  bool launching = false;    // this micro-step is the cycle's last: hooks launch buckets
  std::string twice;         // first parameter reported twice in the final micro-step
  std::exception_ptr hook_error;  // this rank's first failure in this cycle, agreed at its end
  std::size_t hook_error_param = 0;  // the parameter whose gradient it was taking
  std::string local_bad;     // this rank's first non-finite gradient, before the reduction
  std::int64_t skipped = 0, applied = 0;

  // Deterministic mode: the micro-batches this rank added to the reducer's exact sums in this
  // step, the first parameter that got no gradient in one of them (n: none), and LibTorch's
  // settings, held while this object lives.
  std::vector<Tensor*> slot_ptrs;  // the reducer's tensors (slot_views), for binding
  std::int64_t micro_batches = 0;
  std::size_t det_unused = 0;
  std::unique_ptr<DeterministicSettings> det_settings;
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // max_grad_norm: the last step's

  // TorchOptions::max_grad_norm: the reduced gradients (the same bits on every rank) clipped by
  // their global 2-norm. The sum of squares runs in one fixed order, in f64, on this thread: the
  // same value on every rank and at any rank count, with no collective.
  void clip_gradients() {
    double sq = 0;
    for (const auto& t : slots) {
      const float* g = t.data_ptr<float>();
      for (std::int64_t i = 0, e = t.numel(); i < e; ++i) sq += static_cast<double>(g[i]) * g[i];
    }
    grad_norm = std::sqrt(sq);
    const double coef = *topts.max_grad_norm / (grad_norm + 1e-6);
    if (!(coef < 1.0)) return;
    ::torch::NoGradGuard no_grad;
    for (auto& t : slots) t.mul_(static_cast<float>(coef));
  }

  // shard_optimizer_state: the rank that steps each parameter, and the broadcasts that send the
  // owners' updated parameters to every rank (a bucket of small parameters of one owner packed
  // into a staging buffer, or one parameter of bucket_bytes or more, broadcast in place).
  struct ParamBucket {
    int root = 0;
    std::vector<std::size_t> members;
    at::Tensor staging;  // undefined: members[0] is broadcast in place
  };
  bool sharded = false;
  std::vector<int> owners;
  std::int64_t owned_bytes = 0;
  std::vector<ParamBucket> pbuckets;

  void plan_shards(int nranks, int rank) {
    const std::size_t n = params.size();
    owners.assign(n, rank);
    if (!sharded) return;
    auto bytes = [&](std::size_t j) { return static_cast<std::int64_t>(params[j].p.nbytes()); };
    // Largest first, each to the rank with the fewest bytes so far (the lowest on a tie): the
    // same on every rank, since the ranks agreed on every parameter's shape and dtype.
    std::vector<std::size_t> order(n);
    for (std::size_t j = 0; j < n; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes(a) > bytes(b); });
    std::vector<std::int64_t> load(static_cast<std::size_t>(nranks), 0);
    for (std::size_t j : order) {
      const auto r = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      owners[j] = static_cast<int>(r);
      load[r] += bytes(j);
    }
    owned_bytes = load[static_cast<std::size_t>(rank)];
    if (nranks == 1) return;  // nothing to send
    const auto cap = static_cast<std::int64_t>(*options.bucket_bytes);
    for (int r = 0; r < nranks; ++r) {
      ParamBucket cur;
      std::int64_t cur_bytes = 0;
      auto close = [&] {
        if (cur.members.empty()) return;
        if (cur.members.size() > 1)
          cur.staging = at::empty({cur_bytes}, at::TensorOptions().dtype(at::kByte));
        pbuckets.push_back(std::move(cur));
        cur = ParamBucket{};
        cur_bytes = 0;
      };
      for (std::size_t j = 0; j < n; ++j) {
        if (owners[j] != r) continue;
        if (bytes(j) >= cap) {  // a bucket of its own, broadcast in place
          ParamBucket big;
          big.root = r;
          big.members.push_back(j);
          pbuckets.push_back(std::move(big));
          continue;
        }
        if (cur_bytes + bytes(j) > cap) close();
        cur.root = r;
        cur.members.push_back(j);
        cur_bytes += bytes(j);
      }
      close();
    }
  }

  // The owners' parameters to every rank: one broadcast per bucket, in bucket order.
  void broadcast_params() {
    ::torch::NoGradGuard no_grad;
    const int me = backend->rank();
    for (auto& b : pbuckets) {
      if (!b.staging.defined()) {
        backend->broadcast(view(params[b.members.front()].p), b.root);
        continue;
      }
      auto* base = static_cast<std::uint8_t*>(b.staging.data_ptr());
      if (b.root == me) {
        std::size_t off = 0;
        for (std::size_t j : b.members) {
          std::memcpy(base + off, params[j].p.data_ptr(), params[j].p.nbytes());
          off += params[j].p.nbytes();
        }
      }
      backend->broadcast(view(b.staging), b.root);
      if (b.root != me) {
        std::size_t off = 0;
        for (std::size_t j : b.members) {
          std::memcpy(params[j].p.data_ptr(), base + off, params[j].p.nbytes());
          off += params[j].p.nbytes();
        }
      }
    }
  }

  // The inner step on this rank's parameters only (the others' gradients hidden from it), then
  // the broadcasts. A failure of the inner step on one rank is every rank's error (one allreduce
  // of a flag; the broadcasts still happen, so the replicas stay equal).
  void sharded_step() {
    const int me = backend->rank();
    std::exception_ptr error;
    {
      ::torch::NoGradGuard no_grad;
      for (std::size_t j = 0; j < params.size(); ++j)
        if (owners[j] != me) params[j].p.mutable_grad() = at::Tensor();
      try {
        optimizer->step();
      } catch (...) {
        error = std::current_exception();
      }
      for (std::size_t j = 0; j < params.size(); ++j)
        if (owners[j] != me) params[j].p.mutable_grad() = slots[j];
    }
    std::int32_t failed = error ? 1 : 0;
    backend->allreduce(TensorView{&failed, 1, DType::i32, Device::cpu()}, ReduceOp::max);
    broadcast_params();
    if (failed == 0) return;
    detail::Verdict mine;
    if (error) {
      mine = detail::verdict_of([&] { std::rethrow_exception(error); });
      mine.message = concat("lockstep::torch::DistributedOptimizer: the wrapped optimizer's step() failed on its "
                            "share of the parameters: ", mine.message);
    }
    detail::agree(*backend, "lockstep::torch::DistributedOptimizer::step", 0, mine, 0,
                  "the owners' parameters were sent as they were after the failure");
    throw Error("lockstep::torch::DistributedOptimizer::step: the inner step failed on a rank");  // not reached
  }

  void ensure_slot(std::size_t j) {
    at::Tensor& g = params[j].p.mutable_grad();
    if (holds(g, slots[j])) return;
    // LibTorch replaced the gradient (zero_grad set it to none, or a first backward stole a
    // fresh tensor; a sparse one when the gradient was none, from Embedding(sparse) and the
    // like): its values go into the buffer, which becomes the gradient again. Into a dense
    // gradient LibTorch adds sparse ones in place.
    ::torch::NoGradGuard no_grad;
    if (!g.defined())
      slots[j].zero_();
    else if (g.layout() == c10::kStrided)
      slots[j].copy_(g);
    else
      slots[j].copy_(g.to_dense());
    g = slots[j];
  }

  void keep_error(std::size_t j) noexcept {
    if (hook_error) return;
    hook_error = std::current_exception();
    hook_error_param = j;
  }

  // Hands gradient j to the reducer (this rank's failures before are only kept: every rank makes
  // the same collectives, and the step's allreduce tells every rank that one failed).
  void launch(std::size_t j) {
    if (options.skip_non_finite && local_bad.empty()) {
      try {
        std::vector<Tensor*> one{&slot_views[j]};
        local_bad = detail::describe_non_finite(one, [&] { return std::vector<std::string>{params[j].name}; });
      } catch (...) {
        keep_error(j);
      }
    }
    reducer->grad_ready(slot_views[j]);
    launched[j] = 1;
  }

  void on_gradient(std::size_t j) noexcept {
    try {
      maybe_fail_for_testing();
      ensure_slot(j);
      used[j] = 1;
      if (++reports[j] > 1 && launching && twice.empty()) twice = params[j].name;
      if (!launching || launched[j]) return;
      launch(j);
    } catch (...) {
      keep_error(j);
    }
  }

  void start_micro_step() {
    std::fill(reports.begin(), reports.end(), 0);
    std::fill(launched.begin(), launched.end(), 0);
    // Deterministic mode launches nothing during backward: the exact sum is reduced at step().
    launching = !options.deterministic && micro + 1 >= options.accumulation_steps;
  }

  // Deterministic mode: the gradients of one micro-batch (what backward produced since the last
  // zero_grad or accumulate; a parameter without one counts as zero) into the reducer's exact
  // sums, then zeroed, so that the next micro-batch's gradient is computed alone. Local; a failure
  // is kept for the step's agreement, like a hook's.
  void accumulate_micro_batch() { take_micro_batch(false); }
  // The step's last micro-batch, bound to the reducer where it lies (no copy into the exact sums:
  // step()'s reduce reads it there and writes the result in its place). True once bound; false
  // after a failure (kept), and step() then reduces what was accumulated (the same collectives).
  bool bind_last_micro_batch() { return take_micro_batch(true); }
  bool take_micro_batch(bool last) {
    ::torch::NoGradGuard no_grad;
    const std::size_t n = params.size();
    for (std::size_t j = 0; j < n; ++j) {
      try {
        if (reports[j] > 0) {
          ensure_slot(j);
        } else {
          if (det_unused == n) det_unused = j;
          slots[j].zero_();
          params[j].p.mutable_grad() = slots[j];
        }
      } catch (...) {
        keep_error(j);
      }
    }
    try {
      if (options.skip_non_finite && local_bad.empty())
        local_bad = detail::describe_non_finite(slot_ptrs, [&] {
          std::vector<std::string> names;
          for (const auto& p : params) names.push_back(p.name);
          return names;
        });
      lockstep::detail::ReducerSteps::bind(*reducer, slot_ptrs);
      if (last) {
        ++micro_batches;
        std::fill(reports.begin(), reports.end(), 0);
        return true;
      }
      lockstep::detail::ReducerSteps::accumulate(*reducer);
      ++micro_batches;
    } catch (...) {
      keep_error(params.size());  // no parameter's: the step's message says accumulate
    }
    for (auto& b : buffers) b.zero_();
    std::fill(reports.begin(), reports.end(), 0);
    return false;
  }

  // Deterministic mode: what backward left since the last accumulate() dropped (a joined rank's
  // zero-row gradient), the gradients zeroed as accumulate() leaves them.
  void drop_micro_batch() {
    ::torch::NoGradGuard no_grad;
    for (std::size_t j = 0; j < params.size(); ++j) {
      try {
        if (reports[j] > 0) {
          ensure_slot(j);
          slots[j].zero_();
        }
      } catch (...) {
        keep_error(j);
      }
    }
    for (auto& b : buffers) b.zero_();
    std::fill(reports.begin(), reports.end(), 0);
  }

  bool pending() const {
    return std::any_of(reports.begin(), reports.end(), [](int r) { return r > 0; });
  }

  void check_flags(std::int32_t first_unused);
  bool finish_step();
};

DistributedOptimizer::DistributedOptimizer(Backend& backend, ::torch::optim::Optimizer& optimizer,
                                           DistributedOptions options, TorchOptions topts,
                                           std::source_location loc)
    : impl_(std::make_unique<Impl>()) {
  detail::CallSiteScope site(loc, "lockstep::torch::DistributedOptimizer");
  auto& m = *impl_;
  m.backend = &backend;
  m.optimizer = &optimizer;
  // bucket_bytes unset follows the path (ls::host_bucket_bytes); the shard broadcasts use it too.
  m.options = lockstep::detail::resolved_options(options, backend);
  m.topts = topts;
  std::vector<OptParam> all;  // every parameter of the optimizer, frozen ones too
  agreed(backend, "lockstep::torch::DistributedOptimizer", 0, [&] {
    LOCKSTEP_CHECK_ARG(options.op == ReduceOp::avg || options.op == ReduceOp::sum,
                       "lockstep::torch::DistributedOptimizer: op must be avg or sum, got ", name(options.op));
    LOCKSTEP_CHECK_ARG(options.accumulation_steps >= 1,
                       "lockstep::torch::DistributedOptimizer: accumulation_steps must be >= 1, got ",
                       options.accumulation_steps);
    std::unordered_map<const void*, std::size_t> seen;  // position in the optimizer's list
    all = optimizer_params(optimizer, topts.names_from);
    for (std::size_t i = 0; i < all.size(); ++i) {
      auto p = all[i];
      auto [it, fresh] = seen.emplace(p.p.unsafeGetTensorImpl(), i);
      // LibTorch's Module::parameters() lists a tied weight once per name (Python's lists it
      // once): given twice, torch::optim would step it twice and its gradient would be reduced
      // twice.
      LOCKSTEP_CHECK_ARG(fresh, "lockstep::torch::DistributedOptimizer: parameter '", p.name,
                         "' is in the optimizer twice (positions ", it->second, " and ", i,
                         " of its parameter list): pass each tensor once (a tied weight, one tensor under several "
                         "names, is listed once per name by LibTorch's Module::parameters(); torch::optim would "
                         "step it twice)");
      if (!trained(p.p)) continue;
      {
        std::lock_guard lock(g_wrapped_mutex);
        LOCKSTEP_CHECK_ARG(!wrapped().count(p.p.unsafeGetTensorImpl()),
                           "lockstep::torch::DistributedOptimizer: parameter '", p.name,
                           "' is already wrapped by another live DistributedOptimizer");
      }
      LOCKSTEP_CHECK_ARG(p.p.device().is_cpu(), "lockstep::torch::DistributedOptimizer: parameter '",
                         p.name, "' is on ", p.p.device(),
                         "; only cpu parameters are supported so far (this adapter has not run on a GPU)");
      LOCKSTEP_CHECK_ARG(p.p.layout() == c10::kStrided && dtype_of(p.p.scalar_type()).has_value(),
                         "lockstep::torch::DistributedOptimizer: parameter '", p.name, "' (", describe(p.p),
                         ") has no flat gradient buffer");
      LOCKSTEP_CHECK_ARG(!options.wire_dtype || p.p.scalar_type() == c10::kFloat,
                         "lockstep::torch::DistributedOptimizer: wire_dtype ",
                         options.wire_dtype ? name(*options.wire_dtype) : "", " compresses Float (f32) gradients; "
                         "parameter '", p.name, "' is ", describe(p.p));
      LOCKSTEP_CHECK_ARG(!topts.max_grad_norm || p.p.scalar_type() == c10::kFloat,
                         "lockstep::torch::DistributedOptimizer: max_grad_norm clips Float (f32) gradients; parameter '",
                         p.name, "' is ", describe(p.p));
      LOCKSTEP_CHECK_ARG(!options.shard_optimizer_state || p.p.is_contiguous(),
                         "lockstep::torch::DistributedOptimizer: shard_optimizer_state broadcasts each owner's "
                         "parameters in place; parameter '", p.name, "' (", describe(p.p), ") is not contiguous");
      m.params.push_back(std::move(p));
    }
    LOCKSTEP_CHECK_ARG(!topts.max_grad_norm || *topts.max_grad_norm > 0,
                       "lockstep::torch::DistributedOptimizer: max_grad_norm must be positive, got ",
                       topts.max_grad_norm ? *topts.max_grad_norm : 0.0);
    LOCKSTEP_CHECK_ARG(!options.wire_dtype || *options.wire_dtype == DType::bf16 || *options.wire_dtype == DType::f16,
                       "lockstep::torch::DistributedOptimizer: wire_dtype must be bf16 or f16 (a 16-bit float), got ",
                       options.wire_dtype ? name(*options.wire_dtype) : "none");
    if (options.deterministic) {
      // What the exact sum cannot take, refused here on every rank with the torch names (the
      // core's reducer would refuse some of it too, in its own words).
      const char* who = "lockstep::torch::DistributedOptimizer: deterministic mode";
      LOCKSTEP_CHECK_ARG(!options.shard_optimizer_state, who, " does not take shard_optimizer_state (each rank "
                         "would step its own parameters from its own share; not built yet); turn one of them off");
      LOCKSTEP_CHECK_ARG(!options.wire_dtype, who, " does not take wire_dtype ",
                         options.wire_dtype ? name(*options.wire_dtype) : "", " (the exact sum needs the gradients' "
                         "f32 bits; its integer words are the wire); turn one of them off");
      LOCKSTEP_CHECK_ARG(topts.deterministic_threads >= 1, who, ": TorchOptions::deterministic_threads must be "
                         ">= 1, got ", topts.deterministic_threads);
      for (const auto& p : m.params)
        LOCKSTEP_CHECK_ARG(p.p.scalar_type() == c10::kFloat, who, " sums Float (f32) gradients exactly; parameter '",
                           p.name, "' is ", describe(p.p), " (convert the model to float, or freeze it)");
      if (topts.names_from != nullptr) {
        const std::string bn = find_sync_batchnorm(*topts.names_from);
        LOCKSTEP_CHECK_ARG(bn.empty(), who, " does not take lockstep::torch::SyncBatchNorm ('", bn, "'): its "
                           "statistics are those of the rows the ranks process at the same moment, which depend on "
                           "the rank count; use BatchNorm (the statistics of each micro-batch, whose size does not) "
                           "or turn deterministic off");
      }
    }
    LOCKSTEP_CHECK_ARG(!options.shard_optimizer_state || kind_of(optimizer) != Kind::other,
                       "lockstep::torch::DistributedOptimizer: shard_optimizer_state needs Adam, AdamW, SGD, RMSprop "
                       "or Adagrad (optimizers known to step only parameters that have a gradient, and whose state "
                       "Lockstep gathers field by field for a checkpoint); this optimizer is another kind");
  }, "no optimizer was wrapped");
  // Which numbers meet which in the reductions: the ranks must agree on every parameter of the
  // optimizer, in order, by name (the module's, or the position), with its group, dtype, shape,
  // device and whether it is trained, and on the options that decide what is reduced when.
  // Shapes alone do not tell a rank that froze l1 from one that froze l2 of the same shape: each
  // would average its l2 with the other's l1. Checked once, here (one allgather of a hash), before
  // anything is changed.
  check_same_structure_for_reduction(backend, all, options, topts);
  // The buffers: one per run of parameters of one dtype and device, in optimizer order, so that
  // every bucket of the reducer (buckets never span a dtype or device change) lies back to back
  // and is reduced in place.
  const std::size_t n = m.params.size();
  m.slots.resize(n);
  {
    ::torch::NoGradGuard no_grad;
    std::size_t i = 0;
    while (i < n) {
      std::size_t j = i;
      std::int64_t total = 0;
      while (j < n && m.params[j].p.scalar_type() == m.params[i].p.scalar_type() &&
             m.params[j].p.device() == m.params[i].p.device())
        total += m.params[j++].p.numel();
      // From the backend's reduce buffers (collective: the ranks' runs were compared above, so
      // every rank asks for the same sizes in the same order): on one machine MPIBackend then
      // reduces each bucket where it lies, with no copy through its shared-memory slots.
      const auto opts = m.params[i].p.options().requires_grad(false);
      const std::size_t nbytes = static_cast<std::size_t>(total) * c10::elementSize(m.params[i].p.scalar_type());
      std::shared_ptr<void> mem = backend.allocate_reduce_buffer(nbytes, loc);
      at::Tensor buf = mem ? at::from_blob(mem.get(), {total}, [mem](void*) {}, opts) : at::zeros({total}, opts);
      std::int64_t off = 0;
      for (std::size_t k = i; k < j; ++k) {
        const at::Tensor& p = m.params[k].p;
        // A plain tensor over the buffer's memory, not a view: LibTorch's own zero_grad
        // (detach_ then zero_) works on it, and autograd accumulates into it in place.
        char* base = static_cast<char*>(buf.data_ptr()) + off * static_cast<std::int64_t>(buf.element_size());
        m.slots[k] = at::from_blob(base, p.sizes(), [keep = buf](void*) {}, buf.options());
        const at::Tensor& old = p.grad();
        if (old.defined()) m.slots[k].copy_(old.layout() == c10::kStrided ? old : old.to_dense());
        m.params[k].p.mutable_grad() = m.slots[k];
        off += p.numel();
      }
      m.buffers.push_back(std::move(buf));
      i = j;
    }
  }
  std::vector<Tensor*> ptrs;
  std::vector<std::string> names;
  m.slot_views.reserve(n);
  for (std::size_t k = 0; k < n; ++k) {
    m.slot_views.push_back(borrow(m.slots[k]));
    names.push_back(m.params[k].name);
  }
  for (auto& v : m.slot_views) ptrs.push_back(&v);
  m.slot_ptrs = ptrs;
  // Accumulation happens in LibTorch's gradients: the reducer reduces once per cycle (the
  // ranks' accumulation_steps were compared above; the reducer's check covers its options).
  DistributedOptions reducer_options = options;
  reducer_options.accumulation_steps = 1;
  // Sharded, the gradients are still all-reduced (whole parameters, not the core's flat pieces):
  // the reducer does what it does without sharding.
  reducer_options.shard_optimizer_state = false;
  m.reducer = std::make_unique<GradientReducer>(backend, std::move(ptrs), std::move(names), reducer_options, loc);
  {
    std::lock_guard lock(g_wrapped_mutex);
    for (auto& p : m.params) wrapped().emplace(p.p.unsafeGetTensorImpl(), p.name);
  }
  m.reports.assign(n, 0);
  m.det_unused = n;
  m.used.assign(n, 0);
  m.launched.assign(n, 0);
  m.start_micro_step();
  for (std::size_t k = 0; k < n; ++k) {
    auto acc = ::torch::autograd::impl::grad_accumulator(m.params[k].p);
    LOCKSTEP_CHECK_ARG(acc != nullptr, "lockstep::torch::DistributedOptimizer: parameter '", m.params[k].name,
                       "' has no gradient accumulator (is it a leaf that requires grad?)");
    const std::uintptr_t key = acc->add_post_hook(std::make_unique<Impl::Hook>(&m, k));
    m.hooks.emplace_back(std::move(acc), key);
  }
  if (options.deterministic) m.det_settings = std::make_unique<DeterministicSettings>(topts.deterministic_threads);
  // Last: nothing after this throws, so the registry never names an optimizer no live wrapper
  // shards.
  m.sharded = options.shard_optimizer_state;
  m.plan_shards(backend.size(), backend.rank());
  if (m.sharded) {
    ShardInfo info;
    info.nranks = backend.size();
    info.owner.assign(all.size(), -1);
    std::unordered_map<const void*, int> owner_of;
    for (std::size_t k = 0; k < n; ++k) owner_of.emplace(m.params[k].p.unsafeGetTensorImpl(), m.owners[k]);
    for (std::size_t i = 0; i < all.size(); ++i) {
      auto it = owner_of.find(all[i].p.unsafeGetTensorImpl());
      if (it != owner_of.end()) info.owner[i] = it->second;
    }
    // State the optimizer already holds (a checkpoint loaded before wrapping) is kept for this
    // rank's own parameters only.
    drop_unowned_state(optimizer, all, info, backend.rank());
    std::lock_guard lock(g_shard_mutex);
    sharded_optimizers()[&optimizer] = std::move(info);
  }
}

DistributedOptimizer::~DistributedOptimizer() {
  if (!impl_) return;
  for (auto& [node, key] : impl_->hooks) node->del_post_hook(key);
  if (impl_->sharded) {
    std::lock_guard lock(g_shard_mutex);
    sharded_optimizers().erase(impl_->optimizer);
  }
  std::lock_guard lock(g_wrapped_mutex);
  for (auto& p : impl_->params) wrapped().erase(p.p.unsafeGetTensorImpl());
}

void DistributedOptimizer::zero_grad() {
  auto& m = *impl_;
  // Inside an accumulation cycle the gradients add up; in deterministic mode they are already in
  // the exact sums (step() and accumulate() took them), so zeroing only starts a micro-batch.
  if (m.micro > 0 && !m.options.deterministic) return;
  if (m.options.deterministic) std::fill(m.reports.begin(), m.reports.end(), 0);  // nothing pending
  ::torch::NoGradGuard no_grad;
  for (auto& b : m.buffers) b.zero_();
  for (std::size_t j = 0; j < m.params.size(); ++j) {
    at::Tensor& g = m.params[j].p.mutable_grad();
    if (!holds(g, m.slots[j])) g = m.slots[j];
  }
}

bool DistributedOptimizer::step(std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::DistributedOptimizer::step");
  auto& m = *impl_;
  const std::size_t n = m.params.size();
  ++m.micro;
  bool last_bound = false;  // deterministic mode: the last micro-batch bound where it lies
  if (m.options.deterministic) {
    // A gradient backward left since the last accumulate() is this rank's last micro-batch (the
    // one-micro-batch loop zero_grad, backward, step works unchanged); none: nothing is added.
    // A rank taking a Join step without a batch (join.hpp) ran backward on no rows: not a
    // micro-batch, so that the mean is over the micro-batches that had rows, as without Join.
    if (m.pending()) {
      if (internal::joined(m.backend))
        m.drop_micro_batch();
      else if (m.micro >= m.options.accumulation_steps)
        last_bound = m.bind_last_micro_batch();
      else
        m.accumulate_micro_batch();
    }
    if (m.micro < m.options.accumulation_steps) return false;  // local: the cycle goes on
  } else if (m.micro < m.options.accumulation_steps) {
    // No collective here: a failure is kept, and every rank learns of it at the cycle's end.
    for (std::size_t j = 0; j < n; ++j) {
      try {
        if (m.reports[j] > 0) m.ensure_slot(j);
      } catch (...) {
        m.keep_error(j);
      }
    }
    m.start_micro_step();
    return false;
  }
  // The cycle's last micro-step. Parameters backward did not report are launched now, in bucket
  // order like the rest, whatever this rank saw, even after a failure here (a hook's, kept in
  // hook_error): every rank makes the same collectives, and the flags' allreduce below tells
  // every rank whether one failed.
  struct Reset {
    Impl& m;
    ~Reset() {
      m.micro = 0;
      std::fill(m.used.begin(), m.used.end(), 0);
      m.twice.clear();
      m.local_bad.clear();
      m.hook_error = nullptr;
      m.micro_batches = 0;
      m.det_unused = m.params.size();
      m.start_micro_step();
    }
  } reset{m};
  if (m.options.deterministic) {
    // Every rank's micro-batches, summed exactly and divided by their total count (avg): the same
    // bits on every rank at any rank count. Collective whatever this rank saw, so that a rank
    // that failed still makes the same calls; the flags below then tell every rank.
    // The last micro-batch bound (one on this rank: the common step) is read where it lies and
    // the result written in its place; otherwise the result is the reducer's, copied in. The
    // ranks may differ in this: either reduce makes the same collectives (exact_sum.hpp).
    const auto& reduced = last_bound ? lockstep::detail::ReducerSteps::reduce_bound(*m.reducer)
                                     : lockstep::detail::ReducerSteps::reduce_accumulated(*m.reducer);
    for (std::size_t j = 0; j < n; ++j) {
      at::Tensor& g = m.params[j].p.mutable_grad();
      if (!holds(g, m.slots[j])) g = m.slots[j];
      if (reduced[j]->raw_data() != m.slots[j].data_ptr())
        std::memcpy(m.slots[j].data_ptr(), reduced[j]->raw_data(), reduced[j]->nbytes());
    }
    m.check_flags(static_cast<std::int32_t>(m.det_unused));
    return m.finish_step();
  }
  std::int32_t first_unused = static_cast<std::int32_t>(n);
  {
    ::torch::NoGradGuard no_grad;
    for (std::size_t j = 0; j < n; ++j) {
      try {
        if (!m.used[j]) {
          if (first_unused == static_cast<std::int32_t>(n)) first_unused = static_cast<std::int32_t>(j);
          m.slots[j].zero_();
          m.params[j].p.mutable_grad() = m.slots[j];
        } else {
          m.ensure_slot(j);
        }
      } catch (...) {
        m.keep_error(j);
      }
      if (!m.launched[j]) m.launch(j);
    }
  }
  m.reducer->reduce();
  m.check_flags(first_unused);
  return m.finish_step();
}

// Every rank learns whether any rank failed before (a gradient hook, a gradient that could not
// be taken, a micro-batch that could not be accumulated), had a parameter without gradient
// (first_unused < n) or one reported twice (one allreduce of three integers), and every rank
// throws the same error.
void DistributedOptimizer::Impl::check_flags(std::int32_t first_unused) {
  auto& m = *this;
  const std::size_t n = m.params.size();
  std::int32_t flags[3] = {first_unused, m.twice.empty() ? 0 : -1, m.hook_error ? -1 : 0};
  if (m.topts.unused_parameters == UnusedParameters::zero) flags[0] = static_cast<std::int32_t>(n);
  m.backend->allreduce(TensorView{flags, 3, DType::i32, Device::cpu()}, ReduceOp::min);
  if (flags[2] != 0) {
    // The failing ranks' errors reach every rank (one allgather; one broadcast of the lowest
    // failing rank's message), which throws it.
    detail::Verdict mine;
    if (m.hook_error) {
      mine = detail::verdict_of([&] { std::rethrow_exception(m.hook_error); });
      mine.message = m.hook_error_param < n
                         ? concat("lockstep::torch::DistributedOptimizer: taking the gradient of '",
                                  m.params[m.hook_error_param].name, "' failed: ", mine.message)
                         : concat("lockstep::torch::DistributedOptimizer: accumulating a micro-batch failed: ",
                                  mine.message);
    }
    detail::agree(*m.backend, "lockstep::torch::DistributedOptimizer::step", 0, mine, 0,
                  "the step was not taken on any rank");
    throw Error("lockstep::torch::DistributedOptimizer::step: a rank failed before the reduction; the step was "
                "not taken on any rank");  // not reached: agree threw the failing rank's error
  }
  if (flags[1] != 0)
    throw InvalidArgument(concat("lockstep::torch::DistributedOptimizer::step: a gradient was produced twice "
                                 "before step() on at least one rank", m.twice.empty() ? "" : " (here: '" + m.twice + "')",
                                 "; its reduction had already started. Call step() after every backward, or use "
                                 "DistributedOptions::accumulation_steps to accumulate; the step was not taken"));
  if (flags[0] < static_cast<std::int32_t>(n))
    throw InvalidArgument(concat(
        "lockstep::torch::DistributedOptimizer::step: parameter '", m.params[static_cast<std::size_t>(flags[0])].name,
        "' got no gradient in this step", m.options.deterministic ? " (in one of its micro-batches)" : "",
        " on at least one rank", first_unused == flags[0] ? " (this one)" : "",
        " (a branch the forward pass did not take?); the step was not taken on any rank. Pass "
        "TorchOptions{.unused_parameters = lockstep::torch::UnusedParameters::zero} to count such "
        "gradients as zero"));
}

// After the reduction, on every rank alike: the division of an accumulation cycle, the skip of a
// non-finite step, the inner step (sharded or not), the replicas' check.
bool DistributedOptimizer::Impl::finish_step() {
  auto& m = *this;
  ::torch::NoGradGuard no_grad;
  // Deterministic mode's exact sum was divided by the total number of micro-batches already.
  if (!m.options.deterministic && m.options.accumulation_steps > 1 && m.options.op == ReduceOp::avg)
    for (auto& b : m.buffers) b.div_(static_cast<double>(m.options.accumulation_steps));
  if (m.options.skip_non_finite) {
    std::vector<Tensor*> all;
    for (auto& v : m.slot_views) all.push_back(&v);
    const std::size_t bad = detail::first_non_finite(all);
    if (bad < all.size()) {
      ++m.skipped;
      detail::log_skipped_step(*m.backend, m.skipped + m.applied, m.local_bad,
                               m.params[bad].name);
      return false;
    }
  }
  if (m.topts.max_grad_norm) m.clip_gradients();
  if (m.sharded)
    m.sharded_step();
  else
    m.optimizer->step();
  ++m.applied;
  if (m.options.check_replicas_every > 0 && m.applied % m.options.check_replicas_every == 0) {
    std::vector<OptParam> all = optimizer_params(*m.optimizer, m.topts.names_from);
    PreparedState state(*m.optimizer, all, state_layout(*m.optimizer, all), 0);
    TensorMap x;
    for (auto& p : all)
      if (p.p.defined()) x.emplace("param." + p.name, borrow(p.p));
    // Sharded, each rank's state is its own by design: the parameters and learning rates only.
    for (auto& [name, t] : state.tensors())
      if (name != "optimizer.torch_archive" && (!m.sharded || name.rfind("optimizer.state.", 0) != 0))
        x.emplace(name, t.reshape_view(t.shape()));
    lockstep::check_replicas(*m.backend, x);
  }
  return true;
}


::torch::optim::Optimizer& DistributedOptimizer::optimizer() const noexcept { return *impl_->optimizer; }
const GradientReducer& DistributedOptimizer::reducer() const noexcept { return *impl_->reducer; }
std::int64_t DistributedOptimizer::skipped_steps() const noexcept { return impl_->skipped; }
std::int64_t DistributedOptimizer::applied_steps() const noexcept { return impl_->applied; }
std::size_t DistributedOptimizer::buffer_count() const noexcept { return impl_->buffers.size(); }

void DistributedOptimizer::accumulate() {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(m.options.deterministic,
                     "lockstep::torch::DistributedOptimizer::accumulate: only in deterministic mode "
                     "(DistributedOptions::deterministic); otherwise accumulate with accumulation_steps");
  m.accumulate_micro_batch();
}
std::int64_t DistributedOptimizer::accumulated() const noexcept { return impl_->micro_batches; }
bool DistributedOptimizer::deterministic() const noexcept { return impl_->options.deterministic; }
double DistributedOptimizer::last_grad_norm() const noexcept { return impl_->grad_norm; }
bool DistributedOptimizer::sharded() const noexcept { return impl_->sharded; }
const std::vector<int>& DistributedOptimizer::owners() const noexcept { return impl_->owners; }
std::int64_t DistributedOptimizer::owned_bytes() const noexcept { return impl_->owned_bytes; }
std::size_t DistributedOptimizer::broadcast_count() const noexcept { return impl_->pbuckets.size(); }


}  // namespace lockstep::torch
