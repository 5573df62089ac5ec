// train: data-parallel training of Flux's DistributedUtils example, in C++.
//
// The model is Dense(1 => 256, tanh) then Dense(256 => 1), fitted to y = x^3 for x uniform in
// [0, 1) (float32) with DistributedOptimizer(backend, Adam{.lr = 1e-3}). Every rank holds a
// replica; model and optimizer state are synchronized from rank 0; a DistributedDataContainer
// deals each rank its share of every global batch (reshuffled each epoch), and the gradients are
// averaged across ranks, so -n 1, 2 and 4 train the same model. Forward and backward use
// OpenBLAS's cblas_sgemm; with --device cuda (builds with LOCKSTEP_WITH_CUDA) cuBLAS, see
// train_cuda.cu (compiled, not yet run on a GPU). With --deterministic the global batch is cut
// into micro-batches of --micro-batch samples, each rank computes the gradients of its block of
// them by global index and the library sums them exactly (DistributedOptions::deterministic),
// so the model is bitwise the same at any rank count and after a resume at another one. Every
// run ends with `model hash crc32c:XXXXXXXX` (rank 0) to compare runs by.
//
// Run (from the repository root, after building into build/):
//   mpiexec -n 4 --oversubscribe build/examples/train/train --epochs 100 --log loss.csv
//   # stop and resume: save every 10 epochs, then continue from the last checkpoint
//   mpiexec -n 4 --oversubscribe build/examples/train/train --epochs 30 --checkpoint-every 10 --checkpoint ck.safetensors
//   mpiexec -n 4 --oversubscribe build/examples/train/train --epochs 100 --checkpoint ck.safetensors --resume
//   # deterministic: the same last line (model hash) at -n 1, 2, 3 and 4
//   mpiexec -n 3 --oversubscribe build/examples/train/train --deterministic --batch 240 --micro-batch 10
//   # restartable: numbered checkpoints every 5 epochs, the last 3 kept; resume from the newest if any
//   lockstep-run -n 4 -- build/examples/train/train --epochs 100 --checkpoint run/ck
//       --checkpoint-every 5 --checkpoint-keep 3 --resume auto     (one line)
//   # --rescue: a lost rank costs one step; the survivors write the last completed step to their
//   # host's run/ck.rescue, and --resume auto goes on from the freshest state any rank can read
//   LOCKSTEP_TIMEOUT=10 mpiexec -n 4 --enable-recovery build/examples/train/train --checkpoint run/ck
//       --checkpoint-every 10 --checkpoint-keep 3 --rescue --resume auto     (one line)
// `train --help` lists every flag; docs/examples.md describes the output and the checkpoint.
#include <lockstep/io/checkpoint.hpp>
#include <lockstep/lockstep.hpp>

#include "lockstep_cli.hpp"
#include "../common/loss_plot.hpp"

#include <cblas.h>
#include <unistd.h>

#if LOCKSTEP_TRAIN_CUDA
#include <lockstep/cuda.hpp>

#include "train_cuda.hpp"
#endif
#if LOCKSTEP_TRAIN_CUDA && LOCKSTEP_HAS_NCCL
#include <lockstep/nccl.hpp>
#endif

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <span>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace ls = lockstep;

namespace {

constexpr std::int64_t kHidden = 256;

/// Dense(1 => 256, tanh) then Dense(256 => 1), weights stored out x in as in Flux.
struct Model {
  ls::Tensor w1, b1, w2, b2;
};
LOCKSTEP_FIELDS(Model, w1, b1, w2, b2)

/// What a checkpoint holds: model, optimizer state (step count, Adam moments) and the number of
/// epochs done. References, so that saving and resuming act on the live objects.
struct TrainState {
  Model& model;
  ls::DistributedState<ls::Adam>& opt;
  std::int64_t& epoch;
};
LOCKSTEP_FIELDS(TrainState, model, opt, epoch)

struct Options {
  std::int64_t epochs = 100;
  std::int64_t samples = 4096;
  std::int64_t batch = 256;
  float lr = 1e-3f;
  std::uint64_t seed = 42;
  std::string backend = "mpi";
  std::string device = "cpu";
  std::string init = "torch";
  std::string checkpoint;
  std::int64_t checkpoint_every = 0;
  double checkpoint_seconds = 0;
  int checkpoint_keep = 0;
  std::string resume;  // "" (start fresh), "file" (--resume) or "auto" (--resume auto)
  std::string log;
  bool shard_optimizer_state = false;
  bool rescue_buddy = false;  // --rescue-buddy
  std::string wire_dtype = "f32";
  bool deterministic = false;
  std::int64_t micro_batch = 16;  // with --deterministic: 256 / 16 = 16 micro-batches, more than ranks
  bool rescue = false;     // --rescue (or --rescue-dir)
  std::string rescue_dir;  // "": LOCKSTEP_RESCUE_DIR, else STEM.rescue
  double rescue_seconds = 30;
};


/// The flags, one line each; lockstep_cli::parse then checks them the same way on every rank.
void add_flags(CLI::App& app, Options& o, int ranks) {
  namespace cli = lockstep_cli;
  app.add_option("--epochs", o.epochs, "epochs to train in total")->type_name("E")->check(cli::at_least(1));
  app.add_option("--samples", o.samples, "dataset size")->type_name("S")->check(cli::at_least(1));
  app.add_option("--batch", o.batch,
                 "global batch size, split across ranks; a multiple of N (with --deterministic: of --micro-batch)")
      ->type_name("B")->check(cli::at_least(1));
  app.add_option("--lr", o.lr, "Adam learning rate")->type_name("LR")->check(cli::positive());
  app.add_option("--seed", o.seed, "seed of data, initial weights and shuffles")->type_name("SEED")
      ->check(cli::at_least(0));
  app.add_option("--backend", o.backend, "communication backend (nccl needs LOCKSTEP_WITH_NCCL)")
      ->type_name("mpi|nccl")->check(cli::one_of({"mpi", "nccl"}));
  app.add_option("--device", o.device, "where to compute (cuda needs LOCKSTEP_WITH_CUDA)")
      ->type_name("cpu|cuda")->check(cli::one_of({"cpu", "cuda"}));
  app.add_option("--init", o.init, "initial weights: torch.nn.Linear's or Flux Dense's")
      ->type_name("torch|flux")->check(cli::one_of({"torch", "flux"}));
  app.add_option("--checkpoint", o.checkpoint, "write a checkpoint there at the end (and every K epochs)")
      ->type_name("PATH");
  app.add_option("--checkpoint-every", o.checkpoint_every, "also write it after every K-th epoch (0: only at the end)")
      ->type_name("K")->check(cli::at_least(0));
  app.add_option("--checkpoint-seconds", o.checkpoint_seconds,
                 "also write one after an epoch when T seconds passed since the last (rank 0's clock)")
      ->type_name("T")->check(cli::at_least(0));
  app.add_option("--checkpoint-keep", o.checkpoint_keep,
                 "rotate: write PATH's stem + -EPOCH.safetensors, point STEM.latest at the newest, keep the last K")
      ->type_name("K")->check(cli::at_least(0));
  app.add_option("--resume", o.resume,
                 "continue from --checkpoint PATH (same seed, samples and batch); 'auto': from the newest "
                 "checkpoint if there is one, else start fresh")
      ->type_name("[auto]")->expected(0, 1)->default_str("file")->check(cli::one_of({"file", "auto"}));
  app.add_option("--log", o.log, "write the per-epoch loss there, and its plot to CSV.png (needs gnuplot)")
      ->type_name("CSV");
  app.add_flag("--shard-optimizer-state", o.shard_optimizer_state, "ZeRO-1: each rank keeps Adam's state for 1/N of the parameters");
  app.add_flag("--rescue-buddy", o.rescue_buddy,
               "with --shard-optimizer-state: each shard also kept on a rank of another host, so that --rescue "
               "writes the survivors' shards");
  app.add_option("--wire-dtype", o.wire_dtype, "dtype of the gradients on the wire (bf16, f16: half the bytes)")
      ->type_name("f32|bf16|f16")->check(cli::one_of({"f32", "bf16", "f16"}));
  app.add_flag("--deterministic", o.deterministic,
               "the same model bit for bit at any rank count and after a resume at another (micro-batches, exact sums)");
  auto* micro = app.add_option("--micro-batch", o.micro_batch,
                               "with --deterministic: samples per micro-batch (--batch a multiple of it)")
                    ->type_name("M")->check(cli::at_least(1));
  app.add_flag("--rescue", o.rescue,
               "when a collective fails, each surviving rank writes the state of the last completed step to its "
               "host's rescue directory; --resume auto takes the freshest state any rank can read");
  app.add_option("--rescue-dir", o.rescue_dir,
                 "this rank's rescue directory (implies --rescue; default: LOCKSTEP_RESCUE_DIR, else the "
                 "checkpoint's STEM.rescue)")
      ->type_name("DIR");
  app.add_option("--rescue-seconds", o.rescue_seconds, "give up a rescue write after T seconds")
      ->type_name("T")->check(cli::positive());
  // Checks across flags, after all of them are read.
  app.callback([&o, ranks, micro] {
    if (!o.rescue_dir.empty()) o.rescue = true;
    if (o.rescue && o.checkpoint.empty()) throw cli::refused("--rescue", "needs --checkpoint PATH");
    if (!o.deterministic && micro->count() > 0) throw cli::refused("--micro-batch", "needs --deterministic");
    // Deterministic: ranks take whole micro-batches, any number each, so only the micro-batch
    // must divide the global batch; otherwise the rank count must (equal shares).
    if (o.deterministic && o.batch % o.micro_batch != 0)
      throw cli::refused("--batch", std::to_string(o.batch) + " is not a multiple of --micro-batch " +
                                        std::to_string(o.micro_batch) +
                                        " (a global batch is made of whole micro-batches)");
    if (!o.deterministic && o.batch % ranks != 0)
      throw cli::refused("--batch", std::to_string(o.batch) + " is not a multiple of the " + std::to_string(ranks) +
                                        " ranks (the global batch is split evenly)");
    if (o.deterministic && o.device != "cpu")
      throw cli::refused("--deterministic", "needs --device cpu (the CUDA path's kernels and cuBLAS are not set up for it)");
    if (o.backend == "nccl" && o.device != "cuda") throw cli::refused("--backend", "nccl needs --device cuda");
    if (!o.resume.empty() && o.checkpoint.empty()) throw cli::refused("--resume", "needs --checkpoint PATH");
    if (o.checkpoint_seconds > 0 && o.checkpoint.empty())
      throw cli::refused("--checkpoint-seconds", "needs --checkpoint PATH");
    if (o.checkpoint_keep > 0 && o.checkpoint.empty())
      throw cli::refused("--checkpoint-keep", "needs --checkpoint PATH");
    if (o.checkpoint_every > 0 && o.checkpoint.empty())
      throw cli::refused("--checkpoint-every", "needs --checkpoint PATH");
  });
}

/// Uniform float in [0, 1) from the top 24 bits: written out because std::uniform_real_distribution
/// differs between standard libraries, and a run must be reproducible anywhere.
float uniform01(std::mt19937_64& rng) { return static_cast<float>(rng() >> 40) * 0x1.0p-24f; }

/// Initial weights. "torch" (default): weights and biases uniform in +-1/sqrt(fan_in), as
/// torch.nn.Linear; the first layer's units then spread over tanh's curved range and the fit
/// leaves the straight line within a few epochs. "flux": Glorot-uniform weights and zero biases,
/// as Flux's Dense; every unit starts in tanh's linear range and the loss sits on the plateau
/// of the best straight-line fit of x^3 (1.29e-2) for ~350 epochs before it falls.
Model init_model(std::uint64_t seed, const std::string& init) {
  std::mt19937_64 rng(seed);
  Model m{ls::Tensor::empty({kHidden, 1}), ls::Tensor::zeros({kHidden}), ls::Tensor::empty({1, kHidden}),
          ls::Tensor::zeros({1})};
  auto fill = [&](ls::Tensor& t, float limit) {
    for (float& w : t.span<float>()) w = (2 * uniform01(rng) - 1) * limit;
  };
  if (init == "flux") {
    const float limit = std::sqrt(6.0f / static_cast<float>(1 + kHidden));
    fill(m.w1, limit);
    fill(m.w2, limit);
  } else {
    fill(m.w1, 1.0f);
    fill(m.b1, 1.0f);
    fill(m.w2, 1.0f / std::sqrt(static_cast<float>(kHidden)));
    fill(m.b2, 1.0f / std::sqrt(static_cast<float>(kHidden)));
  }
  return m;
}

/// Buffers of one local batch of m samples, reused across steps.
struct Workspace {
  std::vector<float> x, y, h, yhat, dy, dh;
  void resize(std::int64_t m) {
    const auto n = static_cast<std::size_t>(m);
    x.resize(n), y.resize(n), yhat.resize(n), dy.resize(n);
    h.resize(n * kHidden), dh.resize(n * kHidden);
  }
};

/// Forward and backward of the squared error over `share` samples, each error's gradient
/// weighted by `scale`: 2 / share for the mean over the local samples (this rank's part of a
/// global batch; averaging the gradients across the ranks, equal shares, makes it the mean over
/// the global batch, as one process would compute), or with --deterministic 2 M / rows for one
/// of the M micro-batches of a global batch of `rows` samples (the library divides the sum of
/// the M gradients by M). Returns the sum of squared errors over the samples.
double forward_backward(const Model& m, Model& g, Workspace& ws, std::int64_t share, float scale) {
  const int n = static_cast<int>(share);
  const int hd = static_cast<int>(kHidden);
  const float* w1 = m.w1.data<float>();
  const float* b1 = m.b1.data<float>();
  const float* w2 = m.w2.data<float>();
  const float b2 = *m.b2.data<float>();
  // H = tanh(X W1^T + b1): n x 256.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, hd, 1, 1.0f, ws.x.data(), 1, w1, 1, 0.0f,
              ws.h.data(), hd);
  for (int i = 0; i < n; ++i) {
    float* row = ws.h.data() + static_cast<std::size_t>(i) * kHidden;
    for (int j = 0; j < hd; ++j) row[j] = std::tanh(row[j] + b1[j]);
  }
  // Yhat = H W2^T + b2: n x 1.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, 1, hd, 1.0f, ws.h.data(), hd, w2, hd, 0.0f,
              ws.yhat.data(), 1);
  double sse = 0;
  float db2 = 0;
  for (int i = 0; i < n; ++i) {
    const float err = ws.yhat[i] + b2 - ws.y[i];
    sse += static_cast<double>(err) * err;
    ws.dy[i] = scale * err;
    db2 += ws.dy[i];
  }
  *g.b2.data<float>() = db2;
  // dW2 = dY^T H: 1 x 256.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, 1, hd, n, 1.0f, ws.dy.data(), 1, ws.h.data(), hd,
              0.0f, g.w2.data<float>(), hd);
  // dZ = (dY W2) .* (1 - H^2): n x 256.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hd, 1, 1.0f, ws.dy.data(), 1, w2, hd, 0.0f,
              ws.dh.data(), hd);
  float* db1 = g.b1.data<float>();
  for (int j = 0; j < hd; ++j) db1[j] = 0;
  for (int i = 0; i < n; ++i) {
    float* dz = ws.dh.data() + static_cast<std::size_t>(i) * kHidden;
    const float* h = ws.h.data() + static_cast<std::size_t>(i) * kHidden;
    for (int j = 0; j < hd; ++j) {
      dz[j] *= 1.0f - h[j] * h[j];
      db1[j] += dz[j];
    }
  }
  // dW1 = dZ^T X: 256 x 1.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, hd, 1, n, 1.0f, ws.dh.data(), hd, ws.x.data(), 1,
              0.0f, g.w1.data<float>(), 1);
  return sse;
}

std::string to_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

/// Loss history as "l1,l2,..." (exact doubles) for the checkpoint metadata, and back.
std::string join_losses(const std::vector<double>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + to_text(v[i]);
  return s;
}
std::vector<double> split_losses(const std::string& s) {
  std::vector<double> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::strtod(item.c_str(), nullptr));
  return v;
}

/// Plots the loss curve of `csv` into `png` with gnuplot; returns "" when it did, else why not.
std::string plot_losses(const std::string& csv, const std::string& png) {
  return examples::plot_csv(csv, png,
                            "set logscale y\nset xlabel 'epoch'\nset ylabel 'training loss (MSE)'\n"
                            "set title 'lockstep train: Dense(1=>256, tanh), Dense(256=>1) on y = x^3'\nset key off\n",
                            "plot '%s' using 1:2 skip 1 with lines lw 2");
}

/// The gradients of global batch b in --deterministic training: this rank's micro-batches by
/// global index, each micro-batch's gradient accumulated alone (ls::accumulate); the caller
/// then makes one collective apply_accumulated: the exact sum over every micro-batch of every
/// rank, divided by the number of micro-batches, then Adam. Invariant: a micro-batch's gradient depends only on
/// the parameters and its samples (one BLAS thread, a fixed size), never on which rank computes
/// it or how many micro-batches that rank has; so the sum, being exact, is the same at any rank
/// count. A rank without micro-batches in a global batch still calls apply_accumulated.
template <class State, class Grads>
void deterministic_gradients(const ls::DistributedDataContainer<>& data, std::int64_t b, const std::vector<float>& xs,
                             const std::vector<float>& ys, Model& model, Grads& grads, State& state, Workspace& ws,
                             double* sums) {
  const ls::MicroBatches mine = data.micro_batches(b);
  // Each error's weight 2 M / rows: the M micro-batch gradients summed and divided by M give
  // the gradient of the mean over the global batch's rows, also for a short last batch.
  const float scale = 2.0f * static_cast<float>(mine.total) / static_cast<float>(data.global_rows(b));
  for (const std::int64_t mb : mine) {
    const auto idx = data.micro_batch(b, mb);
    const auto m = static_cast<std::int64_t>(idx.size());
    ws.resize(m);
    for (std::int64_t i = 0; i < m; ++i) {
      ws.x[i] = xs[static_cast<std::size_t>(idx[i])];
      ws.y[i] = ys[static_cast<std::size_t>(idx[i])];
    }
    sums[0] += forward_backward(model, grads, ws, m, scale);
    sums[1] += static_cast<double>(m);
    ls::accumulate(state, grads);
  }
}

int run(const Options& o, ls::Backend& backend) {
  const int rank = backend.rank();
  const int ranks = backend.size();
  const bool root = rank == 0;

  // The dataset: every rank generates the same one from the seed.
  std::vector<float> xs(static_cast<std::size_t>(o.samples)), ys(xs.size());
  {
    std::mt19937_64 rng(o.seed ^ 0x9E3779B97F4A7C15ull);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      xs[i] = uniform01(rng);
      ys[i] = xs[i] * xs[i] * xs[i];
    }
  }
  // --deterministic: global batch b is micro-batches of o.micro_batch samples by global index
  // (positions of the epoch's permutation, a function of seed and epoch alone); each rank takes
  // a contiguous block of them, so the ranks' counts may differ. Otherwise equal shares.
  const ls::DataOptions data_options =
      o.deterministic ? ls::DataOptions{.shuffle = true, .seed = o.seed, .remainder = ls::Remainder::uneven,
                                        .global_batch_size = o.batch, .micro_batch_size = o.micro_batch}
                      : ls::DataOptions{.shuffle = true, .seed = o.seed};
  ls::DistributedDataContainer data(backend, o.samples, data_options);

  // Each rank starts from a different random model; synchronize makes them rank 0's.
  Model model = init_model(o.seed + static_cast<std::uint64_t>(rank), o.init);
#if LOCKSTEP_TRAIN_CUDA
  // --device cuda: parameters, gradients and Adam state live on this rank's GPU (the NCCL
  // backend's, or local_rank % device_count); forward and backward run with cuBLAS.
  std::unique_ptr<train_cuda::Trainer> gpu;
  if (o.device == "cuda") {
    const int count = ls::cuda::device_count();
    if (count == 0) throw ls::Error("--device cuda: no CUDA device is visible on this rank");
    int dev = backend.local_rank() % count;
#if LOCKSTEP_HAS_NCCL
    if (auto* nccl = dynamic_cast<ls::NCCLBackend*>(&backend)) dev = nccl->device();
#endif
    ls::cuda::set_device(dev);
    const ls::Device d = ls::Device::cuda(dev);
    model = Model{model.w1.to(d), model.b1.to(d), model.w2.to(d), model.b2.to(d)};
    gpu = std::make_unique<train_cuda::Trainer>(static_cast<int>(kHidden));
  }
#endif
  ls::synchronize(backend, model, 0);
  ls::DistributedOptions dopt{.shard_optimizer_state = o.shard_optimizer_state, .rescue_buddy = o.rescue_buddy};
  if (o.wire_dtype != "f32") dopt.wire_dtype = o.wire_dtype == "bf16" ? ls::DType::bf16 : ls::DType::f16;
  dopt.deterministic = o.deterministic;
  auto opt = ls::DistributedOptimizer(backend, ls::Adam{.lr = o.lr}, dopt);
  auto state = ls::setup(opt, model);
  ls::synchronize(backend, state, 0);
  // Gradients in one flat buffer from the backend's reduce buffers: the optimizer reduces it
  // without copying, and on one machine where it lies on every rank.
  auto grads = ls::flat_zeros_like(backend, model);

  std::int64_t epoch = 0;
  std::vector<double> losses;
  TrainState ts{model, state, epoch};
  std::map<std::string, std::string> run_meta = {
      {"example", "lockstep train"}, {"seed", std::to_string(o.seed)},
      {"samples", std::to_string(o.samples)}, {"batch", std::to_string(o.batch)}};
  // A deterministic run's micro-batch size decides its model as much as the batch does.
  if (o.deterministic) run_meta["micro_batch"] = std::to_string(o.micro_batch);

  // --checkpoint-keep K: numbered checkpoints and the pointer STEM.latest (checkpoint.hpp).
  std::optional<ls::CheckpointRotation> rotation;
  if (o.checkpoint_keep > 0) rotation.emplace(o.checkpoint, o.checkpoint_keep);
  // Where to resume from: the file itself, or (rotating) the one STEM.latest names. With
  // --resume auto, no checkpoint there is a fresh start. Rank 0 looks; every rank gets its answer.
  std::optional<std::filesystem::path> resume_from;
  // --rescue: this rank's rescue directory (its host's), and the position of the last completed
  // step: batches done in the current epoch, and the global loss sums of those batches.
  const std::filesystem::path rescue_dir =
      !o.rescue ? std::filesystem::path()
      : !o.rescue_dir.empty() ? std::filesystem::path(o.rescue_dir)
                              : ls::rescue_directory(ls::rotation_stem(o.checkpoint).string() + ".rescue");
  std::int64_t batch_done = 0;
  double done_sums[2] = {0, 0};
  std::map<std::string, std::string> state_meta;  // of the state resumed from
  bool resumed = false;
  if (o.rescue && o.resume == "auto") {
    // The freshest state anywhere: each host's first rank offers the newest checkpoint it sees,
    // every rank the rescue states in its own directory; the ranks agree, the holder reads.
    std::vector<std::filesystem::path> mine;
    if (backend.local_rank() == 0) {
      if (!rotation) {
        mine.push_back(o.checkpoint);
      } else {
        try {
          if (auto p = ls::latest_checkpoint(o.checkpoint)) mine.push_back(*p);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "train: %s\n", e.what());
          mine.push_back(rotation->pointer_path());  // counted as a file that does not verify
        }
      }
    }
    if (auto found = ls::resume_freshest(backend, ts, rescue_dir, mine)) {
      state_meta = std::move(found->metadata);
      resumed = true;
      if (root && found->rescue)
        std::printf("resuming from the rescue state %s of rank %d (step %lld, %s)\n", found->path.c_str(),
                    found->holder, static_cast<long long>(found->step), found->hash.c_str());
      resume_from = found->path;
    } else if (root) {
      std::printf("no checkpoint at %s and no rescue state: starting afresh (--resume auto)\n",
                  (rotation ? rotation->pointer_path().string() : o.checkpoint).c_str());
    }
  } else if (!o.resume.empty()) {
    if (rotation) {
      resume_from = ls::latest_checkpoint(backend, o.checkpoint);
      if (!resume_from && o.resume == "file")
        throw ls::CheckpointError("--resume: no checkpoint to resume from (" + rotation->pointer_path().string() +
                                  " does not exist); --resume auto starts afresh instead");
    } else if (o.resume == "auto") {
      double found = root && std::filesystem::exists(o.checkpoint) ? 1 : 0;
      ls::allreduce(backend, ls::view_of(std::span<double>(&found, 1)), ls::ReduceOp::sum);
      if (found > 0) resume_from = o.checkpoint;
    } else {
      resume_from = o.checkpoint;
    }
    if (!resume_from && root)
      std::printf("no checkpoint at %s: starting afresh (--resume auto)\n",
                  (rotation ? rotation->pointer_path().string() : o.checkpoint).c_str());
  }
  if (resume_from && !resumed) state_meta = ls::load_checkpoint(backend, *resume_from, ts);
  if (resume_from) {
    for (const char* key : {"seed", "samples", "batch", "micro_batch"}) {
      if (!run_meta.contains(key)) continue;
      const auto it = state_meta.find(key);
      // A checkpoint of an ordinary run may be continued deterministically (from there on the
      // run is reproducible); one of a deterministic run must keep its micro-batch size.
      if (it == state_meta.end() && std::string(key) == "micro_batch") continue;
      std::string flag = key;  // the metadata key names the flag: micro_batch is --micro-batch
      for (char& c : flag) c = c == '_' ? '-' : c;
      if (it == state_meta.end() || it->second != run_meta.at(key))
        throw ls::InvalidArgument("--resume: the checkpoint was written with --" + flag + " " +
                                  (it == state_meta.end() ? std::string("(missing)") : it->second) +
                                  " but this run has " + run_meta.at(key) +
                                  "; resume with the same flags");
    }
    losses = split_losses(state_meta["loss_history"]);
    if (static_cast<std::int64_t>(losses.size()) != epoch)
      throw ls::CheckpointError("--resume: the checkpoint's loss history has " + std::to_string(losses.size()) +
                                " entries for " + std::to_string(epoch) + " epochs");
    // A rescue state may end inside an epoch: the batches done of it and their loss sums.
    if (state_meta.contains("batches_done")) {
      batch_done = std::stoll(state_meta["batches_done"]);
      const auto sums = split_losses(state_meta["epoch_sums"]);
      if (batch_done < 0 || sums.size() != 2)
        throw ls::CheckpointError("--resume: bad position in the state: batches_done " + state_meta["batches_done"] + ", epoch_sums " +
                                  state_meta["epoch_sums"]);
      done_sums[0] = sums[0];
      done_sums[1] = sums[1];
    }
    if (root && batch_done > 0)
      std::printf("resumed from %s in epoch %lld after batch %lld (step %lld)\n", resume_from->c_str(),
                  static_cast<long long>(epoch + 1), static_cast<long long>(batch_done),
                  static_cast<long long>(state.inner.step));
    else if (root)
      std::printf("resumed from %s after epoch %lld (step %lld)\n", resume_from->c_str(),
                  static_cast<long long>(epoch), static_cast<long long>(state.inner.step));
  }
  if (root && o.deterministic)
    std::printf("training Dense(1=>256, tanh), Dense(256=>1) on y = x^3: %d ranks, %lld samples, "
                "global batch %lld (%lld micro-batches of %lld, deterministic), Adam lr %g, %lld epochs\n",
                ranks, static_cast<long long>(o.samples), static_cast<long long>(o.batch),
                static_cast<long long>(o.batch / o.micro_batch), static_cast<long long>(o.micro_batch),
                static_cast<double>(o.lr), static_cast<long long>(o.epochs));
  else if (root)
    std::printf("training Dense(1=>256, tanh), Dense(256=>1) on y = x^3: %d ranks, %lld samples, "
                "global batch %lld (%lld per rank), Adam lr %g, %lld epochs\n",
                ranks, static_cast<long long>(o.samples), static_cast<long long>(o.batch),
                static_cast<long long>(o.batch / ranks), static_cast<double>(o.lr),
                static_cast<long long>(o.epochs));

  auto last_save = std::chrono::steady_clock::now();
  std::int64_t saved_epoch = epoch;
  auto save = [&] {
    auto meta = run_meta;
    meta["epoch"] = std::to_string(epoch);
    meta["loss_history"] = join_losses(losses);
    meta[std::string(ls::kStepKey)] = std::to_string(state.inner.step);
    if (rotation) {
      const auto p = rotation->save(backend, epoch, ts, meta);
      if (root) std::printf("checkpoint %s (epoch %lld)\n", p.c_str(), static_cast<long long>(epoch));
    } else {
      ls::save_checkpoint(backend, o.checkpoint, ts, meta);
    }
    last_save = std::chrono::steady_clock::now();
    saved_epoch = epoch;
    // Rescue states of this step or older are superseded by the checkpoint just committed.
    if (o.rescue) ls::prune_rescue_states(rescue_dir, state.inner.step);
  };

  const std::int64_t share = o.batch / ranks;
  Workspace ws;
  const auto t_start = std::chrono::steady_clock::now();
  double samples_done = 0;
  const std::int64_t first_epoch = epoch;
  // A resumed run says when its first step is done (lockstep-run's figures: fault to first step).
  bool first_after_resume = resume_from.has_value();
  try {
  while (epoch < o.epochs) {
    const auto t0 = std::chrono::steady_clock::now();
    data.set_epoch(epoch);
    // Squared errors, samples (this rank; rank 0 starts from those of the batches of this epoch
    // done before a resume); a checkpoint due by time (rank 0).
    double sums[3] = {root ? done_sums[0] : 0, root ? done_sums[1] : 0, 0};
    const std::int64_t nb = o.deterministic ? data.num_batches() : data.num_batches(share);
    for (std::int64_t b = batch_done; b < nb; ++b) {
      if (o.deterministic) {
        deterministic_gradients(data, b, xs, ys, model, *grads, state, ws, sums);
      } else {
        const auto idx = data.batch(b, share);
        const auto m = static_cast<std::int64_t>(idx.size());
        ws.resize(m);
        for (std::int64_t i = 0; i < m; ++i) {
          ws.x[i] = xs[static_cast<std::size_t>(idx[i])];
          ws.y[i] = ys[static_cast<std::size_t>(idx[i])];
        }
#if LOCKSTEP_TRAIN_CUDA
        if (gpu) {
          Model& g = *grads;
          sums[0] += gpu->forward_backward(model.w1.data<float>(), model.b1.data<float>(), model.w2.data<float>(),
                                           model.b2.data<float>(), g.w1.data<float>(), g.b1.data<float>(),
                                           g.w2.data<float>(), g.b2.data<float>(), ws.x.data(), ws.y.data(),
                                           static_cast<int>(m));
        } else {
          sums[0] += forward_backward(model, *grads, ws, m, 2.0f / static_cast<float>(m));
        }
#else
        sums[0] += forward_backward(model, *grads, ws, m, 2.0f / static_cast<float>(m));
#endif
        sums[1] += static_cast<double>(m);
      }
      // --rescue: the epoch's global loss sums so far, this batch included, reduced before the
      // step so that a rescue state's loss curve goes on; they count once the step is done.
      double running[2] = {sums[0], sums[1]};
      if (o.rescue) ls::allreduce(backend, ls::view_of(std::span<double>(running, 2)), ls::ReduceOp::sum);
      if (o.deterministic)
        ls::apply_accumulated(state, model);
      else
        ls::update(state, model, *grads);
      ++batch_done;
      if (first_after_resume && root) {
        std::printf("first step after the resume done: step %lld\n", static_cast<long long>(state.inner.step));
        std::fflush(stdout);
      }
      first_after_resume = false;
      done_sums[0] = running[0];
      done_sums[1] = running[1];
    }
    // --checkpoint-seconds: rank 0's clock decides, and the decision travels with the sums.
    if (root && o.checkpoint_seconds > 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - last_save).count() >= o.checkpoint_seconds)
      sums[2] = 1;
    ls::allreduce(backend, ls::view_of(std::span<double>(sums, 3)), ls::ReduceOp::sum);
    const double loss = sums[0] / sums[1];
    losses.push_back(loss);
    ++epoch;
    batch_done = 0;
    done_sums[0] = done_sums[1] = 0;
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    samples_done += sums[1];
    if (root)
      std::printf("epoch %4lld  loss %.6e  %10.0f samples/s  %7.2f s\n", static_cast<long long>(epoch),
                  loss, sums[1] / dt, elapsed);
    const bool due = (o.checkpoint_every > 0 && epoch % o.checkpoint_every == 0) || sums[2] > 0;
    if (!o.checkpoint.empty() && due && epoch < o.epochs) save();
  }
  } catch (const std::exception& e) {
    // A failed collective leaves the model and Adam's state at the last completed step (a
    // step whose reduction failed was not applied): each surviving rank writes them, with the
    // position (epoch, batches done, their loss sums), to its host's rescue directory.
    if (o.rescue && ls::is_collective_failure(e)) {
      auto meta = run_meta;
      meta["epoch"] = std::to_string(epoch);
      meta["batches_done"] = std::to_string(batch_done);
      meta["epoch_sums"] = to_text(done_sums[0]) + "," + to_text(done_sums[1]);
      meta["loss_history"] = join_losses(losses);
      // Sharded with a buddy copy: the copy's step (a failed all-gather of the parameters may
      // have counted the failed step already).
      const std::int64_t done = state.buddy_copy() ? state.buddy_copy()->rule_step : state.inner.step;
      ls::write_rescue_state(rescue_dir, done, rank, ts, meta, o.rescue_seconds);
    }
    throw;
  }
  if (!o.checkpoint.empty() && (saved_epoch != epoch || !rotation)) save();
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

  if (root) {
    std::printf("done: %lld epochs (%lld this run) on %d ranks in %.2f s, %.0f samples/s\n",
                static_cast<long long>(epoch), static_cast<long long>(epoch - first_epoch), ranks, total,
                total > 0 ? samples_done / total : 0.0);
    std::printf("final loss %.8e\n", losses.empty() ? 0.0 : losses.back());
    if (!o.checkpoint.empty())
      std::printf("checkpoint: %s\n", rotation ? rotation->path_for(epoch).c_str() : o.checkpoint.c_str());
    if (!o.log.empty()) {
      FILE* f = std::fopen(o.log.c_str(), "w");
      if (f == nullptr) {
        std::fprintf(stderr, "train: cannot write %s\n", o.log.c_str());
        return 1;
      }
      std::fprintf(f, "epoch,loss\n");
      for (std::size_t e = 0; e < losses.size(); ++e) std::fprintf(f, "%zu,%s\n", e + 1, to_text(losses[e]).c_str());
      const bool ok = std::fclose(f) == 0;
      std::printf("loss CSV: %s%s\n", std::filesystem::absolute(o.log).c_str(), ok ? "" : " (write failed)");
      const std::string png = o.log + ".png";
      const std::string why_not = plot_losses(o.log, png);
      if (why_not.empty())
        std::printf("loss plot: %s\n", std::filesystem::absolute(png).c_str());
      else
        std::printf("loss plot: skipped: %s\n", why_not.c_str());
    }
    // The last line, always: the parameters' bytes in name order (io/model_hash.hpp).
    std::printf("model hash %s\n", ls::model_hash(model).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  ls::Backend* backend = &ls::get_distributed_backend<ls::MPIBackend>();
  const int ranks = backend->size();
#if LOCKSTEP_TRAIN_OPENBLAS
  // Each rank runs one BLAS thread: the ranks themselves use the cores, and a fixed thread
  // count keeps the sums in a fixed order (bitwise reproducible runs). --deterministic relies
  // on it: a micro-batch's gradient must be computed the same way on every rank. (Another BLAS
  // has no such call here: give it one thread through its own setting, e.g. OMP_NUM_THREADS=1.)
  openblas_set_num_threads(1);
#endif
  Options o;
  lockstep_cli::App app("train", "Data-parallel training of Dense(1 => 256, tanh), Dense(256 => 1) on y = x^3.\n"
                                 "Run as: mpiexec -n N train [flags]");
  add_flags(app, o, ranks);
  return lockstep_cli::run_main(app, argc, argv, [&] {
#if !LOCKSTEP_HAS_NCCL
    if (o.backend == "nccl")
      throw ls::NotCompiled("--backend nccl: this build has no NCCL; reconfigure with -DLOCKSTEP_WITH_NCCL=ON");
#endif
#if !LOCKSTEP_HAS_CUDA
    if (o.device == "cuda")
      throw ls::NotCompiled("--device cuda: this build has no CUDA; reconfigure with -DLOCKSTEP_WITH_CUDA=ON");
#elif !LOCKSTEP_TRAIN_CUDA
    if (o.device == "cuda")
      throw ls::NotCompiled("--device cuda: the train example was built without its CUDA part");
#endif
#if LOCKSTEP_TRAIN_CUDA && LOCKSTEP_HAS_NCCL
    if (o.backend == "nccl") {
      ls::initialize<ls::NCCLBackend>();
      backend = &ls::get_distributed_backend<ls::NCCLBackend>();
    }
#endif
    return run(o, *backend);
  });
}
