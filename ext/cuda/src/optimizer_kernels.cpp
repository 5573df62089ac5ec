// Installs the CUDA kernels behind the optimizer rules of the training core (lockstep::SGD and
// lockstep::Adam call them for parameters on a cuda device). The coefficients are computed from
// the rule exactly as the CPU path computes them, so device and host updates are bitwise equal.
#include "lockstep/cuda.hpp"

#include "lockstep/train/rules.hpp"

#include <vector>

namespace lockstep::cuda::detail {

namespace {
class CudaOptimizerKernels final : public DeviceOptimizerKernels {
 public:
  void sgd(TensorView param, TensorView grad, TensorView buf, const SGD& r, std::int64_t step) override {
    const SgdSpan span{param, grad, buf};
    if (param.dtype == DType::f64)
      sgd_update({&span, 1}, math::sgd_coeffs<double>(r.lr, r.momentum, r.dampening, r.weight_decay,
                                                       r.nesterov, step));
    else
      sgd_update({&span, 1}, math::sgd_coeffs<float>(r.lr, r.momentum, r.dampening, r.weight_decay,
                                                      r.nesterov, step));
  }
  void adam(TensorView param, TensorView grad, TensorView m, TensorView v, const Adam& r,
            std::int64_t step) override {
    const AdamSpan span{param, grad, m, v};
    if (param.dtype == DType::f64)
      adam_update({&span, 1}, math::adam_coeffs<double>(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay,
                                                         r.decoupled_weight_decay, step));
    else
      adam_update({&span, 1}, math::adam_coeffs<float>(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay,
                                                        r.decoupled_weight_decay, step));
  }
  // Multi-tensor apply: every parameter of one device and dtype (the rule groups them) in ONE
  // launch of the kernel, over a chunk table.
  void sgd_many(std::span<const SGDViews> ps, const SGD& r, std::int64_t step) override {
    if (ps.empty()) return;
    std::vector<SgdSpan> spans;
    spans.reserve(ps.size());
    for (const auto& p : ps) spans.push_back({p.param, p.grad, p.momentum_buffer});
    if (ps[0].param.dtype == DType::f64)
      sgd_update(spans, math::sgd_coeffs<double>(r.lr, r.momentum, r.dampening, r.weight_decay, r.nesterov, step));
    else
      sgd_update(spans, math::sgd_coeffs<float>(r.lr, r.momentum, r.dampening, r.weight_decay, r.nesterov, step));
  }
  void adam_many(std::span<const AdamViews> ps, const Adam& r, std::int64_t step) override {
    if (ps.empty()) return;
    std::vector<AdamSpan> spans;
    spans.reserve(ps.size());
    for (const auto& p : ps) spans.push_back({p.param, p.grad, p.exp_avg, p.exp_avg_sq});
    if (ps[0].param.dtype == DType::f64)
      adam_update(spans, math::adam_coeffs<double>(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay,
                                                    r.decoupled_weight_decay, step));
    else
      adam_update(spans, math::adam_coeffs<float>(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay,
                                                   r.decoupled_weight_decay, step));
  }
};
}  // namespace

void register_optimizer_kernels() {
  static CudaOptimizerKernels* kernels = new CudaOptimizerKernels();  // never destroyed, as the runtime
  set_device_optimizer_kernels(kernels);
}

}  // namespace lockstep::cuda::detail
