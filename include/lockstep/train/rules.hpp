// Optimizer rules (SGD, Adam/AdamW), the rule concept a user's own rule satisfies, and the
// generic setup/update that drive any rule over a traversable model. The rules know nothing of
// backends; DistributedOptimizer (distributed_optimizer.hpp) wraps any of them.
//
// THE RULE CONCEPT (lockstep::OptimizerRule). A rule is a copyable type R with
//   - R::Slot                 the per-parameter state (traversable: e.g. a struct of Tensors with
//                             LOCKSTEP_FIELDS, or std::tuple<>{} if the rule keeps none);
//   - Slot init(const Tensor& param) const
//                             makes the state of one parameter (usually zeros like param);
//   - void apply(Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) const
//                             applies one update to one parameter; `step` is the 1-based number
//                             of the step being taken (1 on the first update).
// setup(rule, model) calls init once per trainable tensor (floating-point tensors; integer
// tensors and scalars are not trained); update(state, model, grads) increments state.step and
// calls apply once per trainable tensor. A rule may also define
//   void apply_many(std::vector<Slot>& slots, const std::vector<Tensor*>& params,
//                   const std::vector<Tensor*>& grads, std::int64_t step) const
//                             one update of every trainable tensor at once (aligned lists);
// update() and DistributedOptimizer then call it instead of apply() per tensor. SGD and Adam
// do: their cuda tensors go to one multi-tensor kernel launch per device and dtype.
// Example (Lion, written by a user):
//
//   struct Lion {
//     float lr = 1e-4f, beta1 = 0.9f, beta2 = 0.99f, weight_decay = 0.0f;
//     struct Slot { ls::Tensor m; };
//     Slot init(const ls::Tensor& p) const { return {ls::Tensor::zeros(p.shape(), p.dtype())}; }
//     void apply(Slot& s, ls::Tensor& p, const ls::Tensor& g, std::int64_t) const {
//       auto pp = p.span<float>(); auto gg = g.span<float>(); auto m = s.m.span<float>();
//       for (std::size_t i = 0; i < pp.size(); ++i) { ... }     // a tight loop over spans
//     }
//   };
//   LOCKSTEP_FIELDS(Lion::Slot, m)
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/errors.hpp"
#include "lockstep/train/optim_math.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/core/traverse.hpp"

namespace lockstep {

/// A rule usable by setup/update and DistributedOptimizer (see the header comment).
template <class R>
concept OptimizerRule =
    std::copy_constructible<R> && requires { typename R::Slot; } &&
    requires(const R& rule, const Tensor& param) {
      { rule.init(param) } -> std::convertible_to<typename R::Slot>;
    } &&
    requires(const R& rule, typename R::Slot& slot, Tensor& param, const Tensor& grad,
             std::int64_t step) { rule.apply(slot, param, grad, step); } &&
    Traversable<typename R::Slot>;

/// Stochastic gradient descent with PyTorch's semantics (torch.optim.SGD).
struct SGD {
  float lr = 1e-3f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  /// Every element is updated from that element alone (DistributedOptions::shard_optimizer_state
  /// may split tensors between ranks).
  static constexpr bool elementwise = true;

  /// Momentum buffer (empty when momentum == 0).
  struct Slot {
    Tensor momentum_buffer;
  };
  /// Zeros like param when momentum != 0, else an empty tensor.
  Slot init(const Tensor& param) const;
  /// One SGD step on one parameter (f32 or f64; device tensors need the CUDA extension).
  void apply(Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) const;
  /// One SGD step on every parameter: every tensor is checked first (nothing changes if one is
  /// refused); host tensors one after another, cuda tensors in one kernel launch per device and
  /// dtype (DeviceOptimizerKernels::sgd_many).
  void apply_many(std::vector<Slot>& slots, const std::vector<Tensor*>& params,
                  const std::vector<Tensor*>& grads, std::int64_t step) const;
};
LOCKSTEP_FIELDS(SGD::Slot, momentum_buffer)

/// Adam with PyTorch's semantics (torch.optim.Adam, bias correction included);
/// decoupled_weight_decay = true gives AdamW (torch.optim.AdamW).
struct Adam {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = false;
  /// Elementwise, as SGD.
  static constexpr bool elementwise = true;

  /// First and second moments.
  struct Slot {
    Tensor exp_avg;
    Tensor exp_avg_sq;
  };
  /// Zero moments like param.
  Slot init(const Tensor& param) const;
  /// One Adam/AdamW step on one parameter (f32 or f64; device tensors need the CUDA extension).
  void apply(Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) const;
  /// One Adam/AdamW step on every parameter, as SGD::apply_many (DeviceOptimizerKernels::adam_many).
  void apply_many(std::vector<Slot>& slots, const std::vector<Tensor*>& params,
                  const std::vector<Tensor*>& grads, std::int64_t step) const;
};
LOCKSTEP_FIELDS(Adam::Slot, exp_avg, exp_avg_sq)

/// AdamW: Adam with decoupled weight decay (PyTorch's default weight_decay 1e-2).
[[nodiscard]] inline Adam AdamW(float lr = 1e-3f, float weight_decay = 1e-2f) {
  return Adam{.lr = lr, .weight_decay = weight_decay, .decoupled_weight_decay = true};
}

/// Optimizer state of rule R for one model: the step count and one Slot per trainable tensor
/// (in traversal order). Traversable (fields "step" and "slots"): synchronize and checkpoints
/// walk it like a model. `rule` holds the hyperparameters (change rule.lr for a schedule); it is
/// not traversed. Move-only when the slots hold tensors. A moved-from state keeps its rule and
/// has step 0 and no slots (update on it is an InvalidArgument); self-move keeps it as it is.
template <OptimizerRule R>
struct OptState {
  R rule{};
  std::int64_t step = 0;
  std::vector<typename R::Slot> slots;

  OptState() = default;
  OptState(R r, std::int64_t s = 0, std::vector<typename R::Slot> sl = {})
      : rule(std::move(r)), step(s), slots(std::move(sl)) {}
  OptState(const OptState&) = default;  // deleted when the slots are move-only
  OptState& operator=(const OptState&) = default;
  OptState(OptState&& other) noexcept(std::is_nothrow_copy_constructible_v<R>)
      : rule(other.rule), step(other.step), slots(std::move(other.slots)) {
    other.step = 0;
    other.slots.clear();
  }
  OptState& operator=(OptState&& other) noexcept(std::is_nothrow_copy_assignable_v<R>) {
    if (this != &other) {
      rule = other.rule;
      step = other.step;
      slots = std::move(other.slots);
      other.step = 0;
      other.slots.clear();
    }
    return *this;
  }
};

template <class R, class V>
void lockstep_visit_fields(OptState<R>& s, V&& v) {
  v("step", s.step);
  v("slots", s.slots);
}
template <class R, class V>
void lockstep_visit_fields(const OptState<R>& s, V&& v) {
  v("step", s.step);
  v("slots", s.slots);
}

/// True for the tensors an optimizer trains: floating-point dtypes.
inline bool is_trainable(const Tensor& t) noexcept { return is_floating(t.dtype()); }

/// Pointers to the trainable tensors of x, in traversal order.
template <class X>
[[nodiscard]] std::vector<Tensor*> trainable_leaves(X& x) {
  std::vector<Tensor*> out;
  for_each_tensor(x, [&](auto& t) {
    if (is_trainable(t)) out.push_back(const_cast<Tensor*>(&t));
  });
  return out;
}

namespace detail {
/// One step of `rule` on every tensor: rule.apply_many where the rule has it, else rule.apply
/// per tensor. The lists are aligned (slots[i] belongs to params[i] and grads[i]).
template <class R>
void apply_all(const R& rule, std::vector<typename R::Slot>& slots, const std::vector<Tensor*>& params,
               const std::vector<Tensor*>& grads, std::int64_t step) {
  if constexpr (requires { rule.apply_many(slots, params, grads, step); }) {
    rule.apply_many(slots, params, grads, step);
  } else {
    for (std::size_t i = 0; i < params.size(); ++i) rule.apply(slots[i], *params[i], *grads[i], step);
  }
}

/// Checks that grads has the model's trainable tensors (count, shape, dtype, no gradient sharing
/// memory with its parameter); throws InvalidArgument naming the first bad leaf. `what`
/// prefixes the message.
void check_grads_match(const char* what, const std::vector<Tensor*>& params,
                       const std::vector<Tensor*>& grads,
                       const std::vector<std::string>& param_paths,
                       const std::vector<std::string>& grad_paths);

template <class X>
[[nodiscard]] std::vector<std::string> trainable_paths(const X& x) {
  std::vector<std::string> out;
  for_each_leaf_with_path(x, [&](const std::string& p, auto& leaf) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(leaf)>, Tensor>)
      if (is_trainable(leaf)) out.push_back(p);
  });
  return out;
}

/// Validates and returns the trainable tensors of model and grads, aligned.
template <class M, class G>
std::pair<std::vector<Tensor*>, std::vector<Tensor*>> aligned_leaves(const char* what, M& model,
                                                                     G& grads) {
  auto params = trainable_leaves(model);
  auto gs = trainable_leaves(grads);
  bool ok = params.size() == gs.size();
  for (std::size_t i = 0; ok && i < params.size(); ++i)
    ok = params[i]->shape() == gs[i]->shape() && params[i]->dtype() == gs[i]->dtype() &&
         !memory_overlaps(params[i]->view(), gs[i]->view());
  if (!ok) check_grads_match(what, params, gs, trainable_paths(model), trainable_paths(grads));
  return {std::move(params), std::move(gs)};
}
}  // namespace detail

/// Optimizer state of `rule` for `model`: step 0 and rule.init(t) for every trainable tensor.
template <OptimizerRule R, class M>
[[nodiscard]] OptState<R> setup(const R& rule, const M& model) {
  OptState<R> st;
  st.rule = rule;
  for_each_tensor(model, [&](const Tensor& t) {
    if (is_trainable(t)) st.slots.push_back(rule.init(t));
  });
  return st;
}

/// Applies one step of state.rule to every trainable tensor of model, with the matching tensor
/// of grads (grads has the model's structure). Increments state.step first.
template <OptimizerRule R, class M, class G>
void update(OptState<R>& state, M& model, const G& grads) {
  auto [params, gs] = detail::aligned_leaves("update", model, grads);
  LOCKSTEP_CHECK_ARG(params.size() == state.slots.size(), "update: the optimizer state has ",
                     state.slots.size(), " slots but the model has ", params.size(),
                     " trainable tensors (was the state set up for this model, or moved from?)");
  ++state.step;
  detail::apply_all(state.rule, state.slots, params, gs, state.step);
}

/// Update from already-aligned tensor lists (used by DistributedOptimizer).
template <OptimizerRule R>
void update_leaves(OptState<R>& state, const std::vector<Tensor*>& params,
                   const std::vector<Tensor*>& grads) {
  LOCKSTEP_CHECK_ARG(params.size() == state.slots.size() && grads.size() == params.size(),
                     "update: the optimizer state has ", state.slots.size(), " slots but the model has ",
                     params.size(), " trainable tensors and grads ", grads.size(),
                     " (was the state set up for this model, or moved from?)");
  ++state.step;
  detail::apply_all(state.rule, state.slots, params, grads, state.step);
}

/// The buffers of one parameter in a batched SGD step (momentum_buffer empty without momentum).
struct SGDViews {
  TensorView param, grad, momentum_buffer;
};
/// The buffers of one parameter in a batched Adam/AdamW step.
struct AdamViews {
  TensorView param, grad, exp_avg, exp_avg_sq;
};

/// Kernels for device (CUDA) tensors, installed by the CUDA extension; the CPU rules call them
/// for tensors whose device is not the CPU. Implementations use lockstep/optim_math.hpp.
/// Asynchronous on the device's current stream.
class DeviceOptimizerKernels {
 public:
  virtual ~DeviceOptimizerKernels() = default;
  /// One SGD step; buf is empty when rule.momentum == 0.
  virtual void sgd(TensorView param, TensorView grad, TensorView buf, const SGD& rule,
                   std::int64_t step) = 0;
  /// One Adam/AdamW step.
  virtual void adam(TensorView param, TensorView grad, TensorView exp_avg, TensorView exp_avg_sq,
                    const Adam& rule, std::int64_t step) = 0;
  /// One SGD step on many parameters of one device and dtype (checked by the rule), meant as
  /// one launch (multi-tensor apply). The default calls sgd() per parameter.
  virtual void sgd_many(std::span<const SGDViews> params, const SGD& rule, std::int64_t step);
  /// One Adam/AdamW step on many parameters of one device and dtype, as sgd_many.
  virtual void adam_many(std::span<const AdamViews> params, const Adam& rule, std::int64_t step);
};
/// Installs the device kernels (nullptr uninstalls).
void set_device_optimizer_kernels(DeviceOptimizerKernels* k) noexcept;
/// The installed device kernels, or nullptr.
DeviceOptimizerKernels* find_device_optimizer_kernels() noexcept;

}  // namespace lockstep
