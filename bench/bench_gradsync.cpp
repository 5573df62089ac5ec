// bench_gradsync: time to average the gradients of ResNet-50 and GPT-2 small across ranks,
// Lockstep against every raw MPI strategy, interleaved in the same run:
//   separate tensors: one MPI_Allreduce per tensor; pack all + one allreduce + unpack;
//                     25 MiB buckets (pack, allreduce, unpack: DDP's default size);
//   flat gradients:   one MPI_Allreduce per tensor (views); one allreduce over the whole buffer;
//                     25 MiB slices.
// The best raw time is the reference. Every raw strategy averages (sum, then x 1/n folded into
// the cheapest place: right after each in-cache reduction, or into the unpack copy).
// Then a sweep of the bucket / chunk size shows where the time goes and where the optimum is.
// Every repetition starts from rank-dependent gradients and checks every element afterwards.
//
// Run: mpiexec -n 2 ./bench_gradsync [--json out.json] [--reps 5] [--lists resnet50,gpt2_small]
//      [--sweep-list resnet50] [--check-level LEVEL] [--quick]
// --check-level sets LOCKSTEP_CHECK for the run (the reliability checks' cost); the variable
// set in the environment works too, and is recorded in the JSON.
#include <lockstep/lockstep.hpp>

#include <cmath>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>

#include "bench_common.hpp"
#include "gradsync_strategies.hpp"
#include <lockstep/train/distributed_optimizer.hpp>
#include <lockstep/reliability/settings.hpp>

namespace ls = lockstep;

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kKiB = std::size_t{1} << 10;

// Gradients of one model in two layouts: separate tensors, and one flat buffer with views.
struct ModelGrads {
  std::string list;
  std::vector<bench::Param> params;
  std::vector<ls::Tensor> sep;
  std::vector<ls::TensorView> sep_views;
  ls::Tensor flat;
  std::vector<ls::TensorView> flat_views;
  std::unique_ptr<float[]> staging;  // pack buffer, as large as the whole model
  std::int64_t total = 0;

  explicit ModelGrads(const std::string& name) : list(name) {
    params = bench::read_shapes(bench::shapes_dir() + "/" + name + ".txt");
    for (auto& p : params) total += p.numel;
    for (auto& p : params) {
      sep.emplace_back(ls::Shape{p.numel});
      sep_views.push_back(sep.back().view());
    }
    flat = ls::Tensor(ls::Shape{total});
    std::int64_t off = 0;
    for (auto& p : params) {
      flat_views.push_back(flat.view().slice(off, p.numel));
      off += p.numel;
    }
    staging.reset(new float[static_cast<std::size_t>(total)]);
    std::fill(staging.get(), staging.get() + total, 0.0f);  // first touch outside the timing
  }
  std::size_t bytes() const { return static_cast<std::size_t>(total) * 4; }
};

// Rank r's gradient element at global index i; the average over n ranks is (i % 7) + (n-1)/2.
inline float grad_value(int rank, std::int64_t i) { return static_cast<float>(i % 7 + rank); }

void fill(std::span<const ls::TensorView> ts, int rank) {
  std::int64_t base = 0;
  for (const auto& t : ts) {
    float* p = static_cast<float*>(t.data);
    for (std::int64_t i = 0; i < t.numel; ++i) p[i] = grad_value(rank, base + i);
    base += t.numel;
  }
}
bool verify(std::span<const ls::TensorView> ts, int n) {
  std::int64_t base = 0;
  const float shift = static_cast<float>(n - 1) / 2.0f;
  for (const auto& t : ts) {
    const float* p = static_cast<const float*>(t.data);
    for (std::int64_t i = 0; i < t.numel; ++i) {
      const float want = static_cast<float>((base + i) % 7) + shift;
      if (std::fabs(p[i] - want) > 1e-5f * (1.0f + want)) return false;
    }
    base += t.numel;
  }
  return true;
}

std::string size_label(std::size_t b) { return bench::human_bytes(static_cast<double>(b)); }

// DistributedOptimizer's gradient averaging alone: a state set up over tensors that borrow the
// given gradients (the rule is momentum-free SGD, which keeps no state), timed as update() runs
// it: bind the gradients, reduce them. The optimizer rule itself is not part of the time.
class DistAverage {
 public:
  // bucket_bytes unset: the reducer's default for the path.
  // deterministic: DistributedOptions::deterministic. Its result is in the reducer's own tensors
  // (which the optimizer rule reads), not in the given gradients: reduced_views() are the views
  // to check, as a training step leaves them (no copy back in the time).
  DistAverage(ls::Backend& be, std::span<const ls::TensorView> views, std::optional<std::size_t> bucket_bytes,
              bool deterministic = false)
      : deterministic_(deterministic) {
    for (const auto& v : views) grads_.push_back(ls::Tensor::borrow(v.data, {v.numel}, v.dtype, v.device));
    ls::DistributedOptions o;
    o.bucket_bytes = bucket_bytes;
    o.deterministic = deterministic;
    state_ = std::make_unique<ls::DistributedState<ls::SGD>>(ls::setup(ls::DistributedOptimizer(be, ls::SGD{}, o), grads_));
    ptrs_ = ls::trainable_leaves(grads_);
  }
  void run() {
    auto& red = state_->reducer();
    ls::detail::ReducerSteps::bind(red, ptrs_);
    const auto& reduced = ls::detail::ReducerSteps::reduce_bound(red);
    if (deterministic_ && reduced_.empty())
      for (const ls::Tensor* t : reduced) reduced_.push_back(t->view());
  }
  /// The reduced gradients of deterministic mode (after the first run).
  std::span<const ls::TensorView> reduced_views() const { return reduced_; }
  std::size_t buckets() const { return state_->reducer().bucket_count(); }

 private:
  std::vector<ls::Tensor> grads_;
  std::unique_ptr<ls::DistributedState<ls::SGD>> state_;
  std::vector<ls::Tensor*> ptrs_;
  bool deterministic_ = false;
  std::vector<ls::TensorView> reduced_;
};

}  // namespace

int main(int argc, char** argv) {
  bench::Options opt("bench_gradsync", "averaging the gradients of ResNet-50 and GPT-2 small: Lockstep against raw MPI strategies");
  std::vector<std::string> lists = {"resnet50", "gpt2_small"};
  std::string sweep_list = "resnet50", check_level, only;
  std::size_t default_chunk = 4 * kMiB;
  auto* lists_flag = opt.app.add_option("--lists", lists, "shape lists to time (resnet50 with --quick)")
                         ->type_name("A,B")->delimiter(',');
  opt.app.add_option("--sweep-list", sweep_list, "shape list of the bucket-size sweep (all: every list)")
      ->type_name("LIST");
  opt.app.add_option("--check-level", check_level, "set LOCKSTEP_CHECK for the run")->type_name("LEVEL");
  opt.app.add_option("--only", only, "time only the Lockstep rows whose name contains TEXT (and the raw rows); "
                     "no breakdown or sweep")->type_name("TEXT");
  opt.app.add_option("--chunk-bytes", default_chunk, "chunk size of the chunked MPIBackend variant")
      ->type_name("BYTES")->check(lockstep_cli::at_least(4));
  // Parsed before initialise (every rank gets the same argv, so every rank decides alike), so
  // that whatever reads LOCKSTEP_CHECK at start-up sees --check-level.
  if (const auto rc = opt.parse(argc, argv)) return *rc;
  opt.quick_default(lists, lists_flag, std::vector<std::string>{"resnet50"});
  if (!check_level.empty()) setenv("LOCKSTEP_CHECK", check_level.c_str(), 1);
  ls::initialize<ls::MPIBackend>();
  auto& be = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = be.rank(), n = be.size();
  const float inv = 1.0f / static_cast<float>(n);
  MPI_Comm comm = be.comm();
  const int reps = opt.quick_reps();

  bench::Json jlists = bench::Json::array();
  bool all_ok = true;
  for (const auto& list : lists) {
    ModelGrads g(list);
    std::span<const ls::TensorView> sep(g.sep_views), fv(g.flat_views);
    const ls::TensorView flat_all = g.flat.view();
    float* flat = g.flat.data<float>();
    float* staging = g.staging.get();
    // The same flat layout in memory from allocate_reduce_buffer (collective: every rank).
    std::shared_ptr<void> rmem = be.allocate_reduce_buffer(g.bytes());
    std::vector<ls::TensorView> rviews;
    {
      std::int64_t off = 0;
      for (auto& p : g.params) {
        rviews.push_back(ls::TensorView{static_cast<float*>(rmem.get()) + off, p.numel, ls::DType::f32, ls::Device::cpu()});
        off += p.numel;
      }
    }
    std::span<const ls::TensorView> rv(rviews);
    if (rank == 0)
      std::printf("\n# Gradient averaging: %s, %zu tensors, %s f32, %d ranks\n", list.c_str(),
                  g.params.size(), bench::human_bytes(static_cast<double>(g.bytes())).c_str(), n);

    auto sep_variant = [&](std::string name, std::function<void()> body) {
      return bench::Variant{std::move(name), std::move(body), [&] { fill(sep, rank); },
                            [&] { return verify(sep, n); }};
    };
    auto flat_variant = [&](std::string name, std::function<void()> body) {
      return bench::Variant{std::move(name), std::move(body), [&] { fill(fv, rank); },
                            [&] { return verify(fv, n); }};
    };
    const std::size_t direct = default_chunk / 4;
    auto sep_or_flat = [&](bool f, std::string name, std::function<void()> body) {
      return f ? flat_variant(std::move(name), std::move(body)) : sep_variant(std::move(name), std::move(body));
    };

    // --- The head-to-head comparison, separate tensors and flat buffer -------------------------
    bench::Json jcmp = bench::Json::object();
    for (const bool is_flat : {false, true}) {
      std::vector<bench::Variant> vs;
      if (!is_flat) {
        vs.push_back(sep_variant("raw: allreduce per tensor", [&] { bench::raw_per_tensor(sep, comm, inv); }));
        vs.push_back(sep_variant("raw: pack + one allreduce + unpack",
                                 [&] { bench::raw_pack_buckets(sep, g.bytes(), staging, comm, inv); }));
        vs.push_back(sep_variant("raw: 25 MiB buckets",
                                 [&] { bench::raw_pack_buckets(sep, 25 * kMiB, staging, comm, inv); }));
      } else {
        vs.push_back(flat_variant("raw: allreduce per tensor", [&] { bench::raw_per_tensor(fv, comm, inv); }));
        vs.push_back(flat_variant("raw: one allreduce",
                                  [&] { bench::raw_flat_slices(flat, g.total, g.bytes(), comm, inv); }));
        vs.push_back(flat_variant("raw: 25 MiB slices",
                                  [&] { bench::raw_flat_slices(flat, g.total, 25 * kMiB, comm, inv); }));
      }
      const std::size_t n_raw = vs.size();
      // Lockstep: DistributedOptimizer's averaging with its default bucket size, and the chunked
      // design over MPIBackend (a proposal; see docs/performance.md).
      // The default bucket size: kDefaultBucketBytes on one machine, kDefaultNetworkBucketBytes
      // when the ranks span machines (the reducer's choice).
      auto dist = std::make_shared<DistAverage>(be, is_flat ? fv : sep, std::nullopt);
      {
        const std::size_t dflt = ls::host_bucket_bytes({}, be);
        const std::string name = "lockstep: DistributedOptimizer (" + size_label(dflt) +
                                 " buckets, " + std::to_string(dist->buckets()) + ")";
        auto body = [dist] { dist->run(); };
        vs.push_back(sep_or_flat(is_flat, name, body));
        // The cost of the collective fingerprint checks, in the same run: the same averaging with
        // LOCKSTEP_CHECK=always for this call only (the level is process-wide, set on every rank).
        if (ls::check_level() != ls::CheckLevel::always) {
          const ls::CheckLevel base = ls::check_level();
          vs.push_back(sep_or_flat(is_flat, name + ", LOCKSTEP_CHECK=always", [dist, base] {
            ls::set_check_level(ls::CheckLevel::always);
            dist->run();
            ls::set_check_level(base);
          }));
        }
      }
      // Deterministic mode (exact sums, issue 42): its cost beside the ordinary averaging.
      {
        auto det = std::make_shared<DistAverage>(be, is_flat ? fv : sep, std::nullopt, true);
        vs.push_back(bench::Variant{"lockstep: DistributedOptimizer deterministic", [det] { det->run(); },
                                    [&, is_flat] { fill(is_flat ? fv : sep, rank); },
                                    [det, n] { return verify(det->reduced_views(), n); }});
      }
      // The flat gradients again, in memory from allocate_reduce_buffer: on the shared-memory
      // path each bucket is reduced where it lies on every rank (no copy through the slots).
      if (is_flat && be.shared_memory()) {
        const std::size_t dflt = ls::host_bucket_bytes({}, be);
        auto rdist = std::make_shared<DistAverage>(be, rv, std::nullopt);
        vs.push_back(bench::Variant{"lockstep: reduce buffer, DistributedOptimizer (" + size_label(dflt) + " buckets, " +
                                        std::to_string(rdist->buckets()) + ")",
                                    [rdist] { rdist->run(); }, [&] { fill(rv, rank); },
                                    [&] { return verify(rv, n); }});
      }
      const std::string chunk_name = "lockstep: chunked " + size_label(default_chunk) + " (MPIBackend)";
      if (!is_flat)
        vs.push_back(sep_variant(chunk_name, [&] { bench::lockstep_chunked(be, sep, default_chunk, direct, staging); }));
      else
        vs.push_back(flat_variant(chunk_name, [&] {
          const ls::TensorView one[1] = {flat_all};
          bench::lockstep_chunked(be, one, default_chunk, direct, staging);
        }));

      if (!only.empty())  // the raw rows stay: the ratios need them
        vs.erase(std::remove_if(vs.begin() + static_cast<std::ptrdiff_t>(n_raw), vs.end(),
                                [&](const bench::Variant& v) { return v.name.find(only) == std::string::npos; }),
                 vs.end());
      auto m = bench::interleave(vs, reps, 1, comm);
      double best_raw = 1e300;
      std::string best_name;
      for (std::size_t k = 0; k < n_raw; ++k)
        if (m[k].s.median < best_raw) {
          best_raw = m[k].s.median;
          best_name = m[k].name;
        }
      if (rank == 0)
        std::printf("\n## %s, %s (median of %d; ratio = time / best raw median)\n\n", list.c_str(),
                    is_flat ? "flat gradients (one buffer)" : "separate tensors", reps);
      bench::Table t({"strategy", "median ms", "min ms", "GB/s (algbw)", "ratio to best raw", "correct"});
      bench::Json jrows = bench::Json::array();
      for (auto& r : m) {
        all_ok = all_ok && r.correct;
        t.add({r.name, bench::fmt(r.s.median * 1e3, 2), bench::fmt(r.s.min * 1e3, 2),
               bench::fmt(static_cast<double>(g.bytes()) / r.s.median / 1e9, 2),
               bench::fmt(r.s.median / best_raw, 3), r.correct ? "yes" : "NO"});
        bench::Json j = bench::Json::object();
        j.set("strategy", r.name).set("median_s", r.s.median).set("min_s", r.s.min)
            .set("ratio_to_best_raw", r.s.median / best_raw).set("correct", r.correct)
            .set("raw", static_cast<std::size_t>(&r - m.data()) < n_raw);
        jrows.push(j);
      }
      t.print();
      jcmp.set(is_flat ? "flat" : "separate",
               bench::Json::object().set("best_raw", best_name).set("best_raw_median_s", best_raw).set("rows", jrows));
    }

    // --- Breakdown of pack + one allreduce + unpack (separate tensors) -------------------------
    if (only.empty()) {
      std::vector<bench::Variant> vs;
      vs.push_back({"pack (memcpy into one buffer)", [&] {
                      std::int64_t off = 0;
                      for (auto& t : sep) {
                        std::memcpy(staging + off, t.data, t.nbytes());
                        off += t.numel;
                      }
                    }});
      vs.push_back({"one MPI_Allreduce of the whole buffer", [&] { bench::raw_allreduce(staging, g.total, comm); }});
      vs.push_back({"unpack with x 1/n", [&] {
                      std::int64_t off = 0;
                      for (auto& t : sep) {
                        bench::copy_scaled(static_cast<float*>(t.data), staging + off, t.numel, inv);
                        off += t.numel;
                      }
                    }});
      vs.push_back({"scale pass x 1/n over the flat buffer", [&] { bench::scale(flat, g.total, inv); }});
      auto m = bench::interleave(vs, reps, 1, comm);
      if (rank == 0) std::printf("\n## %s: where the time of pack + one allreduce + unpack goes\n\n", list.c_str());
      bench::Table t({"part", "median ms", "min ms", "GB/s"});
      bench::Json jb = bench::Json::array();
      for (auto& r : m) {
        t.add({r.name, bench::fmt(r.s.median * 1e3, 2), bench::fmt(r.s.min * 1e3, 2),
               bench::fmt(static_cast<double>(g.bytes()) / r.s.median / 1e9, 2)});
        jb.push(bench::Json::object().set("part", r.name).set("median_s", r.s.median).set("min_s", r.s.min));
      }
      t.print();
      jcmp.set("breakdown", jb);
    }

    // --- Sweep of the bucket / chunk size ------------------------------------------------------
    if (only.empty() && (list == sweep_list || sweep_list == "all")) {
      std::vector<std::size_t> sizes;
      // Denser where the optimum is expected (a few MiB: cache-sized pieces), then 32 MiB.
      sizes = {256 * kKiB, 512 * kKiB, 1 * kMiB, 2 * kMiB, 4 * kMiB, 8 * kMiB, 32 * kMiB};
      if (opt.quick) sizes = {256 * kKiB, 1 * kMiB, 4 * kMiB, 16 * kMiB};
      bench::Table t({"bucket/chunk", "raw pack buckets (sep)", "raw flat slices (flat)",
                      "DistributedOptimizer (sep)", "DistributedOptimizer (flat)", "chunked (sep)",
                      "chunked (flat)"});
      bench::Json js = bench::Json::array();
      for (std::size_t c : sizes) {
        std::vector<bench::Variant> vs;
        // Exactly c: a bucket_bytes set is kept on every path.
        auto dsep = std::make_shared<DistAverage>(be, sep, c);
        auto dflat = std::make_shared<DistAverage>(be, fv, c);
        vs.push_back(sep_variant("pack", [&, c] { bench::raw_pack_buckets(sep, c, staging, comm, inv); }));
        vs.push_back(flat_variant("slices", [&, c] { bench::raw_flat_slices(flat, g.total, c, comm, inv); }));
        vs.push_back(sep_variant("dist-sep", [dsep] { dsep->run(); }));
        vs.push_back(flat_variant("dist-flat", [dflat] { dflat->run(); }));
        vs.push_back(sep_variant("ls-sep", [&, c] { bench::lockstep_chunked(be, sep, c, c / 4, staging); }));
        vs.push_back(flat_variant("ls-flat", [&, c] {
          const ls::TensorView one[1] = {flat_all};
          bench::lockstep_chunked(be, one, c, c / 4, staging);
        }));
        auto m = bench::interleave(vs, std::max(3, reps - 2), 1, comm);
        for (auto& r : m) all_ok = all_ok && r.correct;
        std::vector<std::string> row{size_label(c)};
        for (auto& r : m) row.push_back(bench::fmt(r.s.median * 1e3, 2) + (r.correct ? "" : " WRONG"));
        t.add(row);
        js.push(bench::Json::object()
                    .set("bytes", static_cast<std::int64_t>(c))
                    .set("raw_pack_buckets_s", m[0].s.median)
                    .set("raw_flat_slices_s", m[1].s.median)
                    .set("distributed_optimizer_separate_s", m[2].s.median)
                    .set("distributed_optimizer_flat_s", m[3].s.median)
                    .set("chunked_separate_s", m[4].s.median)
                    .set("chunked_flat_s", m[5].s.median)
                    .set("distributed_optimizer_buckets", static_cast<std::int64_t>(dsep->buckets())));
        if (rank == 0) std::fprintf(stderr, "  sweep %s done\n", size_label(c).c_str());
      }
      if (rank == 0)
        std::printf("\n## %s: time (ms) against bucket / chunk size (median of %d; sep = separate tensors, "
                    "flat = one buffer)\n\n", list.c_str(), std::max(3, reps - 2));
      t.print();
      jcmp.set("sweep", js);
    }
    jcmp.set("list", list).set("tensors", static_cast<int>(g.params.size())).set("bytes", static_cast<std::int64_t>(g.bytes()));
    jlists.push(jcmp);
  }

  bench::Json doc = bench::run_info("gradsync");
  doc.set("reps", reps).set("default_chunk_bytes", static_cast<std::int64_t>(default_chunk))
      .set("all_correct", all_ok).set("lists", jlists);
  doc.write(opt.json);
  if (rank == 0 && !all_ok) std::fprintf(stderr, "bench_gradsync: WRONG RESULTS (see tables)\n");
  return all_ok ? 0 : 1;
}
