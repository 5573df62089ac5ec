// CPU implementations of the built-in optimizer rules: tight loops over contiguous spans (the
// loops in optim_math.hpp, vectorised by GCC with -fno-math-errno); device tensors go to the
// kernels the CUDA extension installs.
#include "lockstep/train/rules.hpp"

#include <atomic>
#include <initializer_list>
#include <utility>
#include <sstream>

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
}  // namespace

void set_device_optimizer_kernels(DeviceOptimizerKernels* k) noexcept { g_device_kernels.store(k); }
DeviceOptimizerKernels* find_device_optimizer_kernels() noexcept { return g_device_kernels.load(); }

SGD::Slot SGD::init(const Tensor& param) const {
  if (momentum == 0.0f) return Slot{Tensor::zeros({0}, param.dtype(), param.device())};
  return Slot{Tensor::zeros(param.shape(), param.dtype(), param.device())};
}

void SGD::apply(Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) const {
  check_pair("SGD", param, grad);
  if (momentum != 0.0f)
    LOCKSTEP_CHECK_ARG(slot.momentum_buffer.numel() == param.numel(),
                       "SGD: momentum buffer has ", slot.momentum_buffer.numel(),
                       " elements, parameter ", param.numel(),
                       " (momentum was 0 when the state was set up?)");
  if (momentum != 0.0f)
    check_disjoint("SGD", {{"parameter", &param}, {"gradient", &grad}, {"momentum buffer", &slot.momentum_buffer}});
  else
    check_disjoint("SGD", {{"parameter", &param}, {"gradient", &grad}});
  if (!param.device().is_cpu()) {
    device_kernels("SGD").sgd(param.view(), grad.view(), slot.momentum_buffer.view(), *this, step);
    return;
  }
  const std::int64_t n = param.numel();
  if (param.dtype() == DType::f32) {
    auto c = math::sgd_coeffs<float>(lr, momentum, dampening, weight_decay, nesterov, step);
    float* buf = momentum != 0.0f ? slot.momentum_buffer.data<float>() : nullptr;
    math::sgd_update(param.data<float>(), grad.data<float>(), buf, n, c);
  } else {
    auto c = math::sgd_coeffs<double>(lr, momentum, dampening, weight_decay, nesterov, step);
    double* buf = momentum != 0.0f ? slot.momentum_buffer.data<double>() : nullptr;
    math::sgd_update(param.data<double>(), grad.data<double>(), buf, n, c);
  }
}

Adam::Slot Adam::init(const Tensor& param) const {
  return Slot{Tensor::zeros(param.shape(), param.dtype(), param.device()),
              Tensor::zeros(param.shape(), param.dtype(), param.device())};
}

void Adam::apply(Slot& slot, Tensor& param, const Tensor& grad, std::int64_t step) const {
  check_pair("Adam", param, grad);
  LOCKSTEP_CHECK_ARG(slot.exp_avg.numel() == param.numel() && slot.exp_avg_sq.numel() == param.numel(),
                     "Adam: moments have ", slot.exp_avg.numel(), " and ", slot.exp_avg_sq.numel(),
                     " elements, parameter ", param.numel());
  check_disjoint("Adam", {{"parameter", &param},
                          {"gradient", &grad},
                          {"first moment (exp_avg)", &slot.exp_avg},
                          {"second moment (exp_avg_sq)", &slot.exp_avg_sq}});
  if (!param.device().is_cpu()) {
    device_kernels("Adam").adam(param.view(), grad.view(), slot.exp_avg.view(),
                                slot.exp_avg_sq.view(), *this, step);
    return;
  }
  const std::int64_t n = param.numel();
  if (param.dtype() == DType::f32) {
    auto c = math::adam_coeffs<float>(lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, step);
    math::adam_update(param.data<float>(), grad.data<float>(), slot.exp_avg.data<float>(),
                      slot.exp_avg_sq.data<float>(), n, c);
  } else {
    auto c = math::adam_coeffs<double>(lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, step);
    math::adam_update(param.data<double>(), grad.data<double>(), slot.exp_avg.data<double>(),
                      slot.exp_avg_sq.data<double>(), n, c);
  }
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
