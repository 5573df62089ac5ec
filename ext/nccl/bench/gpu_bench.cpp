// GPU benchmark: NCCLBackend::allreduce against raw ncclAllReduce over message sizes, and the
// bandwidth of the optimizer kernels next to a plain device copy kernel in the same run.
//
//   mpiexec -n 1 ./gpu_bench --out DIR [--quick]
//
// Writes DIR/allreduce.csv and DIR/kernels.csv (rank 0) and prints both tables. Timings are
// medians over repetitions; each repetition of an allreduce waits for completion on the host
// for both variants, so the comparison measures the same thing (the overhead of the Backend
// layer: argument checks, event ordering, completion polling). At one rank NCCL moves no data,
// so the allreduce table is labelled call overhead (time per call) and carries no bandwidth.
#include <cuda_bf16.h>  // before nccl.h: older headers declare ncclBfloat16 only after it
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "lockstep/cuda.hpp"
#include "lockstep/lockstep.hpp"
#include "lockstep/nccl.hpp"
#include "lockstep_cli.hpp"

namespace ls = lockstep;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void nccl_ok(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}

// Host wall time of f(), in microseconds, after a barrier; median over `reps`.
template <class F>
double time_us(MPI_Comm comm, int warmup, int reps, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(comm);
    auto a = std::chrono::steady_clock::now();
    f();
    auto b = std::chrono::steady_clock::now();
    double us = std::chrono::duration<double, std::micro>(b - a).count();
    double worst = 0;
    MPI_Allreduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, comm);  // the slowest rank decides
    t.push_back(worst);
  }
  return median(t);
}

// Device time of f() (queued on `s`) in milliseconds, median over `reps`.
template <class F>
double time_ms(cudaStream_t s, int dev, int reps, F&& f) {
  f();  // warm-up
  LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = ls::cuda::Event::create(dev, true), b = ls::cuda::Event::create(dev, true);
    a.record(s);
    f();
    b.record(s);
    b.synchronize();
    t.push_back(b.elapsed_ms_since(a));
  }
  return median(t);
}

int run(int argc, char** argv) {
  std::string out = ".";
  bool quick = false;
  lockstep_cli::App app("gpu_bench", "NCCLBackend::allreduce against raw ncclAllReduce, and the optimizer kernels' bandwidth");
  app.add_option("--out", out, "directory for allreduce.csv and kernels.csv (rank 0)")->type_name("DIR");
  app.add_flag("--quick", quick, "fewer sizes and repetitions");
  // Parsed before NCCL (and MPI) start: every rank gets the same argv, so every rank decides alike.
  if (const auto rc = lockstep_cli::parse(app, argc, argv)) return *rc;
  ls::initialize<ls::NCCLBackend>();
  auto& nccl = ls::get_distributed_backend<ls::NCCLBackend>();
  const int rank = nccl.rank(), size = nccl.size(), dev = nccl.device();
  MPI_Comm comm = nccl.host_backend().comm();
  ls::cuda::DeviceGuard guard(dev);

  // A raw NCCL communicator over the same ranks, for the baseline.
  ncclUniqueId id;
  if (rank == 0) nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm);
  ncclComm_t raw;
  nccl_ok(ncclCommInitRank(&raw, size, id, rank), "ncclCommInitRank");
  ls::cuda::Stream rs = ls::cuda::Stream::create(dev);

  cudaDeviceProp prop{};
  LOCKSTEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  int runtime_version = 0, driver_version = 0;
  cudaRuntimeGetVersion(&runtime_version);
  cudaDriverGetVersion(&driver_version);
  if (rank == 0)
    std::printf("# gpu_bench: %d rank(s), device %d = %s, CUDA runtime %d, driver %d, NCCL %d\n", size, dev,
                prop.name, runtime_version, driver_version, nccl_version);

  // --- allreduce ------------------------------------------------------------------------------
  std::filesystem::create_directories(out);
  std::ofstream ar;
  if (rank == 0) {
    ar.open(out + "/allreduce.csv");
    ar << "bytes,lockstep_us,raw_nccl_us,lockstep_algbw_GBps,raw_algbw_GBps,measures\n";
    if (size == 1)
      std::printf("# allreduce at 1 rank: no data moves between GPUs, so this is the CALL OVERHEAD of each\n"
                  "# path (microseconds per call, host waits for completion), not a bandwidth\n");
    std::printf("%12s %14s %14s %12s %12s\n", "bytes", "lockstep_us", "raw_nccl_us", "ls_GB/s", "raw_GB/s");
  }
  const std::int64_t max_bytes = quick ? (std::int64_t{16} << 20) : (std::int64_t{256} << 20);
  for (std::int64_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    const std::int64_t n = bytes / 4;
    ls::Tensor buf = ls::Tensor::ones({n}, ls::DType::f32, ls::Device::cuda(dev));
    const int reps = bytes >= (std::int64_t{64} << 20) ? 10 : 30;
    double t_ls = time_us(comm, 5, reps, [&] { nccl.allreduce(buf.view(), ls::ReduceOp::sum); });
    double t_raw = time_us(comm, 5, reps, [&] {
      nccl_ok(ncclAllReduce(buf.raw_data(), buf.raw_data(), n, ncclFloat32, ncclSum, raw, rs.get()), "ncclAllReduce");
      LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(rs.get()));
    });
    if (rank == 0) {
      if (size == 1) {
        ar << bytes << "," << t_ls << "," << t_raw << ",,,call_overhead_1rank\n";
        std::printf("%12lld %14.1f %14.1f %12s %12s\n", static_cast<long long>(bytes), t_ls, t_raw, "-", "-");
      } else {
        const double gb_ls = bytes / t_ls / 1e3, gb_raw = bytes / t_raw / 1e3;
        ar << bytes << "," << t_ls << "," << t_raw << "," << gb_ls << "," << gb_raw << ",allreduce_algbw\n";
        std::printf("%12lld %14.1f %14.1f %12.2f %12.2f\n", static_cast<long long>(bytes), t_ls, t_raw, gb_ls,
                    gb_raw);
      }
    }
  }
  ncclCommDestroy(raw);

  // --- kernels --------------------------------------------------------------------------------
  if (rank == 0) {
    const std::int64_t n = quick ? (std::int64_t{16} << 20) : (std::int64_t{64} << 20);  // f32 elements
    const ls::Device d = ls::Device::cuda(dev);
    ls::Tensor p = ls::Tensor::full({n}, 0.5, ls::DType::f32, d), g = ls::Tensor::full({n}, 0.01, ls::DType::f32, d);
    ls::Tensor m = ls::Tensor::zeros({n}, ls::DType::f32, d), v = ls::Tensor::zeros({n}, ls::DType::f32, d);
    ls::Tensor dst = ls::Tensor::zeros({n}, ls::DType::f32, d);
    cudaStream_t s = rs.get();
    const double fb = static_cast<double>(n) * 4;  // bytes of one array
    struct Row {
      std::string name;
      double bytes, ms;
    };
    std::vector<Row> rows;
    rows.push_back({"copy_kernel", 2 * fb, time_ms(s, dev, 20, [&] { ls::cuda::copy_kernel(dst.raw_data(), p.raw_data(), n * 4, s); })});
    rows.push_back({"cudaMemcpyAsync_d2d", 2 * fb, time_ms(s, dev, 20, [&] {
                      LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), p.raw_data(), n * 4, cudaMemcpyDeviceToDevice, s));
                    })});
    rows.push_back({"scale", 2 * fb, time_ms(s, dev, 20, [&] { ls::cuda::scale(dst.view(), 1.0, s); })});
    auto sc = ls::math::sgd_coeffs<float>(1e-3, 0.9, 0.0, 0.0, false, 2);
    const ls::cuda::SgdSpan sspan{p.view(), g.view(), m.view()};
    rows.push_back({"sgd_momentum", 5 * fb, time_ms(s, dev, 20, [&] { ls::cuda::sgd_update({&sspan, 1}, sc, s); })});
    auto ac = ls::math::adam_coeffs<float>(1e-3, 0.9, 0.999, 1e-8, 0.0, false, 2);
    const ls::cuda::AdamSpan aspan{p.view(), g.view(), m.view(), v.view()};
    rows.push_back({"adam", 7 * fb, time_ms(s, dev, 20, [&] { ls::cuda::adam_update({&aspan, 1}, ac, s); })});
    // The same Adam step over 1000 tensors of uneven sizes covering the same n elements: one
    // launch with a chunk table.
    std::vector<ls::cuda::AdamSpan> many;
    std::int64_t at = 0;
    for (int i = 0; i < 1000; ++i) {
      std::int64_t len = (i == 999) ? n - at : (n / 1000) + ((i % 7) - 3) * 61;
      many.push_back({p.view().slice(at, len), g.view().slice(at, len), m.view().slice(at, len), v.view().slice(at, len)});
      at += len;
    }
    rows.push_back({"adam_1000_tensors_one_launch", 7 * fb, time_ms(s, dev, 20, [&] { ls::cuda::adam_update(many, ac, s); })});
    std::vector<ls::TensorView> parts;
    at = 0;
    for (int i = 0; i < 1000; ++i) {
      std::int64_t len = (i == 999) ? n - at : n / 1000;
      parts.push_back(p.view().slice(at, len));
      at += len;
    }
    rows.push_back({"pack_1000_tensors", 2 * fb, time_ms(s, dev, 20, [&] { ls::cuda::pack(parts, dst.view(), 0, s); })});

    std::ofstream kc(out + "/kernels.csv");
    kc << "kernel,elements,bytes_moved,ms,GBps\n";
    std::printf("\n%-30s %12s %10s %10s\n", "kernel", "elements", "ms", "GB/s");
    for (const auto& r : rows) {
      const double gbps = r.bytes / (r.ms * 1e-3) / 1e9;
      kc << r.name << "," << n << "," << r.bytes << "," << r.ms << "," << gbps << "\n";
      std::printf("%-30s %12lld %10.3f %10.1f\n", r.name.c_str(), static_cast<long long>(n), r.ms, gbps);
    }
  }
  ls::finalize<ls::NCCLBackend>();
  ls::finalize<ls::MPIBackend>();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_bench: %s\n", e.what());
    int init = 0;
    MPI_Initialized(&init);
    if (init) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
