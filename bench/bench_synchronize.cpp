// bench_synchronize: ls::synchronize of a model and its Adam state (parameters, both moments and
// the step count) for the ResNet-50 and GPT-2 small shape lists, against the raw MPI_Bcast
// strategies a hand-written program would use, interleaved in the same run:
//   raw: one MPI_Bcast per tensor (and one for the step count);
//   raw: pack everything on the root + one MPI_Bcast + unpack on the others.
// Two layouts: separate tensors (each its own allocation), and flat (the model and the state
// each in one allocation, tensors back to back, as ls::flat_copy makes them).
// Every repetition starts from different values on every rank and checks every byte afterwards.
//
// Run: mpiexec -n 2 ./bench_synchronize [--json out.json] [--reps 5] [--lists resnet50,gpt2_small]
//      [--flat-lists resnet50] [--quick]
#include <lockstep/lockstep.hpp>
#include <lockstep/train/rules.hpp>
#include <lockstep/train/synchronize.hpp>

#include <cstring>
#include <tuple>

#include "bench_common.hpp"

namespace ls = lockstep;

namespace {

using Model = std::vector<ls::Tensor>;
using State = ls::OptState<ls::Adam>;

// The byte ranges of every leaf: parameters, moments, then the step count.
std::vector<ls::TensorView> leaves_of(Model& m, State& s) {
  std::vector<ls::TensorView> out;
  for (auto& t : m) out.push_back(t.view());
  for (auto& sl : s.slots) {
    out.push_back(sl.exp_avg.view());
    out.push_back(sl.exp_avg_sq.view());
  }
  out.push_back(ls::TensorView{&s.step, 1, ls::DType::i64, ls::Device::cpu()});
  return out;
}

// Root holds the pattern, the others hold something else.
float value(int rank, std::int64_t i) { return rank == 0 ? static_cast<float>(i % 101) * 0.25f : -1.0f; }

void fill(const std::vector<ls::TensorView>& ls_, int rank) {
  std::int64_t base = 0;
  for (auto& v : ls_) {
    if (v.dtype == ls::DType::i64) {
      *static_cast<std::int64_t*>(v.data) = rank == 0 ? 1234 : 0;
      continue;
    }
    float* p = static_cast<float*>(v.data);
    for (std::int64_t i = 0; i < v.numel; ++i) p[i] = value(rank, base + i);
    base += v.numel;
  }
}
bool verify(const std::vector<ls::TensorView>& ls_) {
  std::int64_t base = 0;
  for (auto& v : ls_) {
    if (v.dtype == ls::DType::i64) {
      if (*static_cast<std::int64_t*>(v.data) != 1234) return false;
      continue;
    }
    const float* p = static_cast<const float*>(v.data);
    for (std::int64_t i = 0; i < v.numel; ++i)
      if (p[i] != value(0, base + i)) return false;
    base += v.numel;
  }
  return true;
}

void raw_per_tensor(const std::vector<ls::TensorView>& leaves, MPI_Comm comm) {
  for (auto& v : leaves)
    MPI_Bcast(v.data, static_cast<int>(v.nbytes()), MPI_BYTE, 0, comm);
}
void raw_one_buffer(const std::vector<ls::TensorView>& leaves, std::byte* staging, std::size_t total,
                    int rank, MPI_Comm comm) {
  if (rank == 0) {
    std::size_t off = 0;
    for (auto& v : leaves) {
      std::memcpy(staging + off, v.data, v.nbytes());
      off += v.nbytes();
    }
  }
  // Counts above INT_MAX bytes go in pieces (GPT-2's model + state is 1.4 GiB).
  constexpr std::size_t kPiece = std::size_t{1} << 30;
  for (std::size_t off = 0; off < total; off += kPiece)
    MPI_Bcast(staging + off, static_cast<int>(std::min(kPiece, total - off)), MPI_BYTE, 0, comm);
  if (rank != 0) {
    std::size_t off = 0;
    for (auto& v : leaves) {
      std::memcpy(v.data, staging + off, v.nbytes());
      off += v.nbytes();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  bench::Options opt("bench_synchronize", "ls::synchronize of a model and its Adam state against raw MPI_Bcast strategies");
  std::vector<std::string> lists = {"resnet50", "gpt2_small"}, flat_lists = {"resnet50"};
  auto* lists_flag = opt.app.add_option("--lists", lists, "shape lists, separate tensors (resnet50 with --quick)")
                         ->type_name("A,B")->delimiter(',');
  opt.app.add_option("--flat-lists", flat_lists, "shape lists, flat layout")->type_name("A,B")->delimiter(',');
  if (const auto rc = opt.parse(argc, argv)) return *rc;
  opt.quick_default(lists, lists_flag, std::vector<std::string>{"resnet50"});
  auto& be = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = be.rank(), n = be.size();
  MPI_Comm comm = be.comm();
  const int reps = opt.quick_reps();

  bench::Json jall = bench::Json::array();
  bool all_ok = true;
  for (const auto& list : lists) {
    const auto params = bench::read_shapes(bench::shapes_dir() + "/" + list + ".txt");
    for (const bool flat : {false, true}) {
      if (flat && std::find(flat_lists.begin(), flat_lists.end(), list) == flat_lists.end()) continue;
      Model model;
      for (auto& p : params) model.push_back(ls::Tensor::zeros({p.numel}));
      State state = ls::setup(ls::Adam{}, model);
      // The flat layout: the same structures, re-allocated back to back.
      ls::Flat<Model> fmodel;
      ls::Flat<State> fstate;
      Model* m = &model;
      State* s = &state;
      if (flat) {
        fmodel = ls::flat_copy(model);
        fstate = ls::flat_copy(state);
        model.clear();
        state.slots.clear();
        m = &fmodel.get();
        s = &fstate.get();
      }
      const auto leaves = leaves_of(*m, *s);
      std::size_t total = 0;
      for (auto& v : leaves) total += v.nbytes();
      std::vector<std::byte> staging(total);

      auto variant = [&](std::string name, std::function<void()> body) {
        return bench::Variant{std::move(name), std::move(body), [&] { fill(leaves, rank); },
                              [&] { return verify(leaves); }};
      };
      std::vector<bench::Variant> vs;
      vs.push_back(variant("raw: MPI_Bcast per tensor", [&] { raw_per_tensor(leaves, comm); }));
      vs.push_back(variant("raw: pack + one MPI_Bcast + unpack",
                           [&] { raw_one_buffer(leaves, staging.data(), total, rank, comm); }));
      vs.push_back(variant("lockstep: synchronize(model, state)", [&] { ls::synchronize(be, std::tie(*m, *s), 0); }));
      auto res = bench::interleave(vs, reps, 1, comm);
      const double best_raw = std::min(res[0].s.median, res[1].s.median);

      if (rank == 0)
        std::printf("\n## synchronize: %s model + Adam state, %s, %s, %d ranks (median of %d)\n\n", list.c_str(),
                    flat ? "flat (back to back)" : "separate tensors",
                    bench::human_bytes(static_cast<double>(total)).c_str(), n, reps);
      bench::Table t({"strategy", "median ms", "min ms", "GB/s", "ratio to best raw", "correct"});
      bench::Json jrows = bench::Json::array();
      for (auto& r : res) {
        all_ok = all_ok && r.correct;
        t.add({r.name, bench::fmt(r.s.median * 1e3, 2), bench::fmt(r.s.min * 1e3, 2),
               bench::fmt(static_cast<double>(total) / r.s.median / 1e9, 2), bench::fmt(r.s.median / best_raw, 3),
               r.correct ? "yes" : "NO"});
        jrows.push(bench::Json::object()
                       .set("strategy", r.name)
                       .set("median_s", r.s.median)
                       .set("min_s", r.s.min)
                       .set("ratio_to_best_raw", r.s.median / best_raw)
                       .set("correct", r.correct));
      }
      t.print();
      jall.push(bench::Json::object()
                    .set("list", list)
                    .set("layout", flat ? "flat" : "separate")
                    .set("bytes", static_cast<std::int64_t>(total))
                    .set("leaves", static_cast<int>(leaves.size()))
                    .set("best_raw_median_s", best_raw)
                    .set("rows", jrows));
    }
  }
  bench::Json doc = bench::run_info("synchronize");
  doc.set("reps", reps).set("all_correct", all_ok).set("cases", jall);
  doc.write(opt.json);
  if (rank == 0 && !all_ok) std::fprintf(stderr, "bench_synchronize: WRONG RESULTS (see tables)\n");
  return all_ok ? 0 : 1;
}
