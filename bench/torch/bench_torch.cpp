// bench_torch: one training step of a LibTorch model at N ranks (2 on the CI machine), one step
// at a time, with the ways a C++ program can average the gradients, interleaved in the same run:
//   lockstep     lt::DistributedOptimizer (flat gradient buffers, buckets reduced during
//                backward from autograd hooks, then the inner SGD step); lockstep-25m: the same
//                with buckets of 25 MiB (DDP's default) instead of the default 1 MiB;
//                lockstep-sharded: shard_optimizer_state (ZeroRedundancyOptimizer: each rank
//                steps its own parameters, then one broadcast per bucket of each owner's);
//                lockstep-bf16: wire_dtype bf16 (gradients sent as 16-bit floats);
//                lockstep-deterministic: DistributedOptions::deterministic (exact sums after
//                backward, the same bits at any rank count: docs/training.md);
//   ls-blocking  ls::MPIBackend::allreduce (blocking: its shared-memory path) per gradient after
//                backward, no overlap: what the bucket transfers alone cost on the fast path;
//   mpi-loop     a hand-written MPI_Allreduce per parameter after backward, then grad /= size
//                (PyTorch's C++ distributed example, examples/cpp/distributed/dist-mnist.cpp);
//   gloo         c10d::ProcessGroupGloo from C++ (FileStore rendezvous, loopback device): one
//                asynchronous allreduce per parameter after backward, wait for all, grad /= size
//                (built only where LibTorch ships the c10d headers and gloo's: LOCKSTEP_BENCH_GLOO);
//   local        no communication at all: every rank runs forward, backward and SGD alone (the
//                denominator of the ratio, on the same cores, under the same load).
// Run at 1 rank with --variants local for the one-process figure (nothing else competes for the
// cores then).
//
// Each variant trains its own copy of the model (same initial weights, same per-rank batches),
// so the hooks of one never fire in another. A step is timed in phases, each rank's, and the
// slowest rank's phase times are kept (MPI_Allreduce MAX outside the timed region):
//   zero_grad + forward | backward() | until the inner optimizer starts (the rest of the
//   communication) | the inner SGD step.
// "backward+comm" is from the start of backward() to the start of the inner SGD step: for
// lockstep that includes DistributedOptimizer::step()'s wait and checks; for the loops, the loop.
// The inner step's start is seen by a subclass of torch::optim::SGD (DistributedOptimizer calls
// the optimizer's virtual step()).
//
// Models: --model mlp (Sequential of --layers Linear(--width, --width) + ReLU; 50 x 512: 13.1 M
// parameters), --model gpt (examples/torch/gpt_model.hpp's byte-level GPT at its small preset: 4
// layers, width 128, context 64, the head tied to the embedding, no dropout; --batch sequences
// per rank, next-byte cross-entropy on random bytes), or --model script --script FILE (a TorchScript module, e.g. ResNet-50 traced by
// bench/torch/export_resnet50.py, input --image-size, 1000 classes, cross-entropy).
//
// --optimizer adam: the inner optimizer is Adam instead of SGD (state twice the parameters:
// what sharding divides).
//
// --model bn: instead, lt::SyncBatchNorm2d against torch::nn::BatchNorm2d, forward + backward in
// training mode on this rank's [--batch, --channels, --image-size, --image-size] input (the
// same shape on every rank), each rank's time, the slowest rank's median.
//
// Run: mpiexec -n 2 ./bench_torch [--model mlp] [--batch 64] [--warmup 3] [--steps 20]
//      [--variants lockstep,lockstep-25m,lockstep-sharded,lockstep-bf16,lockstep-deterministic,ls-blocking,
//                  mpi-loop,gloo,local]
//      [--optimizer sgd|adam] [--threads 1] [--json out.json]
#include <torch/script.h>
#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>
#include <lockstep/torch/sync_batchnorm.hpp>

#include "gpt_model.hpp"  // examples/torch

#ifdef LOCKSTEP_BENCH_GLOO
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace ls = lockstep;
namespace lt = lockstep::torch;

namespace {

double g_inner_start = 0;  // when the inner optimizer's step() began (this rank)

// An optimizer that notes when its step() starts: the end of the communication for every
// variant.
template <class O>
class Timed : public O {
 public:
  using O::O;
  torch::Tensor step(typename O::LossClosure closure = nullptr) override {
    g_inner_start = bench::now();
    return O::step(std::move(closure));
  }
};

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      auto c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "unknown";
}

struct Config {
  std::string model = "mlp";
  std::string script;
  int layers = 50, width = 512, batch = 64, image = 64, classes = 1000;
  int warmup = 3, steps = 20, chunk = 5, channels = 64;
  double lr = 0.01;
  std::string optimizer = "sgd";
};

// The GPT of --model gpt: examples/torch/gpt's small preset, without dropout: the variants
// interleave their steps, so each would draw other masks from the one generator, and their
// results are compared.
constexpr gpt::Config kGpt{4, 4, 128, 64, 0.0};

// One model replica: an nn::Module (mlp, gpt) or a TorchScript module.
struct Replica {
  std::shared_ptr<torch::nn::Module> module;  // mlp, gpt
  torch::nn::Sequential seq{nullptr};
  gpt::GPT gpt{nullptr};
  std::unique_ptr<torch::jit::Module> script;  // script
  std::vector<torch::Tensor> params;

  torch::Tensor forward(const torch::Tensor& x) {
    if (script) return script->forward({x}).toTensor();
    if (gpt) return gpt->forward(x);
    return seq->forward(x);
  }
};

Replica make_replica(const Config& c) {
  Replica r;
  torch::manual_seed(0);  // the same initial weights in every variant, on every rank
  if (c.model == "mlp") {
    torch::nn::Sequential s;
    for (int i = 0; i < c.layers; ++i) {
      s->push_back(torch::nn::Linear(c.width, c.width));
      s->push_back(torch::nn::ReLU());
    }
    r.seq = s;
    r.module = s.ptr();
    r.params = s->parameters();
  } else if (c.model == "gpt") {
    r.gpt = gpt::GPT(kGpt);
    r.module = r.gpt.ptr();
    for (const auto& p : r.gpt->named_parameters())  // the tied weight once
      if (p.key() != "head.weight") r.params.push_back(p.value());
  } else {
    r.script = std::make_unique<torch::jit::Module>(torch::jit::load(c.script));
    r.script->train();
    for (const auto& p : r.script->parameters()) r.params.push_back(p);
  }
  return r;
}

// This rank's batch (different on every rank, the same in every variant).
struct Batch {
  torch::Tensor x, y;
};
Batch make_batch(const Config& c, int rank) {
  torch::manual_seed(100 + rank);
  if (c.model == "mlp") return {torch::randn({c.batch, c.width}), torch::randn({c.batch, c.width})};
  if (c.model == "gpt")
    return {torch::randint(0, gpt::kVocab, {c.batch, kGpt.block}), torch::randint(0, gpt::kVocab, {c.batch, kGpt.block})};
  return {torch::randn({c.batch, 3, c.image, c.image}), torch::randint(0, c.classes, {c.batch})};
}
torch::Tensor loss_of(const Config& c, const torch::Tensor& out, const Batch& b) {
  if (c.model == "gpt")
    return torch::nn::functional::cross_entropy(out.reshape({-1, gpt::kVocab}), b.y.reshape({-1}));
  return c.model == "mlp" ? torch::mse_loss(out, b.y) : torch::nn::functional::cross_entropy(out, b.y);
}

// Phase times of one step (seconds): zero_grad+forward, backward(), rest of the communication
// (until the inner step starts), inner step; the slowest rank's each.
using Phases = std::array<double, 4>;

struct Runner {
  std::string name;
  Replica rep;
  std::unique_ptr<torch::optim::Optimizer> sgd;
  std::function<void()> zero_grad;        // before forward
  std::function<void()> after_backward;   // communication after backward, then the inner step
  std::vector<Phases> samples;
};

// --model bn: lt::SyncBatchNorm2d against torch::nn::BatchNorm2d, forward + backward in training
// mode, interleaved in chunks; the slowest rank's time per step, median.
int run_bn(const Config& c, ls::Backend& backend, const std::string& json) {
  const int rank = bench::world_rank(), size = bench::world_size();
  torch::manual_seed(200 + rank);
  const auto x0 = torch::randn({c.batch, c.channels, c.image, c.image});
  const auto gy = torch::randn_like(x0);
  torch::nn::BatchNorm2d plain(torch::nn::BatchNorm2dOptions(c.channels));
  lt::SyncBatchNorm2d sync(backend, torch::nn::BatchNorm2dOptions(c.channels));
  std::vector<std::pair<std::string, std::function<torch::Tensor(const torch::Tensor&)>>> variants{
      {"BatchNorm2d", [&](const torch::Tensor& x) { return plain->forward(x); }},
      {"SyncBatchNorm2d", [&](const torch::Tensor& x) { return sync->forward(x); }}};
  std::vector<std::vector<double>> samples(variants.size());
  auto one = [&](std::size_t v, bool keep) {
    auto x = x0.clone().requires_grad_(true);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = bench::now();
    variants[v].second(x).backward(gy);
    double t = bench::now() - t0, m = 0;
    MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (keep) samples[v].push_back(m);
  };
  for (std::size_t v = 0; v < variants.size(); ++v)
    for (int i = 0; i < c.warmup; ++i) one(v, false);
  for (int done = 0, round = 0; done < c.steps; done += c.chunk, ++round)
    for (std::size_t j = 0; j < variants.size(); ++j)
      for (int i = 0; i < std::min(c.chunk, c.steps - done); ++i) one((j + static_cast<std::size_t>(round)) % variants.size(), true);
  const double base = bench::stats_of(samples[0]).median;
  if (rank == 0)
    std::printf("## bench_torch --model bn: forward+backward in training mode, input [%d, %d, %d, %d] per rank, "
                "%d rank(s); median of %d, ms, the slowest rank's\n\n",
                c.batch, c.channels, c.image, c.image, size, c.steps);
  bench::Table table({"module", "forward+backward", "/ BatchNorm2d"});
  auto arr = bench::Json::array();
  for (std::size_t v = 0; v < variants.size(); ++v) {
    const double med = bench::stats_of(samples[v]).median;
    table.add({variants[v].first, bench::fmt(med * 1e3, 2), bench::fmt(med / base, 2)});
    auto o = bench::Json::object();
    o.set("variant", variants[v].first).set("step_s", med).set("ratio_to_batchnorm2d", med / base);
    arr.push(o);
  }
  table.print();
  auto j = bench::run_info("torch_bn");
  j.set("batch_per_rank", c.batch).set("channels", c.channels).set("image", c.image).set("steps", c.steps);
  j.set("variants", arr);
  j.write(json);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  auto& backend = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = bench::world_rank(), size = bench::world_size();
  int rc = 0;
  bench::Options opt("bench_torch", "one LibTorch training step with the ways a C++ program can average the gradients");
  Config c;
  int threads = 1;
#ifdef LOCKSTEP_BENCH_GLOO
  std::vector<std::string> names = {"lockstep",    "lockstep-25m", "lockstep-sharded", "lockstep-bf16",
                                    "lockstep-deterministic", "ls-blocking", "mpi-loop", "gloo", "local"};
#else
  std::vector<std::string> names = {"lockstep",    "lockstep-25m", "lockstep-sharded", "lockstep-bf16",
                                    "lockstep-deterministic", "ls-blocking", "mpi-loop", "local"};
#endif
  if (size == 1) names = {"local"};
  {
    namespace cli = lockstep_cli;
    auto& app = opt.app;
    app.add_option("--model", c.model, "mlp, gpt (examples/torch/gpt's small GPT), script (a TorchScript module, "
                   "--script), or bn (SyncBatchNorm2d against BatchNorm2d)")->type_name("mlp|gpt|script|bn")
        ->check(cli::one_of({"mlp", "gpt", "script", "bn"}));
    app.add_option("--optimizer", c.optimizer, "the inner optimizer")->type_name("sgd|adam")
        ->check(cli::one_of({"sgd", "adam"}));
    app.add_option("--channels", c.channels, "channels of --model bn")->type_name("N")->check(cli::at_least(1));
    app.add_option("--script", c.script, "the TorchScript module of --model script")->type_name("FILE");
    app.add_option("--layers", c.layers, "Linear + ReLU layers of the MLP")->type_name("N")->check(cli::at_least(1));
    app.add_option("--width", c.width, "width of the MLP's layers")->type_name("N")->check(cli::at_least(1));
    app.add_option("--batch", c.batch, "samples per rank and step")->type_name("N")->check(cli::at_least(1));
    app.add_option("--image-size", c.image, "input size of --model script")->type_name("N")->check(cli::at_least(1));
    app.add_option("--warmup", c.warmup, "untimed steps first (1 with --quick)")->type_name("N")->check(cli::at_least(0));
    app.add_option("--steps", c.steps, "timed steps (at most 5 with --quick)")->type_name("N")->check(cli::at_least(1));
    app.add_option("--threads", threads, "LibTorch threads per rank")->type_name("N")->check(cli::at_least(1));
    app.add_option("--variants", names, "variants to time (default: every one at 2 or more ranks, local at 1)")
        ->type_name("A,B")->delimiter(',');
    app.callback([&c] {
      if (c.model == "script" && c.script.empty()) throw cli::refused("--model", "script needs --script FILE");
    });
  }
  if (const auto rc_parse = opt.parse(argc, argv)) return *rc_parse;
  if (opt.quick) c.steps = std::min(c.steps, 5), c.warmup = 1;
  try {
    torch::set_num_threads(threads);
    if (c.model == "bn") {
      rc = run_bn(c, backend, opt.json);
      ls::finalize<ls::MPIBackend>();
      return rc;
    }
    const Batch batch = make_batch(c, rank);

    std::vector<std::unique_ptr<Runner>> runners;
    std::vector<std::unique_ptr<lt::DistributedOptimizer>> dopts;
#ifdef LOCKSTEP_BENCH_GLOO
    c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#endif
    std::int64_t numel = 0;
    for (const auto& n : names) {
      auto r = std::make_unique<Runner>();
      r->name = n;
      r->rep = make_replica(c);
      if (c.optimizer == "adam")
        r->sgd = std::make_unique<Timed<torch::optim::Adam>>(r->rep.params, torch::optim::AdamOptions(c.lr * 0.1));
      else
        r->sgd = std::make_unique<Timed<torch::optim::SGD>>(r->rep.params, torch::optim::SGDOptions(c.lr));
      numel = 0;
      for (auto& p : r->rep.params) numel += p.numel();
      Runner* rr = r.get();
      if (n == "lockstep" || n.rfind("lockstep-", 0) == 0) {
        // "lockstep-25m": buckets of 25 MiB (DDP's bucket_cap_mb) instead of the default.
        ls::DistributedOptions o;
        if (n == "lockstep-sharded")
          o.shard_optimizer_state = true;
        else if (n == "lockstep-bf16")
          o.wire_dtype = ls::DType::bf16;
        else if (n == "lockstep-deterministic")  // exact sums (docs/training.md)
          o.deterministic = true;
        else if (n != "lockstep")
          o.bucket_bytes = std::stoull(n.substr(9)) << 20;
        if (rr->rep.module) lt::synchronize(backend, *rr->rep.module, 0);
        dopts.push_back(std::make_unique<lt::DistributedOptimizer>(backend, *rr->sgd, o));
        auto* d = dopts.back().get();
        rr->zero_grad = [d] { d->zero_grad(); };
        rr->after_backward = [d] { d->step(); };
      } else if (n == "ls-blocking") {
        // Lockstep's blocking allreduce (its shared-memory path on one machine), one call per
        // gradient after backward: what the buckets launched from the hooks (MPI_Iallreduce)
        // would get without overlap.
        rr->zero_grad = [rr] { rr->sgd->zero_grad(); };
        rr->after_backward = [rr, &backend] {
          for (auto& p : rr->rep.params) backend.allreduce(lt::view(p.grad()), ls::ReduceOp::avg);
          rr->sgd->step();
        };
      } else if (n == "mpi-loop" || n == "local") {
        rr->zero_grad = [rr] { rr->sgd->zero_grad(); };
        const bool comm = n == "mpi-loop";
        rr->after_backward = [rr, comm, size] {
          if (comm)
            for (auto& p : rr->rep.params) {
              auto g = p.grad();
              MPI_Allreduce(MPI_IN_PLACE, g.data_ptr<float>(), static_cast<int>(g.numel()), MPI_FLOAT, MPI_SUM,
                            MPI_COMM_WORLD);
              g.div_(size);
            }
          rr->sgd->step();
        };
#ifdef LOCKSTEP_BENCH_GLOO
      } else if (n == "gloo") {
        if (!gloo) {
          // Rendezvous through a file named by rank 0 (every rank sees /tmp on one machine).
          char path[256] = {};
          if (rank == 0) {
            std::snprintf(path, sizeof path, "/tmp/lockstep_bench_gloo_%d", static_cast<int>(getpid()));
            std::remove(path);
          }
          MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD);
          auto store = c10::make_intrusive<c10d::FileStore>(path, size);
          auto o = c10d::ProcessGroupGloo::Options::create();
          o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
          o->threads = 1;  // one gloo worker thread per rank, as the cores allow
          gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, o);
          MPI_Barrier(MPI_COMM_WORLD);
          if (rank == 0) std::remove(path);
        }
        auto* pg = gloo.get();
        rr->zero_grad = [rr] { rr->sgd->zero_grad(); };
        rr->after_backward = [rr, pg, size] {
          std::vector<c10::intrusive_ptr<c10d::Work>> works;
          for (auto& p : rr->rep.params) {
            std::vector<at::Tensor> t{p.grad()};
            works.push_back(pg->allreduce(t));
          }
          for (auto& w : works) w->wait();
          for (auto& p : rr->rep.params) p.grad().div_(size);
          rr->sgd->step();
        };
#endif
      } else {
        throw std::invalid_argument("unknown variant " + n +
#ifdef LOCKSTEP_BENCH_GLOO
                                    " (lockstep, mpi-loop, gloo, local)"
#else
                                    " (lockstep, mpi-loop, local; gloo: not built, see bench/CMakeLists.txt)"
#endif
        );
      }
      runners.push_back(std::move(r));
    }

    auto one_step = [&](Runner& r, bool keep) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = bench::now();
      r.zero_grad();
      auto loss = loss_of(c, r.rep.forward(batch.x), batch);
      const double t1 = bench::now();
      loss.backward();
      const double t2 = bench::now();
      g_inner_start = 0;
      r.after_backward();
      const double t4 = bench::now();
      const double t3 = g_inner_start > 0 ? g_inner_start : t4;
      Phases p{t1 - t0, t2 - t1, t3 - t2, t4 - t3}, m{};
      MPI_Allreduce(p.data(), m.data(), 4, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (keep) r.samples.push_back(m);
    };
    // Warm-up (first-touch, DDP-like lazy setup, allocator), then the measured steps in chunks,
    // the variants' order rotating every chunk so that the machine's noise hits them alike.
    for (auto& r : runners)
      for (int i = 0; i < c.warmup; ++i) one_step(*r, false);
    for (int done = 0, round = 0; done < c.steps; done += c.chunk, ++round) {
      const int k = std::min(c.chunk, c.steps - done);
      for (std::size_t j = 0; j < runners.size(); ++j) {
        auto& r = *runners[(j + static_cast<std::size_t>(round)) % runners.size()];
        for (int i = 0; i < k; ++i) one_step(r, true);
      }
    }

    // Same initial weights, same batches, same number of steps: every communicating variant must
    // end with the same weights (up to the order of the floating-point sums).
    bool ok = true;
    Runner* ref = nullptr;
    for (auto& r : runners) {
      if (r->name == "local") continue;
      if (!ref) {
        ref = r.get();
        continue;
      }
      // The 16-bit wire rounds every gradient: close, not equal, and how close depends on the
      // training, not on the wire: Adam moves a weight by about lr per step whatever the
      // gradient's size (a rounding that flips a tiny gradient's sign costs up to 2 lr), and a
      // model trained at an unstable rate (ResNet-50 from random weights at lr 0.01) amplifies
      // any difference step by step. So the bf16 variant is held only to "not garbage" (finite,
      // within half the weights' scale) and its largest difference is printed; the wire's sums
      // themselves are checked by the tests (ext/torch/test/sharded_test.cpp, "wire_dtype").
      const bool bf16 = r->name == "lockstep-bf16";
      const double tol = bf16 ? 0.5 : 1e-4;
      double largest = 0;
      for (std::size_t i = 0; i < r->rep.params.size(); ++i) {
        const double d = (r->rep.params[i] - ref->rep.params[i]).abs().max().item<double>();
        const double s = ref->rep.params[i].abs().max().item<double>();
        largest = std::max(largest, d / std::max(1.0, s));
        if (!(d <= tol * std::max(1.0, s))) {
          if (rank == 0)
            std::fprintf(stderr, "bench_torch: %s and %s differ in parameter %zu by %g\n", r->name.c_str(),
                         ref->name.c_str(), i, d);
          ok = false;
          break;
        }
      }
      if (bf16 && rank == 0)
        std::fprintf(stderr, "bench_torch: lockstep-bf16's largest weight difference from %s: %.3g of the weights' scale\n",
                     ref->name.c_str(), largest);
    }
    ok = bench::all_ranks(ok);

    // Results: medians of the per-step (slowest-rank) phase times.
    struct Row {
      std::string name;
      double step, fwd, bwd, comm, opt, bwdcomm;
    };
    std::vector<Row> rows;
    for (auto& r : runners) {
      std::vector<double> st, f, b, cm, o, bc;
      for (auto& p : r->samples) {
        st.push_back(p[0] + p[1] + p[2] + p[3]);
        f.push_back(p[0]);
        b.push_back(p[1]);
        cm.push_back(p[2]);
        o.push_back(p[3]);
        bc.push_back(p[1] + p[2]);
      }
      rows.push_back({r->name, bench::stats_of(st).median, bench::stats_of(f).median, bench::stats_of(b).median,
                      bench::stats_of(cm).median, bench::stats_of(o).median, bench::stats_of(bc).median});
    }
    double local_bwd = 0;
    for (auto& r : rows)
      if (r.name == "local") local_bwd = r.bwdcomm;

    if (rank == 0) {
      std::string what = c.model == "mlp" ? "MLP " + std::to_string(c.layers) + " x Linear(" + std::to_string(c.width) +
                                                "," + std::to_string(c.width) + ")+ReLU"
                         : c.model == "gpt" ? "GPT 4 layers, width 128, context 64"
                                          : "TorchScript " + c.script + " at " + std::to_string(c.image) + "x" +
                                                std::to_string(c.image);
      std::printf("## bench_torch: %s, %.2f M parameters, batch %d per rank, %s, %d rank(s)\n\n", what.c_str(),
                  static_cast<double>(numel) / 1e6, c.batch, c.optimizer == "adam" ? "Adam" : "SGD", size);
      std::printf("CPU: %s; torch::set_num_threads(%d) per rank; LibTorch %s; median of %d steps after %d warm-up; "
                  "times in ms, each the slowest rank's\n\n",
                  cpu_model().c_str(), threads, TORCH_VERSION, c.steps, c.warmup);
    }
    bench::Table table({"variant", "step", "fwd", "backward()", "comm after", "optimizer", "backward+comm",
                        "(backward+comm)/local backward"});
    for (auto& r : rows)
      table.add({r.name, bench::fmt(r.step * 1e3, 1), bench::fmt(r.fwd * 1e3, 1), bench::fmt(r.bwd * 1e3, 1),
                 bench::fmt(r.comm * 1e3, 1), bench::fmt(r.opt * 1e3, 1), bench::fmt(r.bwdcomm * 1e3, 1),
                 local_bwd > 0 ? bench::fmt(r.bwdcomm / local_bwd, 2) : std::string("-")});
    table.print();
    if (rank == 0 && !ok) std::printf("RESULTS DIFFER between variants (see stderr)\n");

    auto j = bench::run_info("torch");
    j.set("model", c.model).set("script", c.script).set("parameters", numel).set("batch_per_rank", c.batch);
    j.set("threads_per_rank", threads).set("steps", c.steps).set("warmup", c.warmup).set("cpu", cpu_model());
    j.set("correct", ok);
    auto arr = bench::Json::array();
    for (auto& r : rows) {
      auto o = bench::Json::object();
      o.set("variant", r.name).set("step_s", r.step).set("forward_s", r.fwd).set("backward_s", r.bwd);
      o.set("comm_after_backward_s", r.comm).set("optimizer_s", r.opt).set("backward_comm_s", r.bwdcomm);
      if (local_bwd > 0) o.set("ratio_to_local_backward", r.bwdcomm / local_bwd);
      arr.push(o);
    }
    j.set("variants", arr);
    j.write(opt.json);
    rc = ok ? 0 : 1;
    dopts.clear();
#ifdef LOCKSTEP_BENCH_GLOO
    gloo.reset();
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_torch (rank %d): %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  ls::finalize<ls::MPIBackend>();
  return rc;
}
