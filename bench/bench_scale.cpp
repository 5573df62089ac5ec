// bench_scale: the scale options of DistributedOptimizer against the replicated optimizer, in the
// same run, on the ResNet-50 and GPT-2 small shape lists (Adam):
//   memory:       resident memory of the optimizer state per rank, replicated against sharded
//                 (shard_optimizer_state), measured as the growth of the process's resident set
//                 (/proc/self/statm) once the state has been written by one step; target 1/N
//                 of the replicated figure within 5%;
//   time:         a whole step (gradient sync + update), sharded against replicated; target
//                 sharded <= 1.0x replicated;
//   rescue_buddy: the sharded step with the buddy copy of DistributedOptions::rescue_buddy (its
//                 cost per step: one allgather of one block, the largest shard);
//   compression:  the gradient sync alone (GradientReducer::reduce) with bf16 on the wire against
//                 f32; target <= 0.6x on GPT-2. Beside it, the three passes of an unfused
//                 compressed sync (what the reducer did before Backend::allreduce_wire16), each
//                 timed alone: rounding into a 16-bit copy, the 16-bit allreduce of the copy (in
//                 the reducer's slices), widening back with the division.
// Every variant runs interleaved with the others (bench_common.hpp), and every result is checked:
// the parameters stay equal on every rank, and the reduced gradients are the mean.
//
// Run: mpiexec -n 2 ./bench_scale [--lists resnet50,gpt2_small] [--reps 5] [--json out.json]
//      [--memory-only 1] [--shapes-dir DIR]
#include <lockstep/lockstep.hpp>

#include <malloc.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>

#include "bench_common.hpp"
#include "core/wire16.hpp"  // the conversion loops of the three passes (the library's own)

namespace ls = lockstep;

namespace {

// Resident set size of this process, in bytes.
double resident_bytes() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

struct Model {
  std::vector<ls::Tensor> params;
};
LOCKSTEP_FIELDS(Model, params)

Model make_model(const std::vector<bench::Param>& shapes) {
  Model m;
  for (const auto& p : shapes) {
    m.params.push_back(ls::Tensor::zeros({p.numel}));
    float* d = m.params.back().data<float>();
    for (std::int64_t i = 0; i < p.numel; ++i) d[i] = 0.01f * static_cast<float>(i % 13);
  }
  return m;
}

void fill_grads(ls::Flat<Model>& g, int rank) {
  for (ls::Tensor* t : ls::tensor_leaves(*g)) {
    float* d = t->data<float>();
    for (std::int64_t i = 0; i < t->numel(); ++i) d[i] = 1e-3f * static_cast<float>((i % 7) + rank);
  }
}

std::uint64_t hash_of(const Model& m) {
  std::uint64_t h = 0;
  for (const auto& t : m.params) h = ls::detail::hash_bytes(t.raw_data(), t.nbytes(), h);
  return h;
}

bool same_everywhere(ls::Backend& b, std::uint64_t h) {
  const auto v = static_cast<std::int64_t>(h);
  const std::int64_t lo = ls::allreduce(b, v, ls::ReduceOp::min), hi = ls::allreduce(b, v, ls::ReduceOp::max);
  return lo == hi;
}

// Resident growth of the optimizer state of one mode: setup, one step (Adam writes every
// moment), minus what was resident before setup.
struct MemoryFigure {
  double measured = 0;   // bytes, resident growth
  double declared = 0;   // state.local_state_bytes()
};
MemoryFigure measure_memory(ls::MPIBackend& b, const std::vector<bench::Param>& shapes, bool sharded) {
  Model m = make_model(shapes);
  ls::Flat<Model> g = ls::flat_zeros_like(m);
  fill_grads(g, b.rank());
  auto opt = ls::DistributedOptimizer(b, ls::Adam{.lr = 1e-4f}, ls::DistributedOptions{.shard_optimizer_state = sharded});
  {
    // A throwaway state first: the backend's shared-memory segments and MPI's buffers that the
    // first step touches count in the resident set, and are not optimizer state.
    auto warm = ls::setup(opt, m);
    ls::update(warm, m, *g);
  }
  malloc_trim(0);  // memory freed by earlier lists goes back to the system, so growth shows
  b.barrier();
  const double before = resident_bytes();
  auto st = ls::setup(opt, m);
  ls::update(st, m, *g);
  b.barrier();
  MemoryFigure f;
  f.measured = resident_bytes() - before;
  f.declared = static_cast<double>(st.local_state_bytes());
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  struct Fin {
    ~Fin() { ls::finalize<ls::MPIBackend>(); }
  } fin;
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = b.rank(), n = b.size();
  bench::Options opt("bench_scale", "sharded optimizer state and 16-bit gradients against the replicated optimizer");
  std::vector<std::string> lists = {"resnet50", "gpt2_small"};
  bool memory_only = false;
  opt.app.add_option("--lists", lists, "shape lists")->type_name("A,B")->delimiter(',');
  opt.app.add_option("--memory-only", memory_only, "1: the memory table alone")->type_name("0|1");
  if (const auto rc = opt.parse(argc, argv)) return *rc;
  bool all_ok = true;
  bench::Json jlists = bench::Json::object();

  for (const std::string& list : lists) {
    const auto shapes = bench::read_shapes(bench::shapes_dir() + "/" + list + ".txt");
    std::int64_t total = 0;
    for (const auto& p : shapes) total += p.numel;

    // --- memory ---------------------------------------------------------------------------
    const MemoryFigure rep = measure_memory(b, shapes, false);
    const MemoryFigure sh = measure_memory(b, shapes, true);
    const double rep_max = bench::max_over_ranks(rep.measured), sh_max = bench::max_over_ranks(sh.measured);
    const double ratio = sh_max / rep_max;
    const bool mem_ok = std::abs(ratio * n - 1.0) <= 0.05;
    if (rank == 0) {
      std::printf("## %s: %lld parameters, %d ranks\n\n", list.c_str(), static_cast<long long>(total), n);
      bench::Table t({"optimizer state per rank", "resident (measured)", "local_state_bytes()", "vs replicated",
                      "target 1/N"});
      t.add({"replicated Adam", bench::human_bytes(rep_max), bench::human_bytes(rep.declared), "1.000", ""});
      t.add({"sharded Adam (ZeRO-1)", bench::human_bytes(sh_max), bench::human_bytes(sh.declared), bench::fmt(ratio, 3),
             bench::fmt(1.0 / n, 3) + (mem_ok ? " (met)" : " (missed)")});
      std::printf("%s\n", t.str().c_str());
    }
    bench::Json jl = bench::Json::object();
    jl.set("params", total).set("state_replicated_bytes", rep_max).set("state_sharded_bytes", sh_max);
    if (memory_only) {
      jlists.set(list, jl);
      continue;
    }

    // --- time: whole steps, and the gradient sync alone -------------------------------------
    Model m_rep = make_model(shapes), m_sh = make_model(shapes), m_bd = make_model(shapes);
    // One gradient buffer for every variant (each fills it before it runs): the GPT-2 list
    // needs 0.5 GB per copy.
    ls::Flat<Model> grads = ls::flat_zeros_like(m_rep);
    ls::Flat<Model>&g_rep = grads, &g_sh = grads, &g_bd = grads, &g32 = grads, &g16 = grads;
    auto o_rep = ls::DistributedOptimizer(b, ls::Adam{.lr = 1e-4f});
    auto o_sh = ls::DistributedOptimizer(b, ls::Adam{.lr = 1e-4f}, ls::DistributedOptions{.shard_optimizer_state = true});
    auto s_rep = ls::setup(o_rep, m_rep);
    auto s_sh = ls::setup(o_sh, m_sh);
    // rescue_buddy: the same sharded step plus the copy of a buddy's shard (one allgather of one
    // block per step).
    auto o_bd = ls::DistributedOptimizer(
        b, ls::Adam{.lr = 1e-4f}, ls::DistributedOptions{.shard_optimizer_state = true, .rescue_buddy = true});
    auto s_bd = ls::setup(o_bd, m_bd);
    ls::GradientReducer r32(b, *g32), r16(b, *g16, ls::DistributedOptions{.wire_dtype = ls::DType::bf16});
    auto mean_ok = [&](ls::Flat<Model>& g, float tol) {
      // (i % 7 + rank) * 1e-3 averaged over the ranks.
      bool ok = true;
      for (ls::Tensor* t : ls::tensor_leaves(*g)) {
        const float* d = t->data<float>();
        for (std::int64_t i = 0; i < t->numel() && ok; i += 997)
        {
          const float want = 1e-3f * (static_cast<float>(i % 7) + 0.5f * static_cast<float>(n - 1));
          ok = std::abs(d[i] - want) <= tol * std::abs(want) + 1e-12f;
        }
      }
      return ok;
    };
    // The three passes, alone, over one 16-bit copy of all the gradients (in the reducer's slices
    // of the default bucket size, of f32, for the allreduce).
    ls::Tensor w16 = ls::Tensor::zeros({total}, ls::DType::bf16);
    const std::int64_t slice = static_cast<std::int64_t>(ls::host_bucket_bytes({}, b) / 4);
    auto leaves16 = ls::tensor_leaves(*grads);
    auto round_pass = [&] {
      std::int64_t at = 0;
      for (ls::Tensor* t : leaves16) {
        ls::detail::to_wire16(ls::DType::bf16, t->data<float>(), static_cast<std::uint16_t*>(w16.raw_data()) + at,
                              t->numel());
        at += t->numel();
      }
    };
    auto widen_pass = [&] {
      std::int64_t at = 0;
      for (ls::Tensor* t : leaves16) {
        ls::detail::from_wire16(ls::DType::bf16, static_cast<const std::uint16_t*>(w16.raw_data()) + at,
                                t->data<float>(), t->numel(), static_cast<float>(n));
        at += t->numel();
      }
    };
    std::vector<bench::Variant> vs;
    vs.push_back({"step, replicated", [&] { ls::update(s_rep, m_rep, *g_rep); }, [&] { fill_grads(g_rep, rank); },
                  [&] { return same_everywhere(b, hash_of(m_rep)); }});
    vs.push_back({"step, sharded (ZeRO-1)", [&] { ls::update(s_sh, m_sh, *g_sh); }, [&] { fill_grads(g_sh, rank); },
                  [&] { return same_everywhere(b, hash_of(m_sh)); }});
    vs.push_back({"gradient sync, f32", [&] { r32.reduce(); }, [&] { fill_grads(g32, rank); },
                  [&] { return mean_ok(g32, 1e-6f); }});
    vs.push_back({"gradient sync, bf16 on the wire", [&] { r16.reduce(); }, [&] { fill_grads(g16, rank); },
                  [&] { return mean_ok(g16, 2e-2f); }});  // bf16: 8 bits of mantissa
    vs.push_back({"  unfused pass 1: round into a 16-bit copy", round_pass, [&] { fill_grads(g16, rank); },
                  [] { return true; }});
    vs.push_back({"  unfused pass 2: 16-bit allreduce of the copy", [&] {
                    for (std::int64_t off = 0; off < total; off += slice)
                      b.allreduce(w16.view().slice(off, std::min(slice, total - off)), ls::ReduceOp::sum);
                  },
                  [] {}, [] { return true; }});
    vs.push_back({"  unfused pass 3: widen into f32, / N", widen_pass, [] {}, [] { return true; }});
    vs.push_back({"  unfused, all three passes", [&] {
                    round_pass();
                    for (std::int64_t off = 0; off < total; off += slice)
                      b.allreduce(w16.view().slice(off, std::min(slice, total - off)), ls::ReduceOp::sum);
                    widen_pass();
                  },
                  [&] { fill_grads(g16, rank); }, [&] { return mean_ok(g16, 2e-2f); }});
    const std::size_t first_sharded_part = vs.size();
    // Where a sharded step's time goes: its gradient reduction (a reduce-scatter per bucket) and
    // its parameter gather (an all-gather per bucket), alone.
    auto sh_params = ls::trainable_leaves(m_sh);
    vs.push_back({"  sharded: gradient reduce-scatter", [&] {
                    auto gs = ls::trainable_leaves(*g_sh);
                    ls::detail::ReducerSteps::bind(s_sh.reducer(), gs);
                    ls::detail::ReducerSteps::reduce_bound(s_sh.reducer());
                  },
                  [&] { fill_grads(g_sh, rank); }, [] { return true; }});
    vs.push_back({"  sharded: parameter gather", [&] { ls::detail::ReducerSteps::gather_shards(s_sh.reducer(), sh_params); }, [] {},
                  [&] { return same_everywhere(b, hash_of(m_sh)); }});
    const std::size_t buddy_at = vs.size();
    vs.push_back({"step, sharded + rescue_buddy", [&] { ls::update(s_bd, m_bd, *g_bd); }, [&] { fill_grads(g_bd, rank); },
                  [&] { return same_everywhere(b, hash_of(m_bd)); }});
    const int reps = opt.quick ? 1 : opt.reps;
    const auto res = bench::interleave(vs, reps, 1);
    bool ok = true;
    for (const auto& r : res) ok = ok && r.correct;
    // Sharded and replicated took the same steps from the same gradients: equal parameters
    // (bitwise: the shared-memory reduce-scatter adds in the allreduce's order; over MPI, up to
    // 2 ranks, where there is one addition).
    if (n <= 2 && !bench::all_ranks(hash_of(m_rep) == hash_of(m_sh))) {
      ok = false;
      if (rank == 0) std::fprintf(stderr, "bench_scale: sharded and replicated parameters differ\n");
    }
    all_ok = all_ok && ok;
    const double t_rep = res[0].s.min, t_sh = res[1].s.min, t32 = res[2].s.min, t16 = res[3].s.min;
    if (rank == 0) {
      bench::Table t({"variant", "min", "median", "vs reference", "target", "correct"});
      t.add({res[0].name, bench::fmt(t_rep * 1e3, 1) + " ms", bench::fmt(res[0].s.median * 1e3, 1) + " ms", "1.00 (ref)", "",
             res[0].correct ? "yes" : "NO"});
      t.add({res[1].name, bench::fmt(t_sh * 1e3, 1) + " ms", bench::fmt(res[1].s.median * 1e3, 1) + " ms",
             bench::fmt(t_sh / t_rep, 2) + "x", t_sh / t_rep <= 1.0 ? "<= 1.0x (met)" : "<= 1.0x (missed)",
             res[1].correct ? "yes" : "NO"});
      t.add({res[2].name, bench::fmt(t32 * 1e3, 1) + " ms", bench::fmt(res[2].s.median * 1e3, 1) + " ms", "1.00 (ref)", "",
             res[2].correct ? "yes" : "NO"});
      t.add({res[3].name, bench::fmt(t16 * 1e3, 1) + " ms", bench::fmt(res[3].s.median * 1e3, 1) + " ms",
             bench::fmt(t16 / t32, 2) + "x", t16 / t32 <= 0.6 ? "<= 0.6x (met)" : "<= 0.6x (missed)",
             res[3].correct ? "yes" : "NO"});
      for (std::size_t k = 4; k < first_sharded_part; ++k)
        t.add({res[k].name, bench::fmt(res[k].s.min * 1e3, 1) + " ms", bench::fmt(res[k].s.median * 1e3, 1) + " ms",
               bench::fmt(res[k].s.min / t32, 2) + "x of the f32 sync", "", res[k].correct ? "yes" : "NO"});
      for (std::size_t k = first_sharded_part; k < res.size(); ++k)
        t.add({res[k].name, bench::fmt(res[k].s.min * 1e3, 1) + " ms", bench::fmt(res[k].s.median * 1e3, 1) + " ms",
               bench::fmt(res[k].s.min / t_rep, 2) + "x of a replicated step", "", res[k].correct ? "yes" : "NO"});
      std::printf("%s\n", t.str().c_str());
      std::fflush(stdout);
    }
    jl.set("step_replicated_s", t_rep).set("step_sharded_s", t_sh).set("sync_f32_s", t32).set("sync_bf16_s", t16);
    jl.set("unfused_round_s", res[4].s.min).set("unfused_allreduce16_s", res[5].s.min).set("unfused_widen_s", res[6].s.min);
    jl.set("sync_bf16_unfused_s", res[7].s.min).set("step_sharded_buddy_s", res[buddy_at].s.min);
    jlists.set(list, jl);
  }
  bench::Json::object().set("ranks", n).set("lists", jlists).write(opt.json);
  if (!bench::all_ranks(all_ok)) {
    if (rank == 0) std::fprintf(stderr, "bench_scale: a result was wrong\n");
    return 1;
  }
  return 0;
}
