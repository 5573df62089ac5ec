// bench_collectives: allreduce (sum, in place) and broadcast of f32 buffers from 8 B to 256 MiB,
// Lockstep's MPIBackend against the raw MPI call on the same buffer, interleaved in one run.
// Reports time (median and min of the repetitions), algbw, busbw (nccl-tests definitions:
// allreduce busbw = algbw x 2(n-1)/n, broadcast busbw = algbw) and the Lockstep/raw time ratio.
// Every size is checked for correctness, for both implementations. Extra columns: the nonblocking
// forms (MPI_Iallreduce / MPI_Ibcast and Lockstep's iallreduce / ibroadcast) followed by a wait,
// which DistributedOptimizer and synchronize use.
//
// Run: mpiexec -n 2 ./bench_collectives [--json out.json] [--reps 7] [--max-bytes 268435456]
//      [--quick] [--target-ms 20] [--dat out.dat]
// --dat writes a whitespace-separated table for gnuplot: op bytes lockstep_busbw raw_busbw (GB/s).
#include <lockstep/lockstep.hpp>

#include <cmath>
#include <cstring>

#include "bench_common.hpp"

namespace ls = lockstep;

namespace {

std::vector<std::size_t> sizes_up_to(std::size_t max_bytes) {
  // 8 B, then x4 steps (8, 32, 128, ... 128 MiB), then the largest size itself (256 MiB).
  std::vector<std::size_t> out;
  for (std::size_t b = 8; b <= max_bytes; b *= 4) out.push_back(b);
  if (out.back() != max_bytes) out.push_back(max_bytes);
  return out;
}

// Rank r's element i: small integers, so sums are exact in f32 at any rank count.
float pattern(int rank, std::int64_t i) { return static_cast<float>((i % 13) + rank + 1); }

struct Row {
  std::string op;
  std::size_t bytes;
  bench::Measured lockstep, raw;
  // The nonblocking forms followed by a wait (what DistributedOptimizer and synchronize issue).
  bench::Measured lockstep_nb, raw_nb;
};

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  auto& be = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = be.rank(), n = be.size();
  bench::Options opt("bench_collectives", "allreduce and broadcast of f32 buffers: MPIBackend against the raw MPI call");
  std::size_t max_bytes = 268435456;
  double target_ms = 20;
  std::string dat;
  auto* max_flag = opt.app.add_option("--max-bytes", max_bytes, "largest message (33554432 with --quick)")
                       ->type_name("BYTES")->check(lockstep_cli::at_least(8));
  auto* target_flag = opt.app.add_option("--target-ms", target_ms, "length of one timed block (8 with --quick)")
                          ->type_name("MS")->check(lockstep_cli::positive());
  opt.app.add_option("--dat", dat, "also write a table for gnuplot there: op bytes lockstep_busbw raw_busbw")
      ->type_name("PATH");
  if (const auto rc = opt.parse(argc, argv)) return *rc;
  opt.quick_default(max_bytes, max_flag, 33554432);
  opt.quick_default(target_ms, target_flag, 8);
  const double target_s = target_ms / 1000.0;
  const int reps = opt.quick_reps();
  MPI_Comm comm = be.comm();  // the raw calls use the same communicator as Lockstep
  // Which path Lockstep's blocking allreduce takes here (LOCKSTEP_TEST_HOST_SIZE in a build with
  // fault injection simulates machines; docs/performance/across-hosts.md, "Hierarchical allreduce").
  if (rank == 0)
    std::fprintf(stderr, "lockstep allreduce path: %s (%d ranks, %d per machine)\n",
                 be.shared_memory() ? "shared memory" : be.hierarchical() ? "hierarchical" : "MPI", n, be.local_size());

  const auto sizes = sizes_up_to(max_bytes);
  std::vector<float> buf(max_bytes / sizeof(float));
  std::vector<Row> rows;
  bool all_ok = true;

  for (const std::string op : {"allreduce", "broadcast"}) {
    for (std::size_t bytes : sizes) {
      const std::int64_t count = static_cast<std::int64_t>(bytes / sizeof(float));
      ls::TensorView v{buf.data(), count, ls::DType::f32, ls::Device::cpu()};
      const bool is_ar = op == "allreduce";

      // Correctness, untimed, for both implementations: rank-dependent input, known output.
      auto fill = [&] {
        for (std::int64_t i = 0; i < count; ++i) buf[i] = pattern(rank, i);
      };
      auto verify = [&] {
        for (std::int64_t i = 0; i < count; ++i) {
          float want = 0;
          if (is_ar)
            for (int r = 0; r < n; ++r) want += pattern(r, i);
          else
            want = pattern(0, i);
          if (buf[i] != want) return false;
        }
        return true;
      };
      bool ok_ls = true, ok_raw = true;
      fill();
      if (is_ar) be.allreduce(v, ls::ReduceOp::sum);
      else be.broadcast(v, 0);
      ok_ls = verify();
      fill();
      if (is_ar) MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, comm);
      else MPI_Bcast(buf.data(), static_cast<int>(count), MPI_FLOAT, 0, comm);
      ok_raw = verify();

      // Timed on zeros: repeated in-place sums stay finite (no overflow to inf or denormals).
      std::fill(buf.begin(), buf.begin() + count, 0.0f);
      std::vector<bench::Variant> vs;
      if (is_ar) {
        vs.push_back({"lockstep", [&] { be.allreduce(v, ls::ReduceOp::sum); }});
        vs.push_back({"raw", [&] {
                        MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT,
                                      MPI_SUM, comm);
                      }});
        vs.push_back({"lockstep iallreduce+wait", [&] { be.iallreduce(v, ls::ReduceOp::sum).wait(); }});
        vs.push_back({"raw MPI_Iallreduce+MPI_Wait", [&] {
                        MPI_Request req;
                        MPI_Iallreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, comm,
                                       &req);
                        MPI_Wait(&req, MPI_STATUS_IGNORE);
                      }});
      } else {
        vs.push_back({"lockstep", [&] { be.broadcast(v, 0); }});
        vs.push_back({"raw", [&] { MPI_Bcast(buf.data(), static_cast<int>(count), MPI_FLOAT, 0, comm); }});
        vs.push_back({"lockstep ibroadcast+wait", [&] { be.ibroadcast(v, 0).wait(); }});
        vs.push_back({"raw MPI_Ibcast+MPI_Wait", [&] {
                        MPI_Request req;
                        MPI_Ibcast(buf.data(), static_cast<int>(count), MPI_FLOAT, 0, comm, &req);
                        MPI_Wait(&req, MPI_STATUS_IGNORE);
                      }});
      }
      // Calibrate: one raw call's cost decides how many calls make one timed block.
      vs[1].body();
      const double one = bench::time_collective(vs[1].body, 3, comm);
      const int iters = bench::iters_for(one, target_s);
      auto m = bench::interleave(vs, reps, iters, comm);
      ok_ls = bench::all_ranks(ok_ls, comm);
      ok_raw = bench::all_ranks(ok_raw, comm);
      m[0].correct = ok_ls;
      m[1].correct = ok_raw;
      all_ok = all_ok && ok_ls && ok_raw;
      rows.push_back({op, bytes, m[0], m[1], m[2], m[3]});
      if (rank == 0) {
        std::fprintf(stderr, "  %s %s: lockstep %.3g s, raw %.3g s\n", op.c_str(),
                     bench::human_bytes(static_cast<double>(bytes)).c_str(), m[0].s.median, m[1].s.median);
      }
    }
  }

  // Output: one table per operation, and the JSON document.
  const double bus_factor_ar = 2.0 * (n - 1) / n;
  bench::Json jrows = bench::Json::array();
  for (const std::string op : {"allreduce", "broadcast"}) {
    if (rank == 0) std::printf("\n## %s, f32, %d ranks (median of %d repetitions; ratio = Lockstep/raw time)\n\n",
                               op.c_str(), n, reps);
    std::vector<std::string> head{"size", "raw us", "lockstep us", "raw min us", "lockstep min us", "algbw GB/s",
                                  "busbw GB/s", "ratio med", "ratio min", "correct"};
    head.push_back("raw nonblocking us");
    head.push_back("lockstep nonblocking us");
    head.push_back("nonblocking / blocking (raw)");
    bench::Table t(head);
    for (auto& r : rows) {
      if (r.op != op) continue;
      const double factor = op == "allreduce" ? bus_factor_ar : 1.0;
      const double algbw = static_cast<double>(r.bytes) / r.lockstep.s.median / 1e9;
      const double algbw_raw = static_cast<double>(r.bytes) / r.raw.s.median / 1e9;
      const double ratio = r.lockstep.s.median / r.raw.s.median;
      const double ratio_min = r.lockstep.s.min / r.raw.s.min;
      std::vector<std::string> cells{bench::human_bytes(static_cast<double>(r.bytes)), bench::fmt(r.raw.s.median * 1e6, 2),
                                     bench::fmt(r.lockstep.s.median * 1e6, 2), bench::fmt(r.raw.s.min * 1e6, 2),
                                     bench::fmt(r.lockstep.s.min * 1e6, 2), bench::fmt(algbw, 2), bench::fmt(algbw * factor, 2),
                                     bench::fmt(ratio, 3), bench::fmt(ratio_min, 3),
                                     (r.lockstep.correct && r.raw.correct) ? "yes" : "NO"};
      cells.push_back(bench::fmt(r.raw_nb.s.median * 1e6, 2));
      cells.push_back(bench::fmt(r.lockstep_nb.s.median * 1e6, 2));
      cells.push_back(bench::fmt(r.raw_nb.s.median / r.raw.s.median, 3));
      t.add(cells);
      bench::Json j = bench::Json::object();
      j.set("op", op)
          .set("bytes", static_cast<std::int64_t>(r.bytes))
          .set("lockstep_median_s", r.lockstep.s.median)
          .set("lockstep_min_s", r.lockstep.s.min)
          .set("raw_median_s", r.raw.s.median)
          .set("raw_min_s", r.raw.s.min)
          .set("algbw_GBps", algbw)
          .set("busbw_GBps", algbw * factor)
          .set("raw_algbw_GBps", algbw_raw)
          .set("raw_busbw_GBps", algbw_raw * factor)
          .set("ratio_median", ratio)
          .set("ratio_min", ratio_min)
          .set("lockstep_correct", r.lockstep.correct)
          .set("raw_correct", r.raw.correct);
      j.set("raw_nonblocking_median_s", r.raw_nb.s.median)
            .set("lockstep_nonblocking_median_s", r.lockstep_nb.s.median)
            .set("raw_nonblocking_min_s", r.raw_nb.s.min);
      jrows.push(j);
    }
    t.print();
  }
  if (!dat.empty() && rank == 0) {
    std::ofstream out(dat);
    out << "# op bytes lockstep_busbw_GBps raw_busbw_GBps (median times)\n";
    for (const std::string op : {"allreduce", "broadcast"}) {
      out << "# " << op << "\n";
      for (auto& r : rows) {
        if (r.op != op) continue;
        const double factor = op == "allreduce" ? bus_factor_ar : 1.0;
        out << op << " " << r.bytes << " " << static_cast<double>(r.bytes) / r.lockstep.s.median / 1e9 * factor
            << " " << static_cast<double>(r.bytes) / r.raw.s.median / 1e9 * factor << "\n";
      }
      out << "\n\n";  // gnuplot data blocks: index 0 = allreduce, 1 = broadcast
    }
  }
  bench::Json doc = bench::run_info("collectives");
  doc.set("reps", reps).set("all_correct", all_ok).set("rows", jrows);
  doc.write(opt.json);
  if (rank == 0 && !all_ok) std::fprintf(stderr, "bench_collectives: WRONG RESULTS (see table)\n");
  return all_ok ? 0 : 1;
}
