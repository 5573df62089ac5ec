// bench_optimizer: one optimizer step (Lockstep's Adam, AdamW and SGD with momentum, through the
// public setup/update API) over 1M, 10M and 50M f32 parameters held as one tensor and over the
// ResNet-50 list, in GB/s counting the bytes a step must move (Adam: read p, g, m, v and write
// p, m, v = 28 B/param; SGD with momentum: read p, g, buf and write p, buf = 20 B/param), beside
// a memcpy that moves the same number of bytes (copying half of them: every copied byte is read
// once and written once), measured interleaved in the same run. On 1 and on 2 threads.
//
// Lockstep's CPU update is single-threaded, so the 2-thread case splits the model in two halves
// (a one-tensor model becomes two tensors of half the size; a list is cut where half of its bytes
// lie) and runs ls::update on each half from its own thread (std::thread, one persistent worker
// beside the main thread). memcpy is split the same way. This is how a caller gets two cores
// working on one step today; the library itself does not spread one update over threads.
//
// A third column, "stream", runs a loop with the rule's exact memory access pattern and no
// arithmetic to speak of (Adam: p += g, m += g, v += g; SGD: p += g, buf += g): the bandwidth an
// in-place update can reach at best. It differs from memcpy because a copy into a separate
// destination may pay write-allocate reads that an in-place update does not.
//
// Run: ./bench_optimizer [--json out.json] [--reps 5] [--quick]   (mpiexec -n 1 works too)
#include <lockstep/lockstep.hpp>
#include <lockstep/train/rules.hpp>

#include <barrier>
#include <cstring>
#include <thread>

#include "bench_common.hpp"

namespace ls = lockstep;

namespace {

// Runs two tasks at once: one on a persistent worker thread, one on the caller's thread.
class TwoThreads {
 public:
  TwoThreads() : sync_(2), worker_([this] { loop(); }) {}
  ~TwoThreads() {
    stop_ = true;
    sync_.arrive_and_wait();
    worker_.join();
  }
  void run(const std::function<void()>& mine, const std::function<void()>& theirs) {
    task_ = &theirs;
    sync_.arrive_and_wait();  // start
    mine();
    sync_.arrive_and_wait();  // both done
  }

 private:
  void loop() {
    for (;;) {
      sync_.arrive_and_wait();
      if (stop_) return;
      (*task_)();
      sync_.arrive_and_wait();
    }
  }
  std::barrier<> sync_;
  const std::function<void()>* task_ = nullptr;
  bool stop_ = false;
  std::thread worker_;
};

// Parameter sizes of one half of a model.
using Sizes = std::vector<std::int64_t>;

// Splits a list of sizes into `parts` pieces of about equal bytes (one tensor may be cut in two).
std::vector<Sizes> split(const Sizes& all, int parts) {
  if (parts == 1) return {all};
  std::int64_t total = 0;
  for (auto s : all) total += s;
  std::vector<Sizes> out(2);
  std::int64_t acc = 0;
  const std::int64_t half = total / 2;
  for (auto s : all) {
    if (acc >= half) out[1].push_back(s);
    else if (acc + s <= half) out[0].push_back(s);
    else {  // cut this tensor where the halves meet
      out[0].push_back(half - acc);
      out[1].push_back(s - (half - acc));
    }
    acc += s;
  }
  return out;
}

// One half's model, gradients and optimizer state, for rule R.
template <class R>
struct Part {
  std::vector<ls::Tensor> model, grads;
  ls::OptState<R> state;
  Part(const Sizes& sizes, const R& rule) {
    for (auto n : sizes) {
      model.push_back(ls::Tensor::full({n}, 0.5));
      grads.push_back(ls::Tensor::full({n}, 1e-3));
    }
    state = ls::setup(rule, model);
  }
  void step() { ls::update(state, model, grads); }
};

struct Result {
  std::string rule, layout;
  std::int64_t params;
  int threads;
  double bytes_moved;
  bench::Stats lockstep, copy, stream;
};

// The rule's access pattern without its arithmetic, over n elements of `arrays` floats each
// (4 arrays: Adam's p, g, m, v; 3 arrays: SGD's p, g, buf), element range [lo, hi).
void stream_kernel(float* base, std::int64_t n, int arrays, std::int64_t lo, std::int64_t hi) {
  float* __restrict__ p = base;
  const float* __restrict__ g = base + n;
  float* __restrict__ a = base + 2 * n;
  if (arrays == 4) {
    float* __restrict__ b = base + 3 * n;
    for (std::int64_t i = lo; i < hi; ++i) {
      p[i] += g[i];
      a[i] += g[i];
      b[i] += g[i];
    }
  } else {
    for (std::int64_t i = lo; i < hi; ++i) {
      p[i] += g[i];
      a[i] += g[i];
    }
  }
}

template <class R>
Result measure(const std::string& rule_name, const R& rule, int bytes_per_param, const std::string& layout,
               const Sizes& sizes, int threads, int reps, TwoThreads& pool, char* src, char* dst) {
  std::int64_t params = 0;
  for (auto s : sizes) params += s;
  const auto halves = split(sizes, threads);
  std::vector<std::unique_ptr<Part<R>>> parts;
  for (auto& h : halves) parts.push_back(std::make_unique<Part<R>>(h, rule));

  const double moved = static_cast<double>(params) * bytes_per_param;
  const std::size_t copy_bytes = static_cast<std::size_t>(moved / 2);  // read once + written once
  const std::size_t copy_half = copy_bytes / 2;

  bench::Variant lock{"lockstep", [&] {
                        if (threads == 1) parts[0]->step();
                        else pool.run([&] { parts[0]->step(); }, [&] { parts[1]->step(); });
                      }};
  bench::Variant copy{"memcpy", [&] {
                        if (threads == 1) std::memcpy(dst, src, copy_bytes);
                        else
                          pool.run([&] { std::memcpy(dst, src, copy_half); },
                                   [&] { std::memcpy(dst + copy_half, src + copy_half, copy_bytes - copy_half); });
                      }};
  // The stream arrays live in the memcpy source buffer (sized for 4 arrays of the largest case);
  // for the ResNet-50 list they are whole arrays, not 161 tensors (the per-tensor overhead is
  // Lockstep's to show, not the reference's).
  const int arrays = bytes_per_param == 28 ? 4 : 3;
  float* sbase = reinterpret_cast<float*>(src);
  bench::Variant stream{"stream", [&, arrays, sbase] {
                          if (threads == 1) stream_kernel(sbase, params, arrays, 0, params);
                          else
                            pool.run([&] { stream_kernel(sbase, params, arrays, 0, params / 2); },
                                     [&] { stream_kernel(sbase, params, arrays, params / 2, params); });
                        }};
  std::vector<bench::Variant> vs{lock, copy, stream};
  // Calibrate: about 60 ms per timed block.
  const double one = bench::time_collective(vs[1].body, 2);
  auto m = bench::interleave(vs, reps, bench::iters_for(one, 0.06));
  return {rule_name, layout, params, threads, moved, m[0].s, m[1].s, m[2].s};
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  bench::Options opt("bench_optimizer", "one optimizer step (Adam, AdamW, SGD with momentum) against memcpy of the same bytes");
  if (const auto rc = opt.parse(argc, argv)) return *rc;
  const int reps = opt.quick_reps();

  std::vector<std::pair<std::string, Sizes>> layouts;
  for (std::int64_t n : opt.quick ? Sizes{1'000'000, 10'000'000} : Sizes{1'000'000, 10'000'000, 50'000'000})
    layouts.push_back({std::to_string(n / 1'000'000) + "M, one tensor", Sizes{n}});
  {
    Sizes rn;
    for (auto& p : bench::read_shapes(bench::shapes_dir() + "/resnet50.txt")) rn.push_back(p.numel);
    layouts.push_back({"ResNet-50 list (161 tensors)", rn});
  }
  std::int64_t max_params = 0;
  for (auto& l : layouts) {
    std::int64_t t = 0;
    for (auto s : l.second) t += s;
    max_params = std::max(max_params, t);
  }
  // memcpy buffers for the largest case (Adam: 14 B/param copied), touched before timing. The
  // stream kernel uses src as 4 float arrays of max_params (16 B/param), so src is that large.
  const std::size_t buf_bytes = static_cast<std::size_t>(max_params) * 14 + 64;
  std::vector<char> src(static_cast<std::size_t>(max_params) * 16 + 64, 0), dst(buf_bytes, 0);

  TwoThreads pool;
  std::vector<Result> results;
  for (int threads : {1, 2}) {
    for (auto& [layout, sizes] : layouts) {
      results.push_back(measure("Adam", ls::Adam{.lr = 1e-3f}, 28, layout, sizes, threads, reps, pool,
                                src.data(), dst.data()));
      results.push_back(measure("AdamW", ls::AdamW(1e-3f, 1e-2f), 28, layout, sizes, threads, reps, pool,
                                src.data(), dst.data()));
      results.push_back(measure("SGD+momentum", ls::SGD{.lr = 1e-2f, .momentum = 0.9f}, 20, layout, sizes,
                                threads, reps, pool, src.data(), dst.data()));
      if (bench::world_rank() == 0)
        std::fprintf(stderr, "  %d thread(s), %s done\n", threads, layout.c_str());
    }
  }

  if (bench::world_rank() == 0)
    std::printf("\n## Optimizer step, f32 (median of %d; GB/s counts the bytes a step must move; "
                "ratio = Lockstep GB/s / memcpy GB/s)\n\n", reps);
  bench::Table t({"rule", "parameters", "threads", "step ms", "GB/s", "memcpy GB/s", "ratio", "ratio (min times)",
                  "stream GB/s", "GB/s / stream"});
  bench::Json jrows = bench::Json::array();
  for (auto& r : results) {
    const double gbs = r.bytes_moved / r.lockstep.median / 1e9;
    const double cgbs = r.bytes_moved / r.copy.median / 1e9;
    const double ratio_min = r.copy.min / r.lockstep.min;
    const double sgbs = r.bytes_moved / r.stream.median / 1e9;
    t.add({r.rule, r.layout, std::to_string(r.threads), bench::fmt(r.lockstep.median * 1e3, 2),
           bench::fmt(gbs, 1), bench::fmt(cgbs, 1), bench::fmt(gbs / cgbs, 3), bench::fmt(ratio_min, 3),
           bench::fmt(sgbs, 1), bench::fmt(gbs / sgbs, 3)});
    jrows.push(bench::Json::object()
                   .set("rule", r.rule)
                   .set("layout", r.layout)
                   .set("params", r.params)
                   .set("threads", r.threads)
                   .set("bytes_moved", r.bytes_moved)
                   .set("step_median_s", r.lockstep.median)
                   .set("step_min_s", r.lockstep.min)
                   .set("memcpy_median_s", r.copy.median)
                   .set("memcpy_min_s", r.copy.min)
                   .set("GBps", gbs)
                   .set("memcpy_GBps", cgbs)
                   .set("ratio_median", gbs / cgbs)
                   .set("ratio_min", ratio_min)
                   .set("stream_GBps", sgbs)
                   .set("ratio_to_stream", gbs / sgbs));
  }
  t.print();
  bench::Json doc = bench::run_info("optimizer");
  doc.set("reps", reps)
      .set("threading", "2 threads = std::thread over two halves of the model, each running ls::update")
      .set("rows", jrows);
  doc.write(opt.json);
  return 0;
}
