// bench_shm: MPIBackend's shared-memory path (src/mpi/shm/shm_collectives.*) against the raw MPI call and
// against MPIBackend with the path off (LOCKSTEP_SHM=0), for allreduce (sum, in place) and
// broadcast of f32, over message sizes and slice sizes, all interleaved in one run. Each slice
// size is its own MPIBackend, constructed with LOCKSTEP_SHM_SLICE_BYTES set (and
// LOCKSTEP_SHM_MIN_BYTES=0, so that small messages take the path too). The tables choose the
// defaults: the slice size (fastest over the sizes that matter for gradients) and the threshold
// (the smallest size from which the path beats the raw call).
//
// Run: mpiexec -n 2 ./bench_shm [--json out.json] [--reps 7] [--max-bytes 67108864]
//      [--slices 65536,131072,262144,524288,1048576,4194304] [--quick] [--target-ms 10]
//      [--default-slice 1048576] [--watch SECONDS]
// A second table times allreduce on cold buffers (each call on the next region of a large pool),
// the case of gradients, for the raw call, the path off, and the default slice.
#include <lockstep/lockstep.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <unistd.h>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace ls = lockstep;

namespace {

float pattern(int rank, std::int64_t i) { return static_cast<float>((i % 13) + rank + 1); }

// An MPIBackend built with the given environment (the settings are read in the constructor).
std::unique_ptr<ls::MPIBackend> backend_with(const char* shm, const std::string& slice) {
  setenv("LOCKSTEP_SHM", shm, 1);
  setenv("LOCKSTEP_SHM_SLICE_BYTES", slice.c_str(), 1);
  setenv("LOCKSTEP_SHM_MIN_BYTES", "0", 1);
  auto b = std::make_unique<ls::MPIBackend>(MPI_COMM_WORLD);
  unsetenv("LOCKSTEP_SHM");
  unsetenv("LOCKSTEP_SHM_SLICE_BYTES");
  unsetenv("LOCKSTEP_SHM_MIN_BYTES");
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  const int rank = bench::world_rank(), n = bench::world_size();
  bench::Options opt("bench_shm", "MPIBackend's shared-memory path against the raw MPI call and against the path off");
  std::size_t max_bytes = 67108864;
  double target_ms = 10;
  std::vector<std::size_t> slices = {65536, 131072, 262144, 524288, 1048576, 4194304};
  std::string default_slice = "1048576";
  int watch = 0;
  auto* max_flag = opt.app.add_option("--max-bytes", max_bytes, "largest message (16777216 with --quick)")
                       ->type_name("BYTES")->check(lockstep_cli::at_least(8));
  auto* target_flag = opt.app.add_option("--target-ms", target_ms, "length of one timed block (4 with --quick)")
                          ->type_name("MS")->check(lockstep_cli::positive());
  opt.app.add_option("--slices", slices, "slice sizes to compare (LOCKSTEP_SHM_SLICE_BYTES)")
      ->type_name("A,B")->delimiter(',')->check(lockstep_cli::at_least(1));
  opt.app.add_option("--default-slice", default_slice, "slice size of the cold-buffer table and of --watch")
      ->type_name("BYTES");
  opt.app.add_option("--watch", watch, "instead: one line a second for this long, the path against MPI on 64 MiB")
      ->type_name("SECONDS")->check(lockstep_cli::at_least(0));
  if (const auto rc = opt.parse(argc, argv)) return *rc;
  opt.quick_default(max_bytes, max_flag, 16777216);
  opt.quick_default(target_ms, target_flag, 4);
  const double target_s = target_ms / 1000.0;
  const int reps = opt.quick_reps();

  // --watch SECONDS: one line a second, the shared-memory path against MPI on 64 MiB, to see how
  // both move over time on a shared machine (docs/performance/where-the-time-goes.md, "Phases").
  if (watch > 0) {
    auto shm_backend = backend_with("1", default_slice);
    const std::int64_t count = std::int64_t{64} << 18;  // 64 MiB of f32
    std::vector<float> x(static_cast<std::size_t>(count), 0.0f);
    ls::TensorView v{x.data(), count, ls::DType::f32, ls::Device::cpu()};
    int slow_b = 0, slow_a = 0;
    if (rank == 0) std::printf("time      shm bcast  MPI_Bcast  shm allreduce  MPI_Allreduce  (GB/s, 64 MiB)\n");
    for (int s = 0; s < watch; ++s) {
      double gbs[4];
      for (int k = 0; k < 4; ++k) {
        const double t = bench::time_collective(
            [&] {
              if (k == 0) shm_backend->broadcast(v, 0);
              else if (k == 1) MPI_Bcast(x.data(), static_cast<int>(count), MPI_FLOAT, 0, MPI_COMM_WORLD);
              else if (k == 2) shm_backend->allreduce(v, ls::ReduceOp::sum);
              else MPI_Allreduce(MPI_IN_PLACE, x.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            },
            1);
        gbs[k] = static_cast<double>(count) * 4 / t / 1e9;
      }
      slow_b += gbs[0] < gbs[1] ? 1 : 0;
      slow_a += gbs[2] < gbs[3] ? 1 : 0;
      if (rank == 0) {
        char when[16];
        const std::time_t now = std::time(nullptr);
        std::strftime(when, sizeof when, "%H:%M:%S", std::gmtime(&now));
        std::printf("%s  %9.2f  %9.2f  %13.2f  %13.2f\n", when, gbs[0], gbs[1], gbs[2], gbs[3]);
        std::fflush(stdout);
      }
      sleep(1);
    }
    if (rank == 0)
      std::printf("seconds in which the shared-memory path was slower than MPI: broadcast %d of %d, allreduce %d of %d\n",
                  slow_b, watch, slow_a, watch);
    shm_backend.reset();
    ls::finalize<ls::MPIBackend>();
    return 0;
  }

  auto mpi_only = backend_with("0", "262144");
  std::vector<std::unique_ptr<ls::MPIBackend>> shm;
  for (std::size_t s : slices) shm.push_back(backend_with("1", std::to_string(s)));
  const bool on = !shm.empty() && shm.front()->shared_memory();
  if (rank == 0 && !on)
    std::printf("(the shared-memory path is off here: ranks not on one machine, or 1 rank; the "
                "slice columns measure the MPI path)\n");

  std::vector<std::size_t> sizes;
  for (std::size_t b = 4 << 10; b <= max_bytes; b *= 4) sizes.push_back(b);
  std::vector<float> buf(max_bytes / sizeof(float));
  bench::Json jrows = bench::Json::array();
  bool all_ok = true;

  for (const std::string op : {"allreduce", "broadcast"}) {
    const bool ar = op == "allreduce";
    std::vector<std::string> head{"size", "raw MPI us", "MPIBackend, path off"};
    for (std::size_t s : slices) head.push_back("slice " + bench::human_bytes(static_cast<double>(s)));
    head.push_back("best slice / raw");
    bench::Table t(head);
    for (std::size_t bytes : sizes) {
      const std::int64_t count = static_cast<std::int64_t>(bytes / sizeof(float));
      ls::TensorView v{buf.data(), count, ls::DType::f32, ls::Device::cpu()};
      auto fill = [&] {
        for (std::int64_t i = 0; i < count; ++i) buf[i] = pattern(rank, i);
      };
      auto verify = [&] {
        for (std::int64_t i = 0; i < count; ++i) {
          float want = 0;
          if (ar)
            for (int r = 0; r < n; ++r) want += pattern(r, i);
          else
            want = pattern(0, i);
          if (buf[i] != want) return false;
        }
        return true;
      };
      auto run = [&](ls::MPIBackend& b) {
        if (ar) b.allreduce(v, ls::ReduceOp::sum);
        else b.broadcast(v, 0);
      };
      // Correctness of every variant, untimed.
      bool ok = true;
      for (auto* b : {mpi_only.get()}) fill(), run(*b), ok = ok && verify();
      for (auto& b : shm) fill(), run(*b), ok = ok && verify();
      ok = bench::all_ranks(ok);
      all_ok = all_ok && ok;

      // Timed on zeros (repeated sums stay finite).
      std::fill(buf.begin(), buf.begin() + count, 0.0f);
      std::vector<bench::Variant> vs;
      vs.push_back({"raw", [&] {
                      if (ar)
                        MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                                      MPI_COMM_WORLD);
                      else
                        MPI_Bcast(buf.data(), static_cast<int>(count), MPI_FLOAT, 0, MPI_COMM_WORLD);
                    }});
      vs.push_back({"off", [&] { run(*mpi_only); }});
      for (auto& b : shm) {
        ls::MPIBackend* p = b.get();
        vs.push_back({"slice", [&run, p] { run(*p); }});
      }
      const double one = bench::time_collective(vs[0].body, 2);
      auto m = bench::interleave(vs, reps, bench::iters_for(one, target_s));
      std::vector<std::string> row{bench::human_bytes(static_cast<double>(bytes)),
                                   bench::fmt(m[0].s.median * 1e6, 1)};
      auto rel = [&](const bench::Measured& x) {
        return bench::fmt(x.s.median * 1e6, 1) + " (" + bench::fmt(x.s.median / m[0].s.median, 2) + "x)";
      };
      row.push_back(rel(m[1]));
      double best = 1e30;
      bench::Json j = bench::Json::object();
      j.set("op", op).set("bytes", static_cast<std::int64_t>(bytes)).set("correct", ok);
      j.set("raw_median_s", m[0].s.median).set("off_median_s", m[1].s.median);
      bench::Json js = bench::Json::array();
      for (std::size_t k = 0; k < slices.size(); ++k) {
        const auto& x = m[2 + k];
        row.push_back(rel(x));
        best = std::min(best, x.s.median);
        js.push(bench::Json::object().set("slice_bytes", static_cast<std::int64_t>(slices[k])).set("median_s", x.s.median).set("min_s", x.s.min));
      }
      row.push_back(bench::fmt(best / m[0].s.median, 3) + (ok ? "" : " WRONG"));
      j.set("slices", js);
      jrows.push(j);
      t.add(row);
      if (rank == 0) std::fprintf(stderr, "  %s %s done\n", op.c_str(), bench::human_bytes(static_cast<double>(bytes)).c_str());
    }
    if (rank == 0) {
      std::printf("\n## %s, f32, %d ranks: median us (and / raw MPI), median of %d\n\n", op.c_str(), n, reps);
      t.print();
    }
  }
  // Cold buffers: each call works on the next region of a pool much larger than the caches, as
  // gradients do (backward wrote them long before, or they are too large to stay in cache). The
  // table above reuses one buffer, which stays in cache up to a few MiB.
  const std::size_t pool_bytes = std::max<std::size_t>(std::size_t{256} << 20, 4 * max_bytes);
  std::vector<float> pool(pool_bytes / sizeof(float), 0.0f);
  bench::Table tc({"size", "raw MPI us", "MPIBackend, path off", "shared memory (default slice)", "shared / raw"});
  auto dflt = backend_with("1", default_slice);
  bench::Json jcold = bench::Json::array();
  for (std::size_t bytes : sizes) {
    if (bytes < (std::size_t{64} << 10)) continue;
    const std::int64_t count = static_cast<std::int64_t>(bytes / sizeof(float));
    const std::size_t regions = pool_bytes / bytes;
    std::size_t next = 0;
    auto region = [&] { return pool.data() + (next++ % regions) * static_cast<std::size_t>(count); };
    std::vector<bench::Variant> vs;
    vs.push_back({"raw", [&] {
                    MPI_Allreduce(MPI_IN_PLACE, region(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                  }});
    vs.push_back({"off", [&] { mpi_only->allreduce({region(), count, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum); }});
    vs.push_back({"shm", [&] { dflt->allreduce({region(), count, ls::DType::f32, ls::Device::cpu()}, ls::ReduceOp::sum); }});
    const double one = bench::time_collective(vs[0].body, 2);
    const int iters = std::max(bench::iters_for(one, target_s), static_cast<int>(std::min<std::size_t>(regions, 64)));
    auto m = bench::interleave(vs, reps, iters);
    tc.add({bench::human_bytes(static_cast<double>(bytes)), bench::fmt(m[0].s.median * 1e6, 1),
            bench::fmt(m[1].s.median * 1e6, 1) + " (" + bench::fmt(m[1].s.median / m[0].s.median, 2) + "x)",
            bench::fmt(m[2].s.median * 1e6, 1), bench::fmt(m[2].s.median / m[0].s.median, 3)});
    jcold.push(bench::Json::object()
                   .set("bytes", static_cast<std::int64_t>(bytes))
                   .set("raw_median_s", m[0].s.median)
                   .set("off_median_s", m[1].s.median)
                   .set("shm_median_s", m[2].s.median));
  }
  if (rank == 0) {
    std::printf("\n## allreduce on cold buffers (each call on the next region of a %s pool), f32, %d ranks, median of %d\n\n",
                bench::human_bytes(static_cast<double>(pool_bytes)).c_str(), n, reps);
    tc.print();
  }
  dflt.reset();

  bench::Json doc = bench::run_info("shm");
  doc.set("cold", jcold);
  doc.set("reps", reps).set("all_correct", all_ok).set("rows", jrows);
  doc.write(opt.json);
  shm.clear();
  mpi_only.reset();
  ls::finalize<ls::MPIBackend>();
  if (rank == 0 && !all_ok) std::fprintf(stderr, "bench_shm: WRONG RESULTS\n");
  return all_ok ? 0 : 1;
}
