// The bridge between LibTorch and Lockstep tensors: view and borrow of an at::Tensor, its dtype
// and shape.
#include "internal.hpp"

#include <torch/torch.h>

#include <sstream>

#include "lockstep/core/errors.hpp"

namespace lockstep::torch {

using detail::concat;
using namespace internal;

namespace internal {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream os;
  os << t.scalar_type() << " " << t.sizes() << " on " << t.device();
  return os.str();
}

std::optional<DType> dtype_of(c10::ScalarType s) {
  switch (s) {
    case c10::kHalf: return DType::f16;
    case c10::kBFloat16: return DType::bf16;
    case c10::kFloat: return DType::f32;
    case c10::kDouble: return DType::f64;
    case c10::kInt: return DType::i32;
    case c10::kLong: return DType::i64;
    case c10::kByte: return DType::u8;
    case c10::kBool: return DType::u8;  // one byte, 0 or 1: its bits are u8's
    default: return std::nullopt;
  }
}

Shape shape_of(const at::Tensor& t) { return Shape(t.sizes().begin(), t.sizes().end()); }

}  // namespace internal

TensorView view(const at::Tensor& t) {
  LOCKSTEP_CHECK_ARG(t.defined(), "lockstep::torch::view: the tensor is undefined");
  LOCKSTEP_CHECK_ARG(t.layout() == c10::kStrided, "lockstep::torch::view: a ", t.layout(),
                     " tensor (", describe(t), "); only dense (strided) tensors have a flat view");
  LOCKSTEP_CHECK_ARG(t.is_contiguous(), "lockstep::torch::view: the tensor (", describe(t),
                     ") is not contiguous; call .contiguous() first (that copies)");
  const auto dt = dtype_of(t.scalar_type());
  LOCKSTEP_CHECK_ARG(dt.has_value(), "lockstep::torch::view: dtype ", t.scalar_type(),
                     " has no Lockstep dtype (supported: Half, BFloat16, Float, Double, Int, Long, "
                     "Byte, Bool)");
  Device dev = Device::cpu();
  if (t.device().is_cuda())
    dev = Device::cuda(t.device().index());
  else
    LOCKSTEP_CHECK_ARG(t.device().is_cpu(), "lockstep::torch::view: a tensor on ", t.device(),
                       "; Lockstep has cpu and cuda tensors");
  return TensorView{t.numel() == 0 ? nullptr : t.data_ptr(), t.numel(), *dt, dev};
}

Tensor borrow(const at::Tensor& t) {
  const TensorView v = view(t);
  return Tensor::borrow(v.data, shape_of(t), v.dtype, v.device);
}

}  // namespace lockstep::torch
