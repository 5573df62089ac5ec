// MPIBackend's datatypes and reduction operators: the MPI type of each DType, f16/bf16 through
// user-defined operators (summed in blocks with wire16.hpp's vector loops), and avg's division
// on the host.
#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "core/wire16.hpp"
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep::detail::mpib {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16: return MPI_UINT16_T;
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

namespace {

template <class Storage, ReduceOp Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const Storage*>(in);
  auto* b = static_cast<Storage*>(inout);
  if constexpr (Op == ReduceOp::sum) {
    // The sum (what compressed gradients use), in blocks converted with the vector loops of
    // wire16.hpp: several times faster than a conversion call per element.
    constexpr DType w = std::is_same_v<Storage, half> ? DType::f16 : DType::bf16;
    constexpr int kBlock = 512;
    float x[kBlock], y[kBlock];
    for (int i0 = 0; i0 < *len; i0 += kBlock) {
      const int m = std::min(kBlock, *len - i0);
      detail::from_wire16(w, a + i0, x, m, 1.0f);
      detail::from_wire16(w, b + i0, y, m, 1.0f);
      for (int i = 0; i < m; ++i) x[i] += y[i];
      detail::to_wire16(w, x, b + i0, m);
    }
    return;
  }
  for (int i = 0; i < *len; ++i) {
    float x = to_float(a[i]), y = to_float(b[i]), r;
    if constexpr (Op == ReduceOp::sum) r = x + y;
    else if constexpr (Op == ReduceOp::prod) r = x * y;
    else if constexpr (Op == ReduceOp::min) r = std::min(x, y);
    else r = std::max(x, y);
    if constexpr (std::is_same_v<Storage, half>) b[i] = to_half(r);
    else b[i] = to_bfloat16(r);
  }
}

// The user-defined operators live as long as MPI does: created on first use, freed by
// finalize_global() (free_half_ops). A mutex rather than std::once_flag, because when the user
// owns MPI the global backend can be finalised and initialised again, and the operators must
// come back.
struct HalfOps {
  std::array<MPI_Op, 4> f16{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  std::array<MPI_Op, 4> bf16{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  std::mutex mutex;
  bool created = false;

  MPI_Op get(DType t, int idx) {
    std::lock_guard lock(mutex);
    if (!created) {
      MPI_User_function* fns16[4] = {half_op<half, ReduceOp::sum>, half_op<half, ReduceOp::prod>,
                                     half_op<half, ReduceOp::min>, half_op<half, ReduceOp::max>};
      MPI_User_function* fnsbf[4] = {half_op<bfloat16, ReduceOp::sum>, half_op<bfloat16, ReduceOp::prod>,
                                     half_op<bfloat16, ReduceOp::min>, half_op<bfloat16, ReduceOp::max>};
      for (int i = 0; i < 4; ++i) {
        LOCKSTEP_MPI_CHECK(MPI_Op_create(fns16[i], 1, &f16[i]));
        LOCKSTEP_MPI_CHECK(MPI_Op_create(fnsbf[i], 1, &bf16[i]));
      }
      created = true;
    }
    return t == DType::f16 ? f16[idx] : bf16[idx];
  }
  void free_all() noexcept {
    std::lock_guard lock(mutex);
    for (auto* ops : {&f16, &bf16})
      for (auto& op : *ops)
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
    created = false;
  }
};
HalfOps g_half_ops;
}  // namespace

MPI_Op mpi_op(ReduceOp op, DType t) {
  int idx = op == ReduceOp::avg ? 0 : static_cast<int>(op);
  if (t == DType::f16 || t == DType::bf16) return g_half_ops.get(t, idx);
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::prod: return MPI_PROD;
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::max: return MPI_MAX;
  }
  return MPI_OP_NULL;
}

void free_half_ops() noexcept { g_half_ops.free_all(); }

// Divides every element by n (host memory), for avg.
void scale_host(TensorView v, int n) {
  switch (v.dtype) {
    case DType::f32: {
      // avg equals sum / n exactly: a multiplication by 1/n only when n is a power of two (then
      // it is exact, and several times cheaper), a division otherwise.
      float* p = static_cast<float*>(v.data);
      if ((n & (n - 1)) == 0)
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] *= 1.0f / static_cast<float>(n);
      else
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] /= static_cast<float>(n);
      break;
    }
    case DType::f64: {
      double* p = static_cast<double*>(v.data);
      if ((n & (n - 1)) == 0)
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] *= 1.0 / static_cast<double>(n);
      else
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] /= static_cast<double>(n);
      break;
    }
    case DType::f16: {
      half* p = static_cast<half*>(v.data);
      for (std::int64_t i = 0; i < v.numel; ++i) p[i] = to_half(to_float(p[i]) / static_cast<float>(n));
      break;
    }
    case DType::bf16: {
      bfloat16* p = static_cast<bfloat16*>(v.data);
      for (std::int64_t i = 0; i < v.numel; ++i)
        p[i] = to_bfloat16(to_float(p[i]) / static_cast<float>(n));
      break;
    }
    default: break;  // rejected earlier by check_op_for_dtype
  }
}

}  // namespace lockstep::detail::mpib
