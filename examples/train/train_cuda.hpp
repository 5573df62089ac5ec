// The train example's forward and backward on a GPU (cuBLAS plus four small kernels), used with
// --device cuda in builds with LOCKSTEP_WITH_CUDA. Plain C++: no CUDA header leaks out.
#pragma once

namespace train_cuda {

/// Computes the gradients of the mean squared error of Dense(1 => hidden, tanh), Dense(hidden => 1)
/// over n samples on the current CUDA device. Parameters and gradients are device pointers
/// (w1 hidden x 1, b1 hidden, w2 1 x hidden, b2 1); x and y are n host floats. Every reduction
/// has a fixed order, so equal inputs give bitwise equal gradients (resume stays bitwise).
class Trainer {
 public:
  explicit Trainer(int hidden);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Writes the gradients and returns the sum of squared errors; waits for the GPU.
  double forward_backward(const float* w1, const float* b1, const float* w2, const float* b2,
                          float* gw1, float* gb1, float* gw2, float* gb2, const float* x,
                          const float* y, int n);

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace train_cuda
