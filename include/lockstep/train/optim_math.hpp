// The elementwise arithmetic of Lockstep's optimizer rules, written once for the CPU loops and
// the CUDA kernels (this header is also compiled by nvcc, where LOCKSTEP_HD becomes
// __host__ __device__). PyTorch semantics (torch.optim.SGD, torch.optim.Adam / AdamW,
// non-foreach, amsgrad=False, maximize=False).
//
// How to use it:
//   1. once per step, on the host, compute the per-step coefficients:
//        auto c = math::adam_coeffs<float>(lr, beta1, beta2, eps, weight_decay, decoupled, step);
//      (`step` is the 1-based number of the step being taken, as PyTorch's state['step'] after
//      its increment);
//   2. per element (a CUDA thread, or the CPU loop below), call the element function:
//        math::adam_element(p[i], g[i], m[i], v[i], c);
//      or, on the host, the span function math::adam_update(p, g, m, v, n, c), a tight loop that
//      GCC vectorises (with -fno-math-errno, for the sqrt).
// The element functions are templates over the element type T (float or double). For 16-bit
// storage, load into float registers, call the float version, store back.
//
// Only <cmath> and <cstdint> may be included here: nvcc compiles this header in device code.
// The signatures below are a contract with ext/cuda; do not change them, only add.
#pragma once

#include <cmath>
#include <cstdint>

#ifndef LOCKSTEP_HD
#if defined(__CUDACC__)
#define LOCKSTEP_HD __host__ __device__
#else
#define LOCKSTEP_HD
#endif
#endif

#ifndef LOCKSTEP_RESTRICT
#define LOCKSTEP_RESTRICT __restrict__
#endif

namespace lockstep::math {

/// Square root usable in host and device code (sqrtf for float, sqrt for double).
LOCKSTEP_HD inline float hd_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);
#else
  return std::sqrt(x);
#endif
}
LOCKSTEP_HD inline double hd_sqrt(double x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// ---------------------------------------------------------------------------------------------
// SGD (torch.optim.SGD):
//   g <- g + weight_decay * p                        (if weight_decay != 0)
//   if momentum != 0:
//     buf <- g                                        (first step)
//     buf <- momentum * buf + (1 - dampening) * g     (later steps)
//     g   <- g + momentum * buf   (nesterov)  or  g <- buf
//   p <- p - lr * g
// ---------------------------------------------------------------------------------------------

/// Per-step SGD coefficients, in the element type T.
template <class T>
struct SGDCoeffs {
  T lr = T(0);
  T momentum = T(0);
  T one_minus_dampening = T(1);
  T weight_decay = T(0);
  bool nesterov = false;
  bool first_step = true;  ///< the momentum buffer is initialised to g (no dampening), as PyTorch
};

/// Coefficients for SGD step number `step` (1-based; step 1 initialises the momentum buffer).
template <class T>
inline SGDCoeffs<T> sgd_coeffs(double lr, double momentum, double dampening, double weight_decay,
                               bool nesterov, std::int64_t step) {
  SGDCoeffs<T> c;
  c.lr = static_cast<T>(lr);
  c.momentum = static_cast<T>(momentum);
  c.one_minus_dampening = static_cast<T>(1.0 - dampening);
  c.weight_decay = static_cast<T>(weight_decay);
  c.nesterov = nesterov;
  c.first_step = step <= 1;
  return c;
}

/// One SGD update of one element. `buf` (momentum buffer) is untouched when momentum == 0.
template <class T>
LOCKSTEP_HD inline void sgd_element(T& p, T g, T& buf, const SGDCoeffs<T>& c) {
  if (c.weight_decay != T(0)) g = g + c.weight_decay * p;
  if (c.momentum != T(0)) {
    buf = c.first_step ? g : c.momentum * buf + c.one_minus_dampening * g;
    g = c.nesterov ? g + c.momentum * buf : buf;
  }
  p = p - c.lr * g;
}

/// SGD over n contiguous host elements; buf may be null when momentum == 0.
template <class T>
inline void sgd_update(T* LOCKSTEP_RESTRICT p, const T* LOCKSTEP_RESTRICT g,
                       T* LOCKSTEP_RESTRICT buf, std::int64_t n, const SGDCoeffs<T>& coeffs) {
  // A local copy of the coefficients lets GCC (-O3) unswitch the loop on the uniform branches
  // of sgd_element, so that each version vectorises; checked with -fopt-info-vec.
  const SGDCoeffs<T> c = coeffs;
  if (c.momentum == T(0)) {
    // No momentum buffer to touch (buf may be null).
    for (std::int64_t i = 0; i < n; ++i) {
      T unused = T(0);
      sgd_element(p[i], g[i], unused, c);
    }
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) sgd_element(p[i], g[i], buf[i], c);
}

// ---------------------------------------------------------------------------------------------
// Adam / AdamW (torch.optim.Adam, torch.optim.AdamW; amsgrad=False):
//   AdamW (decoupled):  p <- p * (1 - lr * weight_decay)
//   Adam  (coupled):    g <- g + weight_decay * p
//   m <- m + (1 - beta1) * (g - m)                   (torch's lerp_)
//   v <- beta2 * v + (1 - beta2) * g * g
//   step_size = lr / (1 - beta1^t),  bc2_sqrt = sqrt(1 - beta2^t)
//   p <- p - step_size * m / (sqrt(v) / bc2_sqrt + eps)
// ---------------------------------------------------------------------------------------------

/// Per-step Adam coefficients, in the element type T.
template <class T>
struct AdamCoeffs {
  T one_minus_beta1 = T(0.1);
  T beta2 = T(0.999);
  T one_minus_beta2 = T(0.001);
  T eps = T(1e-8);
  T weight_decay = T(0);      ///< coupled (L2) decay; zero for AdamW
  T decay_factor = T(1);      ///< decoupled decay: 1 - lr * weight_decay; one for Adam
  T step_size = T(0);         ///< lr / (1 - beta1^t)
  T bias_correction2_sqrt = T(1);  ///< sqrt(1 - beta2^t)
};

/// Coefficients for Adam step number `step` (1-based). decoupled = AdamW.
template <class T>
inline AdamCoeffs<T> adam_coeffs(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, bool decoupled, std::int64_t step) {
  AdamCoeffs<T> c;
  const double t = static_cast<double>(step < 1 ? 1 : step);
  c.one_minus_beta1 = static_cast<T>(1.0 - beta1);
  c.beta2 = static_cast<T>(beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - beta2);
  c.eps = static_cast<T>(eps);
  c.weight_decay = decoupled ? T(0) : static_cast<T>(weight_decay);
  c.decay_factor = decoupled ? static_cast<T>(1.0 - lr * weight_decay) : T(1);
  c.step_size = static_cast<T>(lr / (1.0 - std::pow(beta1, t)));
  c.bias_correction2_sqrt = static_cast<T>(std::sqrt(1.0 - std::pow(beta2, t)));
  return c;
}

/// One Adam/AdamW update of one element; m and v are the first and second moment.
template <class T>
LOCKSTEP_HD inline void adam_element(T& p, T g, T& m, T& v, const AdamCoeffs<T>& c) {
  T pi = p * c.decay_factor;
  if (c.weight_decay != T(0)) g = g + c.weight_decay * p;
  T mi = m + c.one_minus_beta1 * (g - m);
  T vi = c.beta2 * v + c.one_minus_beta2 * g * g;
  T denom = hd_sqrt(vi) / c.bias_correction2_sqrt + c.eps;
  m = mi;
  v = vi;
  p = pi - c.step_size * (mi / denom);
}

/// Adam/AdamW over n contiguous host elements.
template <class T>
inline void adam_update(T* LOCKSTEP_RESTRICT p, const T* LOCKSTEP_RESTRICT g,
                        T* LOCKSTEP_RESTRICT m, T* LOCKSTEP_RESTRICT v, std::int64_t n,
                        const AdamCoeffs<T>& coeffs) {
  // Local copy: see sgd_update.
  const AdamCoeffs<T> c = coeffs;
  for (std::int64_t i = 0; i < n; ++i) adam_element(p[i], g[i], m[i], v[i], c);
}

}  // namespace lockstep::math
