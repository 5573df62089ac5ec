// CPU implementations of the built-in optimizer rules: tight loops over contiguous spans (the
// loops in optim_math.hpp, vectorised by GCC with -fno-math-errno); device tensors go to the
// kernels the CUDA extension installs.
#include "lockstep/train/rules.hpp"

#include <atomic>
#include <initializer_list>
#include <utility>
#include <sstream>
#include <vector>

namespace lockstep {

namespace {
std::atomic<DeviceOptimizerKernels*> g_device_kernels{nullptr};

DeviceOptimizerKernels& device_kernels(const char* rule) {
  auto* k = g_device_kernels.load();
  if (k == nullptr)
    throw NotCompiled(detail::concat(rule, ": a parameter lives on a CUDA device, but no device "
                                           "optimizer kernels are installed (build with "
                                           "-DLOCKSTEP_WITH_CUDA=ON and link lockstep::cuda)"));
  return *k;
}

void check_pair(const char* rule, const Tensor& p, const Tensor& g) {
  LOCKSTEP_CHECK_ARG(p.numel() == g.numel() && p.dtype() == g.dtype() && p.device() == g.device(),
                     rule, ": parameter (", name(p.dtype()), " ", to_string(p.shape()), " on ",
                     to_string(p.device()), ") and gradient (", name(g.dtype()), " ",
                     to_string(g.shape()), " on ", to_string(g.device()), ") differ");
  LOCKSTEP_CHECK_ARG(p.dtype() == DType::f32 || p.dtype() == DType::f64, rule,
                     ": only f32 and f64 parameters are supported, got ", name(p.dtype()));
}

// The update loops take their pointers as restrict (optim_math.hpp), so parameter, gradient
// and state buffers must not share memory: that would be undefined behaviour, and a partial
// overlap gives different results once the loop is vectorised.
void check_disjoint(const char* rule, std::initializer_list<std::pair<const char*, const Tensor*>> ts) {
  for (auto a = ts.begin(); a != ts.end(); ++a)
    for (auto b = a + 1; b != ts.end(); ++b)
      LOCKSTEP_CHECK_ARG(!memory_overlaps(a->second->view(), b->second->view()), rule, ": the ",
                         a->first, " and the ", b->first, " overlap in memory");
}

// The checks of one SGD parameter (apply and apply_many alike).
void sgd_check(const SGD& r, const SGD::Slot& slot, const Tensor& param, const Tensor& grad) {
  check_pair("SGD", param, grad);
  if (r.momentum != 0.0f)
    LOCKSTEP_CHECK_ARG(slot.momentum_buffer.numel() == param.numel(),
                       "SGD: momentum buffer has ", slot.momentum_buffer.numel(),
                       " elements, parameter ", param.numel(),
                       " (momentum was 0 when the state was set up?)");
  if (r.momentum != 0.0f)
    check_disjoint("SGD", {{"parameter", &param}, {"gradient", &grad}, {"momentum buffer", &slot.momentum_buffer}});
  else
    check_disjoint("SGD", {{"parameter", &param}, {"gradient", &grad}});
}

void sgd_host(const SGD& r, SGD::Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) {
  const std::int64_t n = param.numel();
  if (param.dtype() == DType::f32) {
    auto c = math::sgd_coeffs<float>(r.lr, r.momentum, r.dampening, r.weight_decay, r.nesterov, step);
    float* buf = r.momentum != 0.0f ? slot.momentum_buffer.data<float>() : nullptr;
    math::sgd_update(param.data<float>(), grad.data<float>(), buf, n, c);
  } else {
    auto c = math::sgd_coeffs<double>(r.lr, r.momentum, r.dampening, r.weight_decay, r.nesterov, step);
    double* buf = r.momentum != 0.0f ? slot.momentum_buffer.data<double>() : nullptr;
    math::sgd_update(param.data<double>(), grad.data<double>(), buf, n, c);
  }
}

void adam_check(const Adam::Slot& slot, const Tensor& param, const Tensor& grad) {
  check_pair("Adam", param, grad);
  LOCKSTEP_CHECK_ARG(slot.exp_avg.numel() == param.numel() && slot.exp_avg_sq.numel() == param.numel(),
                     "Adam: moments have ", slot.exp_avg.numel(), " and ", slot.exp_avg_sq.numel(),
                     " elements, parameter ", param.numel());
  check_disjoint("Adam", {{"parameter", &param},
                          {"gradient", &grad},
                          {"first moment (exp_avg)", &slot.exp_avg},
                          {"second moment (exp_avg_sq)", &slot.exp_avg_sq}});
}

void adam_host(const Adam& r, Adam::Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) {
  const std::int64_t n = param.numel();
  if (param.dtype() == DType::f32) {
    auto c = math::adam_coeffs<float>(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay, r.decoupled_weight_decay, step);
    math::adam_update(param.data<float>(), grad.data<float>(), slot.exp_avg.data<float>(),
                      slot.exp_avg_sq.data<float>(), n, c);
  } else {
    auto c = math::adam_coeffs<double>(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay, r.decoupled_weight_decay, step);
    math::adam_update(param.data<double>(), grad.data<double>(), slot.exp_avg.data<double>(),
                      slot.exp_avg_sq.data<double>(), n, c);
  }
}

// Cuda parameters grouped by device and dtype, in the order they come (one launch per group).
template <class Views>
struct DeviceGroups {
  struct Group {
    int device;
    DType dtype;
    std::vector<Views> views;
  };
  std::vector<Group> groups;
  void add(const Tensor& param, Views v) {
    for (auto& g : groups)
      if (g.device == param.device().index && g.dtype == param.dtype()) {
        g.views.push_back(v);
        return;
      }
    groups.push_back({param.device().index, param.dtype(), {v}});
  }
};

void check_lists(const char* rule, std::size_t slots, std::size_t params, std::size_t grads) {
  LOCKSTEP_CHECK_ARG(slots == params && grads == params, rule, ": ", slots, " slots, ", params,
                     " parameters and ", grads, " gradients");
}
}  // namespace

void DeviceOptimizerKernels::sgd_many(std::span<const SGDViews> params, const SGD& rule, std::int64_t step) {
  for (const SGDViews& v : params) sgd(v.param, v.grad, v.momentum_buffer, rule, step);
}
void DeviceOptimizerKernels::adam_many(std::span<const AdamViews> params, const Adam& rule, std::int64_t step) {
  for (const AdamViews& v : params) adam(v.param, v.grad, v.exp_avg, v.exp_avg_sq, rule, step);
}

void set_device_optimizer_kernels(DeviceOptimizerKernels* k) noexcept { g_device_kernels.store(k); }
DeviceOptimizerKernels* find_device_optimizer_kernels() noexcept { return g_device_kernels.load(); }

SGD::Slot SGD::init(const Tensor& param) const {
  if (momentum == 0.0f) return Slot{Tensor::zeros({0}, param.dtype(), param.device())};
  return Slot{Tensor::zeros(param.shape(), param.dtype(), param.device())};
}

void SGD::apply(Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) const {
  sgd_check(*this, slot, param, grad);
  if (!param.device().is_cpu()) {
    device_kernels("SGD").sgd(param.view(), grad.view(), slot.momentum_buffer.view(), *this, step);
    return;
  }
  sgd_host(*this, slot, param, grad, step);
}

void SGD::apply_many(std::vector<Slot>& slots, const std::vector<Tensor*>& params,
                     const std::vector<Tensor*>& grads, std::int64_t step) const {
  check_lists("SGD", slots.size(), params.size(), grads.size());
  bool any_device = false;
  for (std::size_t i = 0; i < params.size(); ++i) {
    sgd_check(*this, slots[i], *params[i], *grads[i]);
    any_device = any_device || !params[i]->device().is_cpu();
  }
  DeviceOptimizerKernels* k = any_device ? &device_kernels("SGD") : nullptr;
  DeviceGroups<SGDViews> dev;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i]->device().is_cpu())
      sgd_host(*this, slots[i], *params[i], *grads[i], step);
    else
      dev.add(*params[i], {params[i]->view(), grads[i]->view(), slots[i].momentum_buffer.view()});
  }
  for (const auto& g : dev.groups) k->sgd_many(g.views, *this, step);
}

Adam::Slot Adam::init(const Tensor& param) const {
  return Slot{Tensor::zeros(param.shape(), param.dtype(), param.device()),
              Tensor::zeros(param.shape(), param.dtype(), param.device())};
}

void Adam::apply(Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) const {
  adam_check(slot, param, grad);
  if (!param.device().is_cpu()) {
    device_kernels("Adam").adam(param.view(), grad.view(), slot.exp_avg.view(),
                                slot.exp_avg_sq.view(), *this, step);
    return;
  }
  adam_host(*this, slot, param, grad, step);
}

void Adam::apply_many(std::vector<Slot>& slots, const std::vector<Tensor*>& params,
                      const std::vector<Tensor*>& grads, std::int64_t step) const {
  check_lists("Adam", slots.size(), params.size(), grads.size());
  bool any_device = false;
  for (std::size_t i = 0; i < params.size(); ++i) {
    adam_check(slots[i], *params[i], *grads[i]);
    any_device = any_device || !params[i]->device().is_cpu();
  }
  DeviceOptimizerKernels* k = any_device ? &device_kernels("Adam") : nullptr;
  DeviceGroups<AdamViews> dev;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i]->device().is_cpu())
      adam_host(*this, slots[i], *params[i], *grads[i], step);
    else
      dev.add(*params[i], {params[i]->view(), grads[i]->view(), slots[i].exp_avg.view(), slots[i].exp_avg_sq.view()});
  }
  for (const auto& g : dev.groups) k->adam_many(g.views, *this, step);
}

namespace detail {
void check_grads_match(const char* what, const std::vector<Tensor*>& params,
                       const std::vector<Tensor*>& grads,
                       const std::vector<std::string>& param_paths,
                       const std::vector<std::string>& grad_paths) {
  auto shown = [](const std::string& p) { return p.empty() ? std::string("<root>") : p; };
  const std::size_t n = std::min(params.size(), grads.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (params[i]->shape() != grads[i]->shape() || params[i]->dtype() != grads[i]->dtype())
      throw_invalid(concat(what, ": gradient '", shown(grad_paths.at(i)), "' is ",
                           name(grads[i]->dtype()), " ", to_string(grads[i]->shape()),
                           " but parameter '", shown(param_paths.at(i)), "' is ",
                           name(params[i]->dtype()), " ", to_string(params[i]->shape())));
    if (memory_overlaps(params[i]->view(), grads[i]->view()))
      throw_invalid(concat(what, ": gradient '", shown(grad_paths.at(i)), "' shares memory with parameter '",
                           shown(param_paths.at(i)), "' (the gradients passed are the parameters?)"));
  }
  throw_invalid(concat(what, ": the model has ", params.size(),
                       " trainable tensors but the gradients have ", grads.size()));
}
}  // namespace detail

}  // namespace lockstep
