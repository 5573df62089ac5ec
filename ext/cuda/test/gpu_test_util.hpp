// Helpers of the GPU tests: deterministic host data of any dtype, element access as double, and
// the sweep that checks every collective of a backend on device buffers against MPIBackend on
// host buffers. Checks are local (a pass flag and a log); callers combine the flag across ranks.
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/cuda.hpp"
#include "lockstep/lockstep.hpp"

namespace lockstep::gpu_test {

inline double get(const Tensor& t, std::int64_t i) {
  const void* p = t.raw_data();
  switch (t.dtype()) {
    case DType::f16: return to_float(static_cast<const half*>(p)[i]);
    case DType::bf16: return to_float(static_cast<const bfloat16*>(p)[i]);
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::i32: return static_cast<const std::int32_t*>(p)[i];
    case DType::i64: return static_cast<const double>(static_cast<const std::int64_t*>(p)[i]);
    case DType::u8: return static_cast<const std::uint8_t*>(p)[i];
  }
  return 0;
}

inline void set(Tensor& t, std::int64_t i, double v) {
  void* p = t.raw_data();
  switch (t.dtype()) {
    case DType::f16: static_cast<half*>(p)[i] = to_half(static_cast<float>(v)); break;
    case DType::bf16: static_cast<bfloat16*>(p)[i] = to_bfloat16(static_cast<float>(v)); break;
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::i32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); break;
    case DType::i64: static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); break;
    case DType::u8: static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v); break;
  }
}

/// Host tensor of n elements with element i = f(i).
inline Tensor make_host(DType dt, std::int64_t n, const std::function<double(std::int64_t)>& f) {
  Tensor t = Tensor::empty({n}, dt);
  for (std::int64_t i = 0; i < n; ++i) set(t, i, f(i));
  return t;
}

/// Small values whose sums, minima and maxima are exact in every dtype; for prod, +-1 and 2
/// (products of at most four are exact powers of two). u8 gets non-negative values.
inline double value(int rank, std::int64_t i, int salt, ReduceOp op, DType dt) {
  if (op == ReduceOp::prod) {
    std::int64_t k = (i * 5 + rank * 3 + salt) % 4;
    return k == 0 ? 2.0 : (k == 1 && dt != DType::u8 ? -1.0 : 1.0);
  }
  double v = static_cast<double>((i * 7 + rank * 3 + salt) % 9) - 4.0;
  return dt == DType::u8 ? v + 4.0 : v;
}

/// Relative tolerance for comparing an avg computed by two libraries (NCCL may multiply by 1/n
/// where MPIBackend divides by n): a few units in the last place of the dtype.
inline double avg_tolerance(DType dt) {
  switch (dt) {
    case DType::f16: return 4e-3;
    case DType::bf16: return 3.2e-2;
    case DType::f32: return 4e-7;
    default: return 1e-15;
  }
}

struct Checker {
  bool ok = true;
  std::ostringstream log;
  int failures = 0;

  /// Compares element by element; exact unless tol > 0 (relative, with an absolute floor).
  void compare(const Tensor& got_any, const Tensor& want, double tol, const std::string& what) {
    Tensor got = got_any.device().is_cpu() ? got_any.clone() : got_any.to(Device::cpu());
    if (got.numel() != want.numel()) {
      fail(what + ": element counts differ");
      return;
    }
    for (std::int64_t i = 0; i < want.numel(); ++i) {
      double a = get(got, i), b = get(want, i);
      bool eq = tol > 0 ? std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b)) : a == b;
      if (!eq) {
        std::ostringstream os;
        os << what << ": element " << i << " is " << a << ", expected " << b;
        fail(os.str());
        return;
      }
    }
  }
  void fail(const std::string& msg) {
    ok = false;
    if (++failures <= 20) log << msg << "\n";
  }
};

/// True on every rank iff `local` is true on every rank.
inline bool all_ranks(bool local) {
  int l = local ? 1 : 0, g = 0;
  MPI_Allreduce(&l, &g, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return g == 1;
}

inline const char* op_name(ReduceOp op) { return name(op); }

/// Runs every collective of `dev_backend` on buffers on `device` and the same collective of
/// `ref` (an MPIBackend) on host buffers with the same contents, and records differences.
/// Sizes include 0, 1, a prime and sizes not divisible by the rank count.
inline void sweep_collectives(Backend& dev_backend, MPIBackend& ref, Device device, Checker& c,
                              const std::vector<DType>& dtypes) {
  const int rank = ref.rank(), size = ref.size();
  const std::vector<std::int64_t> sizes = {0, 1, 7, 1031, 65537};
  const std::vector<ReduceOp> ops = {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max,
                                     ReduceOp::avg};
  for (DType dt : dtypes) {
    for (std::int64_t n : sizes) {
      std::ostringstream tag;
      tag << name(dt) << " n=" << n;
      // broadcast from every root
      for (int root = 0; root < size; ++root) {
        Tensor h = make_host(dt, n, [&](std::int64_t i) { return value(rank, i, root, ReduceOp::sum, dt); });
        Tensor d = h.to(device);
        ref.broadcast(h.view(), root);
        dev_backend.broadcast(d.view(), root);
        c.compare(d, h, 0, "broadcast " + tag.str() + " root " + std::to_string(root));
      }
      for (ReduceOp op : ops) {
        if (op == ReduceOp::avg && !is_floating(dt)) continue;
        const double tol = op == ReduceOp::avg ? avg_tolerance(dt) : 0;
        const std::string what = std::string(op_name(op)) + " " + tag.str();
        auto fill = [&](int salt) {
          return make_host(dt, n, [&](std::int64_t i) { return value(rank, i, salt, op, dt); });
        };
        {  // allreduce in place
          Tensor h = fill(1), d = h.to(device);
          ref.allreduce(h.view(), op);
          dev_backend.allreduce(d.view(), op);
          c.compare(d, h, tol, "allreduce " + what);
        }
        {  // allreduce out of place
          Tensor hs = fill(2), hr = Tensor::zeros({n}, dt);
          Tensor ds = hs.to(device), dr = Tensor::zeros({n}, dt, device);
          ref.allreduce(hs.view(), hr.view(), op);
          dev_backend.allreduce(ds.view(), dr.view(), op);
          c.compare(dr, hr, tol, "allreduce out-of-place " + what);
          c.compare(ds, hs, 0, "allreduce out-of-place leaves send " + what);
        }
        {  // reduce in place, to the last rank
          const int root = size - 1;
          Tensor h = fill(3), d = h.to(device);
          ref.reduce(h.view(), op, root);
          dev_backend.reduce(d.view(), op, root);
          c.compare(d, h, tol, "reduce " + what);
        }
        {  // reduce out of place to rank 0; other ranks pass an empty recv
          Tensor hs = fill(4), ds = hs.to(device);
          Tensor hr = Tensor::zeros({rank == 0 ? n : 0}, dt);
          Tensor dr = Tensor::zeros({rank == 0 ? n : 0}, dt, device);
          ref.reduce(hs.view(), rank == 0 ? hr.view() : TensorView{}, op, 0);
          dev_backend.reduce(ds.view(), rank == 0 ? dr.view() : TensorView{}, op, 0);
          if (rank == 0) c.compare(dr, hr, tol, "reduce out-of-place " + what);
        }
        {  // reduce_scatter: send holds size blocks of n
          Tensor hs = make_host(dt, n * size, [&](std::int64_t i) { return value(rank, i, 5, op, dt); });
          Tensor hr = Tensor::zeros({n}, dt), ds = hs.to(device), dr = Tensor::zeros({n}, dt, device);
          ref.reduce_scatter(hs.view(), hr.view(), op);
          dev_backend.reduce_scatter(ds.view(), dr.view(), op);
          c.compare(dr, hr, tol, "reduce_scatter " + what);
        }
      }
      {  // allgather
        Tensor hs = make_host(dt, n, [&](std::int64_t i) { return value(rank, i, 6, ReduceOp::sum, dt); });
        Tensor hr = Tensor::zeros({n * size}, dt), ds = hs.to(device), dr = Tensor::zeros({n * size}, dt, device);
        ref.allgather(hs.view(), hr.view());
        dev_backend.allgather(ds.view(), dr.view());
        c.compare(dr, hr, 0, "allgather " + tag.str());
      }
      {  // nonblocking
        const ReduceOp op = is_floating(dt) ? ReduceOp::avg : ReduceOp::sum;
        Tensor h = make_host(dt, n, [&](std::int64_t i) { return value(rank, i, 7, op, dt); });
        Tensor d = h.to(device);
        ref.allreduce(h.view(), op);
        Request r = dev_backend.iallreduce(d.view(), op);
        r.wait();
        c.compare(d, h, op == ReduceOp::avg ? avg_tolerance(dt) : 0, "iallreduce " + tag.str());
        Tensor hb = make_host(dt, n, [&](std::int64_t i) { return value(rank, i, 8, ReduceOp::sum, dt); });
        Tensor db = hb.to(device);
        ref.broadcast(hb.view(), size / 2);
        Request rb = dev_backend.ibroadcast(db.view(), size / 2);
        while (!rb.test()) {
        }
        c.compare(db, hb, 0, "ibroadcast " + tag.str());
      }
    }
  }
}

}  // namespace lockstep::gpu_test
