// DistributedOptimizer: wraps any optimizer rule; before the rule's update, the gradients are
// averaged (or summed) across ranks in buckets.
//
//   auto opt   = ls::DistributedOptimizer(backend, ls::Adam{.lr = 1e-3f});
//   auto state = ls::setup(opt, model);          // collective: checks all ranks agree
//   ls::synchronize(backend, state, 0);
//   for (...) {
//     state.begin_step(grads);                  // optional: lets backward report gradients
//     backward(model, batch, grads, [&](ls::Tensor& g) { state.grad_ready(g); });
//     ls::update(state, model, grads);          // reduces what is left, waits, applies the rule
//   }
//
// Buckets: the trainable gradients, taken from the last one backwards (the order backward
// produces them), are grouped into buckets of at most options.bucket_bytes (a tensor larger than
// that is a bucket of its own; dtype or device changes start a new bucket). Bucket 0 holds the
// last layers. Buckets are launched strictly in index order on every rank, whatever order the
// reports come in, so the collectives always match across ranks. A bucket that grad_ready()
// completes during backward starts as nonblocking allreduces (overlapping the rest of backward);
// the buckets update() reduces itself go as blocking allreduces in order, each unpacked right
// after its reduction (device buckets stay nonblocking). Every rank must therefore report the
// same gradients, as the same model code on every rank does; LOCKSTEP_CHECK catches ranks that
// do not.
//
// Zero copy: a bucket whose gradients lie back to back in memory (as flat_zeros_like(model)
// allocates them) is reduced in place; otherwise it is packed into a staging buffer and unpacked
// after the reduction. Either way, after update() the gradients hold the reduced values.
//
// Accumulation: with options.accumulation_steps = k, the first k-1 calls of update() only add the
// gradients into an accumulator (no communication, no parameter change) and the k-th reduces the
// accumulated sum once and applies the rule; with ReduceOp::avg the rule sees the mean over ranks
// and micro-batches. accumulate(state, grads) does the same explicitly (PyTorch's no_sync). With
// accumulation the user's gradient tensors are not overwritten.
#pragma once

#include <source_location>

#include "lockstep/reliability.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/backend.hpp"
#include "lockstep/gradient_reducer.hpp"
#include "lockstep/rules.hpp"
#include "lockstep/replicas.hpp"
#include "lockstep/synchronize.hpp"

namespace lockstep {

namespace detail {
/// The reducer behind DistributedOptimizer is the public GradientReducer.
using GradReducer = GradientReducer;
}  // namespace detail

/// An optimizer rule wrapped so that gradients are reduced across ranks before each update.
/// Usable wherever a rule is: setup(opt, model), update(state, model, grads).
template <OptimizerRule R>
class DistributedOptimizer {
 public:
  /// Wraps `rule`; the backend must outlive the optimizer and its states.
  DistributedOptimizer(Backend& backend, R rule, DistributedOptions options = {})
      : backend_(&backend), rule_(std::move(rule)), options_(options) {
    LOCKSTEP_CHECK_ARG(options.op == ReduceOp::avg || options.op == ReduceOp::sum,
                       "DistributedOptimizer: op must be avg or sum, got ", name(options.op));
    LOCKSTEP_CHECK_ARG(options.accumulation_steps >= 1,
                       "DistributedOptimizer: accumulation_steps must be >= 1, got ",
                       options.accumulation_steps);
  }
  Backend& backend() const noexcept { return *backend_; }
  const R& rule() const noexcept { return rule_; }
  const DistributedOptions& options() const noexcept { return options_; }

 private:
  Backend* backend_;
  R rule_;
  DistributedOptions options_;
};

/// Optimizer state of a DistributedOptimizer: the wrapped rule's state (traversed exactly like
/// OptState: "step" and "slots") plus the gradient reducer (not traversed).
/// Move-only. A moved-from state is empty: step 0, no slots, no counted steps and no reducer;
/// begin_step, grad_ready, reducer(), update and accumulate on it throw InvalidArgument ("used
/// after move"). Move-assignment replaces the target's reducer (waiting for any reduction it
/// has in flight); self-move keeps the state as it is.
template <OptimizerRule R>
class DistributedState {
 public:
  /// An empty state (no rule state, no reducer), to be assigned one from setup() later; every
  /// use but assignment throws InvalidArgument, as on a moved-from state.
  DistributedState() = default;
  DistributedState(OptState<R> inner, std::unique_ptr<detail::GradReducer> reducer,
                   DistributedOptions options = {})
      : inner(std::move(inner)), reducer_(std::move(reducer)), options_(options) {
    LOCKSTEP_CHECK_ARG(reducer_ != nullptr, "DistributedState: no gradient reducer given");
  }
  DistributedState(DistributedState&& other) noexcept(std::is_nothrow_move_constructible_v<OptState<R>>)
      : inner(std::move(other.inner)),
        reducer_(std::move(other.reducer_)),
        options_(other.options_),
        skipped_(other.skipped_),
        applied_(other.applied_) {
    other.reset_to_empty();
  }
  DistributedState& operator=(DistributedState&& other) noexcept(
      std::is_nothrow_move_assignable_v<OptState<R>>) {
    if (this != &other) {
      inner = std::move(other.inner);
      reducer_ = std::move(other.reducer_);  // this state's old reducer waits for its requests
      options_ = other.options_;
      skipped_ = other.skipped_;
      applied_ = other.applied_;
      other.reset_to_empty();
    }
    return *this;
  }
  DistributedState(const DistributedState&) = delete;
  DistributedState& operator=(const DistributedState&) = delete;

  /// The wrapped rule's state (rule hyperparameters, step count, slots).
  OptState<R> inner;

  /// Starts a step: binds the gradient tensors so that backward can report them with
  /// grad_ready(). Optional; without it update() reduces everything itself.
  template <class G>
  void begin_step(G& grads) {
    live_reducer("begin_step").bind(trainable_leaves(grads));
  }
  /// Reports that gradient `g` (a tensor of the grads passed to begin_step) is final; a bucket
  /// whose gradients are all final starts reducing at once.
  void grad_ready(const Tensor& g) { live_reducer("grad_ready").mark_ready(g); }

  /// The gradient reducer (bucket counts, for tests and benchmarks). Throws InvalidArgument on
  /// a moved-from state.
  const detail::GradReducer& reducer() const { return live_reducer("reducer"); }
  detail::GradReducer& reducer() { return live_reducer("reducer"); }

  /// The options of the DistributedOptimizer this state was set up with.
  const DistributedOptions& options() const noexcept { return options_; }
  /// Optimizer steps skipped because a gradient was not finite (skip_non_finite), and steps
  /// applied; the same on every rank.
  std::int64_t skipped_steps() const noexcept { return skipped_; }
  std::int64_t applied_steps() const noexcept { return applied_; }
  /// Counts a skipped or an applied step (used by update()).
  void count_step(bool skipped) noexcept { ++(skipped ? skipped_ : applied_); }

 private:
  detail::GradReducer& live_reducer(const char* what) const {
    LOCKSTEP_CHECK_ARG(reducer_ != nullptr, "DistributedState::", what,
                       ": the state is empty: default-constructed (assign it the result of setup()) or "
                       "used after move (its gradient reducer now belongs to the DistributedState it "
                       "was moved to)");
    return *reducer_;
  }
  void reset_to_empty() noexcept {
    inner.step = 0;
    inner.slots.clear();
    reducer_.reset();
    skipped_ = applied_ = 0;
  }

  std::unique_ptr<detail::GradReducer> reducer_;
  DistributedOptions options_;
  std::int64_t skipped_ = 0, applied_ = 0;
};

template <class R, class V>
void lockstep_visit_fields(DistributedState<R>& s, V&& v) {
  lockstep_visit_fields(s.inner, v);
}
template <class R, class V>
void lockstep_visit_fields(const DistributedState<R>& s, V&& v) {
  lockstep_visit_fields(s.inner, v);
}

/// State for a DistributedOptimizer: the rule's state plus the bucket plan. Collective: checks
/// that every rank has the same trainable tensors and options (MismatchError otherwise).
template <OptimizerRule R, class M>
DistributedState<R> setup(const DistributedOptimizer<R>& opt, const M& model) {
  std::vector<detail::GradLeaf> leaves;
  for_each_tensor(model, [&](const Tensor& t) {
    if (is_trainable(t)) leaves.push_back({t.numel(), t.dtype(), t.device()});
  });
  auto paths = detail::trainable_paths(model);
  const std::string sig = detail::reducer_signature(opt.options(), leaves);
  detail::check_same_structure(opt.backend(), sig, 0, 0, "DistributedOptimizer setup", [&] {
    std::vector<detail::StructureEntry> e;
    e.push_back({"options", detail::reducer_signature(opt.options(), {})});
    for (std::size_t i = 0; i < leaves.size(); ++i)
      e.push_back({paths[i], detail::concat("tensor ", name(leaves[i].dtype), " of ", leaves[i].numel,
                                    " elements on ", to_string(leaves[i].device))});
    return e;
  });
  auto reducer = std::make_unique<detail::GradReducer>(opt.backend(), opt.options(),
                                                       std::move(leaves), std::move(paths));
  return DistributedState<R>(setup(opt.rule(), model), std::move(reducer), opt.options());
}

/// Reduces the gradients across ranks (or, in an accumulate-only micro-step, only accumulates
/// them) and applies the wrapped rule. Collective.
template <OptimizerRule R, class M, class G>
void update(DistributedState<R>& state, M& model, G& grads,
            std::source_location loc = std::source_location::current()) {
  detail::CallSiteScope site(loc, "update");  // its collectives name this call too
  auto [params, gs] = detail::aligned_leaves("update", model, grads);
  auto& red = state.reducer();
  if (!red.bound_to(gs)) red.bind(gs);
  if (!red.final_micro_step()) {
    red.accumulate();
    return;
  }
  // Reliability (docs/reliability.md): non-finite gradients skip the step on every rank; the
  // replicas are compared every K steps.
  const DistributedOptions& o = state.options();
  std::string local_bad;
  if (o.skip_non_finite) local_bad = detail::describe_non_finite(gs, [&] { return detail::trainable_paths(grads); });
  const auto& reduced = red.reduce_bound();
  if (o.skip_non_finite) {
    const std::size_t bad = detail::first_non_finite(reduced);
    if (bad < reduced.size()) {
      state.count_step(true);
      detail::log_skipped_step(red.backend(), state.skipped_steps() + state.applied_steps(), local_bad,
                               detail::trainable_paths(grads)[bad]);
      return;
    }
  }
  update_leaves(state.inner, params, reduced);
  state.count_step(false);
  if (o.check_replicas_every > 0 && state.applied_steps() % o.check_replicas_every == 0)
    check_replicas(red.backend(), std::tie(model, state.inner));
}

/// Adds grads into the state's accumulator without communicating or stepping (PyTorch's
/// no_sync); the next update() reduces the accumulated sum with its own gradients.
template <OptimizerRule R, class G>
void accumulate(DistributedState<R>& state, G& grads) {
  auto gs = trainable_leaves(grads);
  auto& red = state.reducer();
  if (!red.bound_to(gs)) red.bind(gs);
  red.accumulate();
}

}  // namespace lockstep
