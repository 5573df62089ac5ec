// GradientReducer, the gradient reduction behind DistributedOptimizer: setup (the ranks' agreement),
// binding a step's gradients, ready reports, accumulation and the reduction of a step. The rest of
// its work is in the files reducer_impl.hpp lists.
#include "train/reducer_impl.hpp"

#include <algorithm>
#include <exception>
#include <unordered_map>

#include "lockstep/comm/consensus.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep {

using detail::concat;
using detail::GradLeaf;

// Throws InvalidArgument if a bound gradient of bucket b is no longer what bind() checked:
// moved from, or reassigned with another size, dtype or device, since it was bound. Called
// before the bucket is read or reduced, so nothing has been sent when it throws.
void GradientReducer::Impl::verify_bound(const Bucket& b) const {
  for (std::size_t j = b.first; j < b.last; ++j) {
    const Tensor& g = *bound[j];
    const GradLeaf& l = leaves[j];
    LOCKSTEP_CHECK_ARG(g.numel() == l.numel && g.dtype() == l.dtype && g.device() == l.device &&
                           (g.raw_data() != nullptr || l.numel == 0),
                       "DistributedOptimizer: gradient '", paths[j], "' changed after it was bound ",
                       "by begin_step/update: it is now ", name(g.dtype()), " ", to_string(g.shape()),
                       " on ", to_string(g.device()), g.raw_data() == nullptr ? " with no memory" : "",
                       ", expected ", name(l.dtype), " of ", l.numel, " elements on ",
                       to_string(l.device), " (was it moved from or reassigned?)");
  }
}

void GradientReducer::Impl::reset_step() {
  is_bound = false;
  bound.clear();
  index_of.clear();
  next_launch = 0;
  for (auto& b : buckets) {
    b.remaining = static_cast<int>(b.last - b.first);
    b.launched = false;
    b.staged = false;
    b.finished = false;
    b.threaded = false;
  }
}

GradientReducer::GradientReducer(Backend& backend, const DistributedOptions& options,
                         std::vector<GradLeaf> leaves, std::vector<std::string> paths)
    : impl_(std::make_unique<Impl>()) {
  impl_->backend = &backend;
  impl_->options = options;
  impl_->leaves = std::move(leaves);
  impl_->paths = std::move(paths);
  impl_->plan();
  impl_->layout();
  impl_->plan_carrier();
  impl_->setup_exact();
  impl_->reset_step();
  impl_->start_thread_if_used();
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::bind(const std::vector<Tensor*>& grads) {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(!m.is_bound || m.next_launch == 0,
                     "DistributedOptimizer: buckets of the gradients passed to begin_step are "
                     "in flight; update (or begin_step) must get those same gradient tensors");
  LOCKSTEP_CHECK_ARG(grads.size() == m.leaves.size(), "DistributedOptimizer: got ", grads.size(),
                     " trainable gradients, the optimizer was set up for ", m.leaves.size());
  for (std::size_t j = 0; j < grads.size(); ++j) {
    const auto& l = m.leaves[j];
    const Tensor& g = *grads[j];
    LOCKSTEP_CHECK_ARG(g.numel() == l.numel && g.dtype() == l.dtype && g.device() == l.device,
                       "DistributedOptimizer: gradient '", m.paths[j], "' is ", name(g.dtype()), " ",
                       to_string(g.shape()), " on ", to_string(g.device()), ", expected ",
                       name(l.dtype), " of ", l.numel, " elements on ", to_string(l.device));
  }
  m.reset_step();
  m.bound = grads;
  m.is_bound = true;
  m.index_of.reserve(grads.size());
  for (std::size_t j = 0; j < grads.size(); ++j) m.index_of[grads[j]] = j;
  m.ready.assign(grads.size(), 0);
  m.zero_copy = 0;
  if (m.accumulated > 0) {
    for (auto& b : m.buckets) m.ensure_work(b);
  }
}

bool GradientReducer::bound_to(const std::vector<Tensor*>& grads) const noexcept {
  return impl_->is_bound && impl_->bound == grads;
}

void GradientReducer::grad_ready(const Tensor& grad) {
  auto& m = *impl_;
  // A reducer made from gradients binds them at the first report of a step; one an optimizer
  // made is bound by its begin_step.
  if (!m.is_bound && m.owns_grads) bind(own_);
  LOCKSTEP_CHECK_ARG(m.is_bound, "grad_ready: call begin_step(grads) before reporting gradients");
  auto it = m.index_of.find(&grad);
  LOCKSTEP_CHECK_ARG(it != m.index_of.end(),
                     "grad_ready: the tensor is not one of the trainable gradients passed to "
                     "begin_step");
  const std::size_t j = it->second;
  LOCKSTEP_CHECK_ARG(!m.ready[j], "grad_ready: gradient '", m.paths[j], "' reported twice");
  m.ready[j] = 1;
  if (m.options.deterministic) return;  // everything is reduced at once, exactly, at the end
  if (!final_micro_step()) return;  // accumulate-only micro-step: nothing to launch
  // Without the communication thread, host buckets are launched by reduce_bound, with the
  // blocking collective, on every rank. Launched here they would be nonblocking, so the form of a
  // bucket's collective would depend on which gradients this rank reported (a branch that did
  // not run, a cycle cut short), and MPI does not match a blocking collective with a
  // nonblocking one: the ranks would wait for each other until the deadline.
  if (!m.use_thread && m.has_host_bucket) return;
  auto& b = m.buckets[m.bucket_of[j]];
  --b.remaining;
  if (b.remaining == 0) m.launch_ready();
  m.poke();
}

bool GradientReducer::final_micro_step() const noexcept {
  return impl_->accumulated + 1 >= impl_->options.accumulation_steps;
}

void GradientReducer::accumulate() {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(m.is_bound && m.next_launch == 0,
                     "accumulate: no gradients bound, or buckets already in flight");
  for (const auto& b : m.buckets) m.verify_bound(b);
  if (m.options.deterministic) {
    m.exact_add();
    ++m.accumulated;
    m.reset_step();
    return;
  }
  for (auto& b : m.buckets) {
    m.ensure_work(b);
    if (m.accumulated == 0) b.work.zero_();
    m.add_bucket(b);
  }
  ++m.accumulated;
  m.reset_step();
}

const std::vector<Tensor*>& GradientReducer::reduce_bound() {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(m.is_bound, "DistributedOptimizer: reduce without bound gradients");
  if (m.options.deterministic) {
    for (const auto& b : m.buckets) m.verify_bound(b);
    auto last = m.exact_parts();  // the step's last micro-batch, read where it lies
    m.accumulated = 0;
    m.reset_step();
    m.result = m.exact_reduce(last);
    return m.result;
  }
  // Reduce what backward did not report, in bucket order, each host bucket with blocking calls
  // and unpacked right after, while it is still in cache. Consecutive device buckets are packed
  // (one launch each) and sent together in one iallreduce_many (one NCCL group); the group's
  // request sits in its first bucket, which finish() reaches before the others.
  std::vector<std::size_t> group;
  std::vector<TensorView> views;
  auto send_group = [&] {
    if (!views.empty()) {
      detail::StreamOrderedScope ordered;  // packed, or the step's gradients: on the current stream
      Request r = m.backend->iallreduce_many(views, m.wire ? ReduceOp::sum : m.options.op);
      for (std::size_t bi : group) r = m.keeping(std::move(r), m.buckets[bi]);
      m.buckets[group.front()].requests.push_back(std::move(r));
    }
    group.clear();
    views.clear();
  };
  while (m.next_launch < m.buckets.size()) {
    m.verify_bound(m.buckets[m.next_launch]);
    const std::size_t bi = m.next_launch++;
    auto& b = m.buckets[bi];
    if (!b.device.is_cpu() && !m.sharded) {
      b.requests.clear();
      const TensorView t = m.prepare(bi);
      if (t.numel > 0) {
        group.push_back(bi);
        views.push_back(t);
      }
      continue;
    }
    send_group();
    m.launch(bi, /*blocking=*/true);
    if (b.requests.empty()) m.finish(b);
    else m.poke();
  }
  send_group();
  for (auto& b : m.buckets) m.finish(b);
  if (m.use_thread) {
    std::exception_ptr err;
    {
      std::lock_guard lk(m.wm);
      std::swap(err, m.werror);
    }
    if (err) {
      m.reset_step();
      std::rethrow_exception(err);
    }
  }
  // The counts were carried by one of the step's calls; a difference throws on every rank.
  m.check_micro_steps();
  if (m.accumulated > 0) {
    m.make_accum_views();
    m.result = m.accum_ptrs;
    m.accumulated = 0;
  } else {
    m.result = m.bound;
  }
  m.reset_step();
  return m.result;
}

const std::vector<Tensor*>& GradientReducer::reduce_accumulated() {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(m.options.deterministic,
                     "apply_accumulated: only in deterministic mode (DistributedOptions::deterministic); "
                     "otherwise update() ends the step with its own gradients");
  LOCKSTEP_CHECK_ARG(m.next_launch == 0, "apply_accumulated: buckets of bound gradients are in flight");
  m.accumulated = 0;
  m.reset_step();
  m.result = m.exact_reduce({});
  return m.result;
}

std::size_t GradientReducer::bucket_count() const noexcept { return impl_->buckets.size(); }
std::size_t GradientReducer::zero_copy_buckets() const noexcept { return impl_->zero_copy; }
int GradientReducer::accumulated() const noexcept { return impl_->accumulated; }
Backend& GradientReducer::backend() const noexcept { return *impl_->backend; }

const std::vector<std::string>& GradientReducer::names() const noexcept { return impl_->paths; }

GradientReducer::GradientReducer(Backend& backend, std::vector<Tensor*> grads,
                                 std::vector<std::string> names, DistributedOptions options,
                                 std::source_location loc)
    : impl_(std::make_unique<Impl>()) {
  detail::CallSiteScope site(loc, "GradientReducer");
  // Arguments are checked on every rank and the ranks agree on the verdict before anything
  // else: a rank that refuses its own arguments makes every rank throw the same error.
  std::vector<GradLeaf> leaves;
  const detail::Verdict mine = detail::verdict_of([&] {
    LOCKSTEP_CHECK_ARG(options.op == ReduceOp::avg || options.op == ReduceOp::sum,
                       "GradientReducer: op must be avg or sum, got ", name(options.op));
    LOCKSTEP_CHECK_ARG(options.accumulation_steps >= 1,
                       "GradientReducer: accumulation_steps must be >= 1, got ", options.accumulation_steps);
    LOCKSTEP_CHECK_ARG(names.size() == grads.size(), "GradientReducer: ", grads.size(),
                       " gradients and ", names.size(), " names");
    leaves.reserve(grads.size());
    std::unordered_map<const Tensor*, std::size_t> seen;
    for (std::size_t j = 0; j < grads.size(); ++j) {
      LOCKSTEP_CHECK_ARG(grads[j] != nullptr, "GradientReducer: gradient '", names[j], "' is a null pointer");
      const Tensor& g = *grads[j];
      LOCKSTEP_CHECK_ARG(g.raw_data() != nullptr || g.numel() == 0, "GradientReducer: gradient '",
                         names[j], "' has no memory (moved from?)");
      LOCKSTEP_CHECK_ARG(is_floating(g.dtype()), "GradientReducer: gradient '", names[j], "' is ",
                         name(g.dtype()), "; gradients are floating-point tensors");
      auto [it, fresh] = seen.emplace(grads[j], j);
      LOCKSTEP_CHECK_ARG(fresh, "GradientReducer: gradients '", names[it->second], "' and '", names[j],
                         "' are the same tensor");
      leaves.push_back({g.numel(), g.dtype(), g.device(), g.shape()});
    }
    LOCKSTEP_CHECK_ARG(!options.shard_optimizer_state,
                       "GradientReducer: shard_optimizer_state needs an optimizer that updates only its "
                       "shard (DistributedOptimizer); a reducer alone would leave most gradients unreduced");
    const std::string bad = detail::check_options(options, leaves, names);
    LOCKSTEP_CHECK_ARG(bad.empty(), "GradientReducer: ", bad);
  });
  detail::agree(backend, "GradientReducer", 0, mine, 0, "no reducer was made");
  // The ranks compare the size each will use: an explicit 1 MiB and the unset default on one
  // machine are the same buckets.
  options = detail::resolved_options(options, backend);
  const std::string sig = detail::reducer_signature(options, leaves, names);
  detail::check_same_structure(backend, sig, 0, 0, "GradientReducer", [&] {
    return detail::reducer_entries(options, leaves, names);
  });
  impl_->backend = &backend;
  impl_->options = options;
  impl_->leaves = std::move(leaves);
  impl_->paths = std::move(names);
  impl_->plan();
  impl_->layout();
  impl_->plan_carrier();
  impl_->setup_exact();
  impl_->reset_step();
  impl_->start_thread_if_used();
  impl_->owns_grads = true;
  own_ = std::move(grads);
}

bool GradientReducer::reduce() {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(!own_.empty() || m.leaves.empty(),
                     "GradientReducer::reduce: this reducer was made without gradients (it is "
                     "bound step by step by its optimizer)");
  if (!m.is_bound) bind(own_);
  if (!final_micro_step()) {
    accumulate();
    return false;
  }
  const auto& out = reduce_bound();
  if (out != own_) {
    // The accumulated sum lives in the reducer's buffers: copied into the gradients.
    for (std::size_t j = 0; j < own_.size(); ++j)
      detail::copy_grad_bytes(own_[j]->raw_data(), own_[j]->device(), out[j]->raw_data(), out[j]->device(),
                 own_[j]->nbytes());
  }
  return true;
}

}  // namespace lockstep
