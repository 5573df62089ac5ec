// Compiled (not run) by a test with -fopt-info-vec: the span loops of optim_math.hpp must be
// reported as vectorised with the flags the core uses (-O3 -fno-math-errno); one compilation
// per rule (-DPROBE_ADAM, -DPROBE_SGD).
#include "lockstep/train/optim_math.hpp"

namespace m = lockstep::math;

#ifdef PROBE_ADAM
void adam_f32(float* p, const float* g, float* a, float* b, long n, const m::AdamCoeffs<float>& c) {
  m::adam_update(p, g, a, b, n, c);
}
#endif
#ifdef PROBE_SGD
void sgd_f32(float* p, const float* g, float* buf, long n, const m::SGDCoeffs<float>& c) {
  m::sgd_update(p, g, buf, n, c);
}
#endif
