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
// after its reduction (device buckets: 25 MiB, sent together nonblocking, see
// gradient_reducer.hpp). Every rank must therefore report the same gradients, as the same model
// code on every rank does; LOCKSTEP_CHECK catches ranks that do not.
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

#include "lockstep/reliability/call_site.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/train/buddy_copy.hpp"
#include "lockstep/train/gradient_reducer.hpp"
#include "lockstep/train/rules.hpp"
#include "lockstep/train/replicas.hpp"
#include "lockstep/train/synchronize.hpp"

namespace lockstep {

namespace detail {
/// The 0.2 name of the reducer behind DistributedOptimizer, kept for one release.
using GradReducer [[deprecated("use GradientReducer")]] = GradientReducer;

/// A rule that declares `static constexpr bool elementwise = true` updates every element from
/// that element alone (SGD, Adam), so it can be applied to any piece of a tensor: what
/// shard_optimizer_state needs. A rule with a per-tensor quantity (a norm, as LAMB's trust
/// ratio) cannot be split inside a tensor and is refused for sharding.
template <class R>
constexpr bool is_elementwise_rule() {
  if constexpr (requires { R::elementwise; }) return static_cast<bool>(R::elementwise);
  else return false;
}

/// Sharded state: the part [lo, hi) (elements, inside the tensor) of trainable tensor `leaf`
/// that this rank owns.
struct ShardPiece {
  std::size_t leaf = 0;
  std::int64_t lo = 0, hi = 0;
};
/// The pieces of the reducer's flat space that this rank owns, in order.
std::vector<ShardPiece> shard_pieces(const GradientReducer& red);
/// Copies the elements [begin, begin + n) of the flat space of `ts` (tensors of one dtype, back
/// to back in that space) into `buf` (to_buf) or out of it.
void copy_flat_range(const std::vector<Tensor*>& ts, const std::vector<std::int64_t>& offsets,
                     std::int64_t begin, std::int64_t n, std::byte* buf, bool to_buf);
/// Sharded checkpoint support: every rank in turn broadcasts its shard of one slot field
/// (packed: its pieces back to back, shard_numel() elements); root unpacks every rank's into
/// `full` (the field of every leaf, full size; empty on the other ranks). Collective.
/// `dtype`: the field's, the same on every rank (a rank that owns no piece has no tensor of the
/// field to read it from).
void gather_field_to_root(GradientReducer& red, const std::vector<Tensor*>& mine_pieces,
                          const std::vector<Tensor*>& full, DType dtype, int root);
/// Copies this rank's shard of `full` (one slot field, every leaf full size) into its pieces.
void scatter_field_from_full(const std::vector<ShardPiece>& pieces,
                             const std::vector<Tensor*>& mine_pieces, const std::vector<Tensor*>& full);
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
    LOCKSTEP_CHECK_ARG(!options.wire_dtype || *options.wire_dtype == DType::bf16 || *options.wire_dtype == DType::f16,
                       "DistributedOptimizer: wire_dtype must be bf16 or f16 (a 16-bit float), got ",
                       options.wire_dtype ? name(*options.wire_dtype) : "none");
    LOCKSTEP_CHECK_ARG(!options.shard_optimizer_state || detail::is_elementwise_rule<R>(),
                       "DistributedOptimizer: shard_optimizer_state splits tensors between ranks, which "
                       "needs an elementwise rule (one that declares static constexpr bool elementwise = "
                       "true, as SGD and Adam do); a rule with per-tensor quantities cannot be sharded");
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
  DistributedState(OptState<R> inner, std::unique_ptr<GradientReducer> reducer,
                   DistributedOptions options = {})
      : inner(std::move(inner)), reducer_(std::move(reducer)), options_(options) {
    LOCKSTEP_CHECK_ARG(reducer_ != nullptr, "DistributedState: no gradient reducer given");
  }
  /// A sharded state (DistributedOptions::shard_optimizer_state): `inner.slots` holds one slot
  /// per piece of this rank's shard; `shapes` are the shapes of every trainable tensor.
  DistributedState(OptState<R> inner, std::unique_ptr<GradientReducer> reducer, DistributedOptions options,
                   std::vector<detail::ShardPiece> pieces, std::vector<Shape> shapes, DType dtype)
      : DistributedState(std::move(inner), std::move(reducer), options) {
    sharded_ = true;
    pieces_ = std::move(pieces);
    shapes_ = std::move(shapes);
    dtype_ = dtype;
  }
  DistributedState(DistributedState&& other) noexcept(std::is_nothrow_move_constructible_v<OptState<R>>)
      : inner(std::move(other.inner)),
        reducer_(std::move(other.reducer_)),
        options_(other.options_),
        skipped_(other.skipped_),
        applied_(other.applied_),
        sharded_(other.sharded_),
        pieces_(std::move(other.pieces_)),
        shapes_(std::move(other.shapes_)),
        dtype_(other.dtype_),
        buddy_plan_(std::move(other.buddy_plan_)),
        buddy_(std::move(other.buddy_)) {
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
      sharded_ = other.sharded_;
      pieces_ = std::move(other.pieces_);
      shapes_ = std::move(other.shapes_);
      dtype_ = other.dtype_;
      buddy_plan_ = std::move(other.buddy_plan_);
      buddy_ = std::move(other.buddy_);
      full_.clear();
      materialized_ = false;
      other.reset_to_empty();
    }
    return *this;
  }
  DistributedState(const DistributedState&) = delete;
  DistributedState& operator=(const DistributedState&) = delete;

  /// The wrapped rule's state (rule hyperparameters, step count, slots). Sharded: one slot per
  /// piece of this rank's shard (see shard_pieces()), not one per trainable tensor.
  OptState<R> inner;

  /// True if the optimizer state is sharded across ranks (ZeRO-1).
  bool sharded() const noexcept { return sharded_; }
  /// Sharded: the pieces of the trainable tensors whose rule state this rank keeps.
  const std::vector<detail::ShardPiece>& shard_pieces() const noexcept { return pieces_; }
  /// Bytes of rule state (slot tensors) this rank holds: about 1/N of the replicated figure when
  /// sharded.
  std::size_t local_state_bytes() const {
    std::size_t n = 0;
    for_each_tensor(inner.slots, [&](const Tensor& t) { n += t.nbytes(); });
    return n;
  }

  /// Checkpoints of a sharded state (called by save_checkpoint / load_checkpoint through the
  /// traversal): before a save, root gathers every rank's shard into full-size slots, which the
  /// traversal then shows exactly as a replicated state's ("step", "slots[i]..."), so the file
  /// does not depend on N; before a load every rank makes full-size slots for the file to fill,
  /// and after a successful load each rank keeps its own shard of them. Nothing for a
  /// replicated state.
  void lockstep_checkpoint_phase(Backend& backend, int root, detail::CheckpointPhase phase) const {
    if (!sharded_) return;
    switch (phase) {
      case detail::CheckpointPhase::before_save: {
        full_.clear();
        if (backend.rank() == root) make_full();
        for_each_field([&](const std::vector<Tensor*>& mine, const std::vector<Tensor*>& full, DType field) {
          detail::gather_field_to_root(live_reducer("save_checkpoint"), mine, full, field, root);
        });
        materialized_ = true;
        break;
      }
      case detail::CheckpointPhase::before_load:
        make_full();
        materialized_ = true;
        break;
      case detail::CheckpointPhase::after_load_ok:
        for_each_field([&](const std::vector<Tensor*>& mine, const std::vector<Tensor*>& full, DType) {
          detail::scatter_field_from_full(pieces_, mine, full);  // local copies: safe in a destructor
        });
        [[fallthrough]];
      case detail::CheckpointPhase::after:
        full_.clear();
        materialized_ = false;
        break;
    }
  }
  /// rescue_buddy (DistributedOptions): the plan (who holds whose copy) and the copy of the
  /// last completed step; null without rescue_buddy.
  const detail::BuddyCopy* buddy_copy() const noexcept { return buddy_.get(); }
  const detail::BuddyPlan& buddy_plan() const noexcept { return buddy_plan_; }
  /// Used by setup(): turns the buddy copy on with `plan`.
  void set_buddy_plan(detail::BuddyPlan plan) {
    buddy_plan_ = std::move(plan);
    buddy_ = std::make_shared<detail::BuddyCopy>();
  }
  /// Used by update() at the end of an applied sharded step (collective; nothing without
  /// rescue_buddy): this rank's shard and its source's, of this step.
  void take_buddy_copy(const std::vector<Tensor*>& params) {
    if (!buddy_) return;
    std::vector<std::vector<Tensor*>> fields;
    std::vector<std::size_t> bytes;
    for_each_field([&](const std::vector<Tensor*>& mine, const std::vector<Tensor*>&, DType dt) {
      fields.push_back(mine);
      bytes.push_back(size_of(dt));
    });
    detail::take_buddy_copy(live_reducer("update"), buddy_plan_, params, fields, bytes, inner.step, *buddy_);
  }
  /// For write_rescue_state (local, no communication): on, the traversal shows full-size zero
  /// slots as a checkpoint does, for the rescue file's names; off, as before.
  void rescue_view(bool on) const {
    full_.clear();
    if (on) make_full();
    materialized_ = on;
  }
  /// During rescue_view(true): each used field's full-size tensors, one per trainable tensor.
  std::vector<std::vector<const Tensor*>> rescue_fields() const {
    std::vector<std::vector<const Tensor*>> out;
    for_each_field([&](const std::vector<Tensor*>&, const std::vector<Tensor*>& full, DType) {
      out.emplace_back(full.begin(), full.end());
    });
    return out;
  }
  /// Where the rule's step count lives (the rescue file takes the copy's count there).
  const void* rule_step_address() const noexcept { return &inner.step; }

  /// Sharded, during a checkpoint: the full-size slots (empty otherwise).
  std::vector<typename R::Slot>& checkpoint_slots() const noexcept { return full_; }
  bool checkpoint_view() const noexcept { return materialized_; }

  /// Starts a step: binds the gradient tensors so that backward can report them with
  /// grad_ready(). Optional; without it update() reduces everything itself.
  template <class G>
  void begin_step(G& grads) {
    detail::ReducerSteps::bind(live_reducer("begin_step"), trainable_leaves(grads));
  }
  /// Reports that gradient `g` (a tensor of the grads passed to begin_step) is final; a bucket
  /// whose gradients are all final starts reducing at once.
  void grad_ready(const Tensor& g) { live_reducer("grad_ready").grad_ready(g); }

  /// The gradient reducer (bucket counts, for tests and benchmarks). Throws InvalidArgument on
  /// a moved-from state.
  const GradientReducer& reducer() const { return live_reducer("reducer"); }
  GradientReducer& reducer() { return live_reducer("reducer"); }

  /// The options of the DistributedOptimizer this state was set up with.
  const DistributedOptions& options() const noexcept { return options_; }
  /// Optimizer steps skipped because a gradient was not finite (skip_non_finite), and steps
  /// applied; the same on every rank.
  std::int64_t skipped_steps() const noexcept { return skipped_; }
  std::int64_t applied_steps() const noexcept { return applied_; }
  /// Counts a skipped or an applied step (used by update()).
  void count_step(bool skipped) noexcept { ++(skipped ? skipped_ : applied_); }

 private:
  GradientReducer& live_reducer(const char* what) const {
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
    sharded_ = false;
    pieces_.clear();
    shapes_.clear();
    full_.clear();
    materialized_ = false;
    buddy_plan_ = {};
    buddy_.reset();
  }
  // Full-size slots, one per trainable tensor, made by the rule from zeros of its shape.
  void make_full() const {
    full_.clear();
    full_.reserve(shapes_.size());
    for (const auto& sh : shapes_) full_.push_back(inner.rule.init(Tensor::zeros(sh, dtype_)));
  }
  // f(mine, full, dtype) for each tensor field of the rule's slot: this rank's pieces of that
  // field, (where made) the full-size tensors of that field for every trainable tensor, and the
  // field's dtype (from the probe: the same on every rank, also on one that owns no piece). A
  // field the rule leaves empty (SGD's momentum buffer without momentum) is skipped.
  template <class F>
  void for_each_field(F&& f) const {
    typename R::Slot probe = inner.rule.init(Tensor::zeros({1}, dtype_));
    const auto probe_fields = tensor_leaves(probe);
    const std::size_t fields = probe_fields.size();
    std::vector<char> unused(fields);
    for (std::size_t t = 0; t < fields; ++t) unused[t] = probe_fields[t]->numel() == 0;
    auto& slots = const_cast<std::vector<typename R::Slot>&>(inner.slots);
    for (std::size_t t = 0; t < fields; ++t) {
      std::vector<Tensor*> mine, full;
      for (auto& sl : slots) mine.push_back(tensor_leaves(sl)[t]);
      for (auto& sl : full_) full.push_back(tensor_leaves(sl)[t]);
      // Whether a field is used must not depend on the rank (a rank may own no piece): every
      // rank decides on the rule's slot for a one-element tensor.
      if (unused[t]) continue;
      f(mine, full, probe_fields[t]->dtype());
    }
  }

  std::unique_ptr<GradientReducer> reducer_;
  DistributedOptions options_;
  std::int64_t skipped_ = 0, applied_ = 0;
  bool sharded_ = false;
  std::vector<detail::ShardPiece> pieces_;
  std::vector<Shape> shapes_;
  DType dtype_ = DType::f32;
  detail::BuddyPlan buddy_plan_;
  std::shared_ptr<detail::BuddyCopy> buddy_;
  mutable std::vector<typename R::Slot> full_;
  mutable bool materialized_ = false;
};

// A replicated state is traversed as its OptState ("step", "slots"). A sharded one shows "step"
// alone (its shards differ per rank by design: synchronize makes the step agree), and during a
// checkpoint "step" and the full-size "slots", the names and shapes a replicated state has.
template <class R, class V>
void lockstep_visit_fields(DistributedState<R>& s, V&& v) {
  if (!s.sharded()) return lockstep_visit_fields(s.inner, v);
  v("step", s.inner.step);
  if (s.checkpoint_view()) v("slots", s.checkpoint_slots());
}
template <class R, class V>
void lockstep_visit_fields(const DistributedState<R>& s, V&& v) {
  if (!s.sharded()) return lockstep_visit_fields(s.inner, v);
  v("step", s.inner.step);
  if (s.checkpoint_view()) v("slots", std::as_const(s.checkpoint_slots()));
}

/// State for a DistributedOptimizer: the rule's state plus the bucket plan. Collective: checks
/// that every rank has the same trainable tensors and options (MismatchError otherwise).
template <OptimizerRule R, class M>
[[nodiscard]] DistributedState<R> setup(const DistributedOptimizer<R>& opt, const M& model) {
  std::vector<detail::GradLeaf> leaves;
  for_each_tensor(model, [&](const Tensor& t) {
    if (is_trainable(t)) leaves.push_back({t.numel(), t.dtype(), t.device(), t.shape()});
  });
  auto paths = detail::trainable_paths(model);
  // The options with the host bucket size this backend gives (an unset bucket_bytes follows
  // the path): the ranks compare, and the reducer uses, the size that decides the buckets.
  const DistributedOptions options = detail::resolved_options(opt.options(), opt.backend());
  // Names (paths, map keys), order, shapes, dtypes and options: what decides which numbers meet.
  const std::string sig = detail::reducer_signature(options, leaves, paths);
  detail::check_same_structure(opt.backend(), sig, 0, 0, "DistributedOptimizer setup",
                               [&] { return detail::reducer_entries(options, leaves, paths); });
  // The same options and tensors on every rank (checked above): each rank reaches the same
  // verdict on them, so an error here is the same on every rank.
  const std::string bad = detail::check_options(options, leaves, paths);
  LOCKSTEP_CHECK_ARG(bad.empty(), "DistributedOptimizer setup: ", bad);
  const DType dtype = leaves.empty() ? DType::f32 : leaves[0].dtype;
  auto reducer = detail::ReducerSteps::make(opt.backend(), options, std::move(leaves), std::move(paths));
  if (!options.shard_optimizer_state)
    return DistributedState<R>(setup(opt.rule(), model), std::move(reducer), options);
  // Sharded: rule state only for this rank's pieces.
  auto pieces = detail::shard_pieces(*reducer);
  std::vector<Shape> shapes;
  std::vector<const Tensor*> params;
  for_each_tensor(model, [&](const Tensor& t) {
    if (is_trainable(t)) {
      shapes.push_back(t.shape());
      params.push_back(&t);
    }
  });
  OptState<R> inner;
  inner.rule = opt.rule();
  for (const auto& p : pieces) {
    const Tensor& t = *params[p.leaf];
    inner.slots.push_back(opt.rule().init(Tensor::borrow(
        static_cast<std::byte*>(const_cast<void*>(t.raw_data())) + static_cast<std::size_t>(p.lo) * size_of(dtype),
        {p.hi - p.lo}, dtype, t.device())));
  }
  DistributedState<R> state(std::move(inner), std::move(reducer), options, std::move(pieces), std::move(shapes),
                            dtype);
  if (options.rescue_buddy) state.set_buddy_plan(detail::plan_buddies(opt.backend()));
  return state;
}

namespace detail {
// The end of a replicated step: the reduced gradients checked (skip_non_finite), the rule
// applied, the replicas compared every check_replicas_every steps. `paths` names the tensors.
template <OptimizerRule R, class M, class Paths>
void apply_reduced(DistributedState<R>& state, M& model, const std::vector<Tensor*>& params,
                   const std::vector<Tensor*>& reduced, const std::string& local_bad, Paths&& paths) {
  const DistributedOptions& o = state.options();
  auto& red = state.reducer();
  if (o.skip_non_finite) {
    const std::size_t bad = first_non_finite(reduced);
    if (bad < reduced.size()) {
      state.count_step(true);
      log_skipped_step(red.backend(), state.skipped_steps() + state.applied_steps(), local_bad, paths()[bad]);
      return;
    }
  }
  update_leaves(state.inner, params, reduced);
  state.count_step(false);
  if (o.check_replicas_every > 0 && state.applied_steps() % o.check_replicas_every == 0)
    check_replicas(red.backend(), std::tie(model, state.inner));
}
}  // namespace detail

/// Reduces the gradients across ranks (or, in an accumulate-only micro-step, only accumulates
/// them) and applies the wrapped rule. Collective.
template <OptimizerRule R, class M, class G>
void update(DistributedState<R>& state, M& model, G& grads,
            std::source_location loc = std::source_location::current()) {
  detail::CallSiteScope site(loc, "update");  // its collectives name this call too
  auto [params, gs] = detail::aligned_leaves("update", model, grads);
  auto& red = state.reducer();
  using Steps = detail::ReducerSteps;
  if (!Steps::bound_to(red, gs)) Steps::bind(red, gs);
  if (!Steps::final_micro_step(red)) {
    Steps::accumulate(red);
    return;
  }
  // Reliability (docs/reliability.md): non-finite gradients skip the step on every rank; the
  // replicas are compared every K steps.
  const DistributedOptions& o = state.options();
  std::string local_bad;
  if (o.skip_non_finite) local_bad = detail::describe_non_finite(gs, [&] { return detail::trainable_paths(grads); });
  const auto& reduced = Steps::reduce_bound(red);
  if (state.sharded()) {
    // Each rank holds the reduced values of its own shard only: whether to skip is agreed with
    // one small allreduce (a rank with a non-finite local gradient, or an owner that reduced
    // one, says so).
    if (o.skip_non_finite) {
      const std::size_t bad = detail::first_non_finite(reduced);
      const int any = allreduce(red.backend(), bad < reduced.size() ? 1 : 0, ReduceOp::max);
      if (any != 0) {
        state.count_step(true);
        detail::log_skipped_step(red.backend(), state.skipped_steps() + state.applied_steps(), local_bad,
                                 bad < reduced.size() ? detail::trainable_paths(grads)[bad] : std::string("(another rank's shard)"));
        return;
      }
    }
    OptState<R>& in = state.inner;
    ++in.step;
    // The rule on this rank's pieces, all at once (apply_many where the rule has it: on cuda
    // tensors one multi-tensor launch over every piece), then the all-gather.
    const auto& pieces = state.shard_pieces();
    const std::size_t es = size_of(params.empty() ? DType::f32 : params[0]->dtype());
    std::vector<Tensor> pp, gg;
    pp.reserve(pieces.size());
    gg.reserve(pieces.size());
    for (const auto& p : pieces) {
      auto piece = [&](Tensor& t) {
        return Tensor::borrow(static_cast<std::byte*>(t.raw_data()) + static_cast<std::size_t>(p.lo) * es, {p.hi - p.lo},
                              t.dtype(), t.device());
      };
      pp.push_back(piece(*params[p.leaf]));
      gg.push_back(piece(*reduced[p.leaf]));
    }
    std::vector<Tensor*> ppp, ggp;
    ppp.reserve(pieces.size());
    ggp.reserve(pieces.size());
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      ppp.push_back(&pp[k]);
      ggp.push_back(&gg[k]);
    }
    detail::apply_all(in.rule, in.slots, ppp, ggp, in.step);
    Steps::gather_shards(red, params);
    state.count_step(false);
    if (o.check_replicas_every > 0 && state.applied_steps() % o.check_replicas_every == 0)
      check_replicas(red.backend(), std::tie(model, state.inner.step));
    // rescue_buddy: the copy of this step, now complete on every rank (never mid-update), and
    // the step's last act: an update that throws before it leaves the previous step's copy.
    state.take_buddy_copy(params);
    return;
  }
  detail::apply_reduced(state, model, params, reduced, local_bad, [&] { return detail::trainable_paths(grads); });
}

/// Deterministic mode (DistributedOptions::deterministic): ends the step with what accumulate()
/// added on every rank (any number of micro-batches per rank, zero included): their exact sum,
/// divided by the total number of micro-batches (ReduceOp::avg), then the wrapped rule; the
/// same bits at any rank count. Collective. InvalidArgument outside deterministic mode.
template <OptimizerRule R, class M>
void apply_accumulated(DistributedState<R>& state, M& model,
                       std::source_location loc = std::source_location::current()) {
  detail::CallSiteScope site(loc, "apply_accumulated");
  std::vector<Tensor*> params = trainable_leaves(model);
  const auto& reduced = detail::ReducerSteps::reduce_accumulated(state.reducer());
  LOCKSTEP_CHECK_ARG(params.size() == reduced.size(), "apply_accumulated: the model has ", params.size(),
                     " trainable tensors, the optimizer state ", reduced.size());
  detail::apply_reduced(state, model, params, reduced, std::string(), [&] { return detail::trainable_paths(model); });
}

/// Like flat_zeros_like(x), but the host buffers come from backend.allocate_reduce_buffer: on
/// one machine MPIBackend's shared-memory path then reduces such gradients where they lie on
/// every rank, without copying them through its slots (about twice as fast for ResNet-50's
/// gradients, docs/performance/where-the-time-goes.md). Collective: every rank calls it for the same structure (the
/// host buffers' number, dtypes and sizes are compared; an InvalidArgument on every rank says
/// when they differ). Device
/// tensors get ordinary device buffers.
template <class X>
[[nodiscard]] Flat<X> flat_zeros_like(Backend& backend, const X& x, std::source_location loc = std::source_location::current()) {
  detail::FlatPlanner plan;
  for_each_tensor(x, [&](const Tensor& t) { plan.count(t); });
  // One allocation per host group: the ranks first compare how many there are and of what
  // (dtype and size), since a rank with one group more would otherwise make one collective more
  // than its peers, which no size comparison sees.
  if (backend.size() > 1) {
    std::int64_t count = 0;
    std::uint64_t h = 1469598103934665603ull;
    for (const auto& g : plan.groups) {
      if (!g.device.is_cpu()) continue;
      ++count;
      h = (h ^ static_cast<std::uint64_t>(g.dtype)) * 1099511628211ull;
      h = (h ^ static_cast<std::uint64_t>(g.numel)) * 1099511628211ull;
    }
    const auto hash = static_cast<std::int64_t>(h >> 2);  // non-negative, so it can be negated
    std::int64_t range[4] = {count, -count, hash, -hash};
    backend.allreduce(TensorView{range, 4, DType::i64, Device::cpu()}, ReduceOp::max, loc);
    LOCKSTEP_CHECK_ARG(range[0] == -range[1] && range[2] == -range[3],
                       "flat_zeros_like(backend, x): the ranks' structures differ (from ", -range[1], " to ",
                       range[0], " host buffers, by dtype and size; this rank: ", count,
                       "); every rank must pass the same structure");
  }
  plan.allocate([&](const detail::FlatPlanner::Group& g) {
    if (!g.device.is_cpu()) return Tensor::zeros({g.numel}, g.dtype, g.device);
    std::shared_ptr<void> mem = backend.allocate_reduce_buffer(static_cast<std::size_t>(g.numel) * size_of(g.dtype), loc);
    if (!mem) return Tensor::zeros({g.numel}, g.dtype, g.device);  // no elements
    void* data = mem.get();
    return Tensor::adopt(data, std::move(mem), {g.numel}, g.dtype, g.device);
  });
  X out{};
  auto make = [&](const Tensor& t) { return plan.take(t); };
  detail::build_like(x, out, make);
  return Flat<X>(std::move(plan.buffers), std::move(out));
}

/// Adds grads into the state's accumulator without communicating or stepping (PyTorch's
/// no_sync); the next update() reduces the accumulated sum with its own gradients.
template <OptimizerRule R, class G>
void accumulate(DistributedState<R>& state, G& grads) {
  auto gs = trainable_leaves(grads);
  auto& red = state.reducer();
  if (!detail::ReducerSteps::bound_to(red, gs)) detail::ReducerSteps::bind(red, gs);
  detail::ReducerSteps::accumulate(red);
}

}  // namespace lockstep
