// cuBLAS forward and backward of the train example (see train_cuda.hpp). Matrices are
// column-major with one sample per column: H is hidden x n, so that the row-major [out, in]
// weights of the CPU path are used as they are.
#include "train_cuda.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace train_cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("train (cuda): ") + what + ": " + cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("train (cuda): ") + what + " failed with cuBLAS status " + std::to_string(static_cast<int>(s)));
}

constexpr int kBlock = 256;

__global__ void bias_tanh(float* h, const float* b1, int hidden, long total) {
  const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (i < total) h[i] = tanhf(h[i] + b1[i % hidden]);
}

// One block: dy = 2 (yhat + b2 - y) / n, and the sums of err^2 and of dy by a fixed tree.
__global__ void loss_grad(const float* yhat, const float* b2, const float* y, float* dy, int n,
                          double* sse_out, float* gb2) {
  __shared__ double s_sse[kBlock];
  __shared__ float s_db[kBlock];
  double sse = 0;
  float db = 0;
  const float scale = 2.0f / static_cast<float>(n);
  for (int i = threadIdx.x; i < n; i += kBlock) {
    const float err = yhat[i] + b2[0] - y[i];
    sse += static_cast<double>(err) * err;
    dy[i] = scale * err;
    db += dy[i];
  }
  s_sse[threadIdx.x] = sse;
  s_db[threadIdx.x] = db;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      s_sse[threadIdx.x] += s_sse[threadIdx.x + s];
      s_db[threadIdx.x] += s_db[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *sse_out = s_sse[0];
    *gb2 = s_db[0];
  }
}

__global__ void tanh_backward(float* dh, const float* h, long total) {
  const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (i < total) dh[i] *= 1.0f - h[i] * h[i];
}

// gb1[j] = sum over samples of dz[j, c], in sample order.
__global__ void row_sums(const float* dz, float* gb1, int hidden, int n) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= hidden) return;
  float s = 0;
  for (int c = 0; c < n; ++c) s += dz[static_cast<long>(c) * hidden + j];
  gb1[j] = s;
}

}  // namespace

struct Trainer::Impl {
  int hidden = 0;
  int capacity = 0;
  cublasHandle_t blas = nullptr;
  float *x = nullptr, *y = nullptr, *h = nullptr, *yhat = nullptr, *dy = nullptr, *dh = nullptr;
  double* sse = nullptr;

  void release() noexcept {
    for (void* p : {static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(h),
                    static_cast<void*>(yhat), static_cast<void*>(dy), static_cast<void*>(dh)})
      if (p) cudaFree(p);
    x = y = h = yhat = dy = dh = nullptr;
  }
  void reserve(int n) {
    if (n <= capacity) return;
    release();
    const size_t col = static_cast<size_t>(n) * sizeof(float);
    check(cudaMalloc(&x, col), "cudaMalloc");
    check(cudaMalloc(&y, col), "cudaMalloc");
    check(cudaMalloc(&yhat, col), "cudaMalloc");
    check(cudaMalloc(&dy, col), "cudaMalloc");
    check(cudaMalloc(&h, col * hidden), "cudaMalloc");
    check(cudaMalloc(&dh, col * hidden), "cudaMalloc");
    capacity = n;
  }
};

Trainer::Trainer(int hidden) : impl_(new Impl) {
  impl_->hidden = hidden;
  try {
    check(cublasCreate(&impl_->blas), "cublasCreate");
    check(cudaMalloc(&impl_->sse, sizeof(double)), "cudaMalloc");
  } catch (...) {
    if (impl_->blas) cublasDestroy(impl_->blas);
    delete impl_;
    throw;
  }
}

Trainer::~Trainer() {
  impl_->release();
  if (impl_->sse) cudaFree(impl_->sse);
  if (impl_->blas) cublasDestroy(impl_->blas);
  delete impl_;
}

double Trainer::forward_backward(const float* w1, const float* b1, const float* w2, const float* b2,
                                 float* gw1, float* gb1, float* gw2, float* gb2, const float* x,
                                 const float* y, int n) {
  Impl& m = *impl_;
  const int hd = m.hidden;
  m.reserve(n);
  check(cudaMemcpy(m.x, x, sizeof(float) * n, cudaMemcpyHostToDevice), "cudaMemcpy x");
  check(cudaMemcpy(m.y, y, sizeof(float) * n, cudaMemcpyHostToDevice), "cudaMemcpy y");
  const float one = 1.0f, zero = 0.0f;
  const long total = static_cast<long>(hd) * n;
  const int grid = static_cast<int>((total + kBlock - 1) / kBlock);
  // Z1 = W1 X (hidden x n); H = tanh(Z1 + b1).
  check(cublasSgemm(m.blas, CUBLAS_OP_N, CUBLAS_OP_N, hd, n, 1, &one, w1, hd, m.x, 1, &zero, m.h, hd), "Sgemm W1 X");
  bias_tanh<<<grid, kBlock>>>(m.h, b1, hd, total);
  // Yhat = W2 H (1 x n).
  check(cublasSgemm(m.blas, CUBLAS_OP_N, CUBLAS_OP_N, 1, n, hd, &one, w2, 1, m.h, hd, &zero, m.yhat, 1), "Sgemm W2 H");
  loss_grad<<<1, kBlock>>>(m.yhat, b2, m.y, m.dy, n, m.sse, gb2);
  // gW2 = dY H^T (1 x hidden); dH = W2^T dY (hidden x n); dZ = dH .* (1 - H^2).
  check(cublasSgemm(m.blas, CUBLAS_OP_N, CUBLAS_OP_T, 1, hd, n, &one, m.dy, 1, m.h, hd, &zero, gw2, 1), "Sgemm dY H^T");
  check(cublasSgemm(m.blas, CUBLAS_OP_T, CUBLAS_OP_N, hd, n, 1, &one, w2, 1, m.dy, 1, &zero, m.dh, hd), "Sgemm W2^T dY");
  tanh_backward<<<grid, kBlock>>>(m.dh, m.h, total);
  row_sums<<<(hd + kBlock - 1) / kBlock, kBlock>>>(m.dh, gb1, hd, n);
  // gW1 = dZ X^T (hidden x 1).
  check(cublasSgemm(m.blas, CUBLAS_OP_N, CUBLAS_OP_T, hd, 1, n, &one, m.dh, hd, m.x, 1, &zero, gw1, hd), "Sgemm dZ X^T");
  check(cudaGetLastError(), "kernel launch");
  double sse = 0;
  // Synchronous copy on the legacy default stream: also waits for everything above, so the
  // gradients are final before the optimizer hands them to MPI or NCCL.
  check(cudaMemcpy(&sse, m.sse, sizeof(double), cudaMemcpyDeviceToHost), "cudaMemcpy sse");
  return sse;
}

}  // namespace train_cuda
