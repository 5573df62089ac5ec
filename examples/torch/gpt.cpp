// gpt: a byte-level GPT in LibTorch's C++ frontend, trained data-parallel with lockstep::torch on
// a text corpus that a Debian package ships: by default the English fortune cookies of package
// `fortunes` (/usr/share/games/fortunes, about 2.6 MB; scripts/install-deps.sh installs it).
//
// The model: token embedding (256 byte values) + positional embedding, N blocks of causal
// self-attention and an MLP (GELU), each behind a LayerNorm with a residual connection, a last
// LayerNorm, and an output head whose weight is the token embedding's (tied: one tensor under two
// names, "wte.weight" and "head.weight", as a model ported from Python has it). Dropout after the
// embeddings, on the attention weights and on each residual branch.
//
// The data: --data PATH is a file, or a directory whose regular files (not symbolic links, not
// fortune's *.dat indexes) are read in name order and concatenated. The first 90% of the bytes
// train, the last 10% validate (a fixed rule: no shuffle). Step s's global batch is --batch windows
// of block+1 bytes whose start offsets are a hash of (--seed, s, window index): the same windows at
// any rank count, and the data position of a run is its step count. Each rank takes its 1/N of the
// windows (--deterministic: whole micro-batches of --micro-batch windows, dealt by global index).
//
// Training: AdamW (betas 0.9, 0.95; weight decay 0.1 on the matrices only: linear weights and the
// embeddings, not biases or LayerNorm gains), learning rate warmed up linearly over --warmup steps
// then cosine down to a tenth, gradients clipped by their global 2-norm (1.0) across ranks
// (TorchOptions::max_grad_norm). Every --eval-every steps every rank scores a fixed set of
// validation windows (its share; the per-window losses are summed in window order), so every rank
// prints the same `step S train loss X val loss Y`; rank 0 prints it.
//
// Checkpoints (--checkpoint PATH, written every --checkpoint-every steps and at the end) hold, in
// one atomic file, the parameters (the tied weight once), AdamW's state, the step count (a buffer
// of the model, so the step, hence the schedule and the data position, can never disagree with the
// weights) and every rank's random-number generator state (dropout), in the file's metadata.
// --checkpoint-keep K rotates numbered files with a pointer STEM.latest; --resume continues from
// the checkpoint, --resume auto also starts fresh when there is none (a command rerun unchanged
// after a failure). Resumed at the same rank count, a run continues the uninterrupted run's loss
// curve; --deterministic also at any other rank count, bit for bit: each micro-batch's dropout
// masks are drawn from a generator seeded by (seed, step, micro-batch), its gradient is summed
// exactly (opt.accumulate()), and the model hash is the same at -n 1, 2 and 4.
//
// At the end rank 0 prints a sample of generated text and, last, `model hash crc32c:XXXXXXXX`.
//
// Run (from the repository root, after building into build/):
//   mpiexec -n 2 --oversubscribe build/examples/torch/gpt --preset small --log gpt.csv
//   mpiexec -n 2 --oversubscribe build/examples/torch/gpt --preset tiny --deterministic
//   lockstep-run -n 2 -- build/examples/torch/gpt --checkpoint run/ck --checkpoint-keep 3 --resume auto
// `gpt --help` lists every flag; docs/examples.md describes the output and the checkpoint.
#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#include "gpt_model.hpp"
#include "../common/allocator.hpp"
#include "../common/loss_plot.hpp"
#include "lockstep_cli.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ls = lockstep;
namespace lt = lockstep::torch;

namespace {

using gpt::Config;
using gpt::GPT;

constexpr const char* kDefaultData = "/usr/share/games/fortunes";

struct Options {
  std::string preset = "tiny";
  std::int64_t steps = -1;  // -1: the preset's
  std::int64_t stop_after = -1;
  std::int64_t batch = -1, micro_batch = -1, eval_every = -1, warmup = -1;
  double lr = -1;
  std::uint64_t seed = 1337;
  int threads = 1;
  std::string data = kDefaultData;
  std::string checkpoint;
  std::int64_t checkpoint_every = 0;
  int checkpoint_keep = 0;
  std::string resume;  // "", "file" or "auto"
  std::string log;
  bool deterministic = false;
  std::int64_t sample_bytes = -1;
};

// The presets: tiny trains in seconds (the tests), small shows a falling validation loss in a few
// minutes on 2 cores at -n 2.
struct Preset {
  Config model;
  std::int64_t steps, batch, micro_batch, eval_every, warmup, sample_bytes;
  double lr;
};
Preset preset_of(const std::string& name) {
  if (name == "small") return {{4, 4, 128, 64, 0.1}, 300, 32, 4, 25, 30, 300, 2e-3};
  return {{1, 2, 32, 32, 0.1}, 30, 8, 2, 10, 5, 80, 3e-3};
}

void add_flags(CLI::App& app, Options& o, int ranks) {
  namespace cli = lockstep_cli;
  app.add_option("--preset", o.preset, "model and run size: tiny (seconds) or small (minutes)")
      ->type_name("tiny|small")->check(cli::one_of({"tiny", "small"}));
  app.add_option("--steps", o.steps, "optimizer steps in total (the schedule's length; default: the preset's)")
      ->type_name("N")->check(cli::at_least(1));
  app.add_option("--stop-after", o.stop_after, "stop after step K of the --steps schedule (checkpoint, then exit)")
      ->type_name("K")->check(cli::at_least(0));
  app.add_option("--batch", o.batch, "global batch in windows of block+1 bytes (a multiple of N; with "
                 "--deterministic of --micro-batch)")->type_name("B")->check(cli::at_least(1));
  app.add_option("--micro-batch", o.micro_batch, "with --deterministic: windows per micro-batch")
      ->type_name("M")->check(cli::at_least(1));
  app.add_option("--lr", o.lr, "peak AdamW learning rate")->type_name("LR")->check(cli::positive());
  app.add_option("--warmup", o.warmup, "steps of linear warm-up before the cosine decay")->type_name("W")
      ->check(cli::at_least(0));
  app.add_option("--eval-every", o.eval_every, "validation loss every E steps (and at the last)")->type_name("E")
      ->check(cli::at_least(1));
  app.add_option("--seed", o.seed, "seed of the weights, the windows and dropout")->type_name("SEED")
      ->check(cli::at_least(0));
  app.add_option("--threads", o.threads, "LibTorch intra-op threads per rank")->type_name("T")->check(cli::at_least(1));
  app.add_option("--data", o.data, std::string("a text file, or a directory of them (default: ") + kDefaultData +
                 ", Debian package fortunes)")->type_name("PATH");
  app.add_option("--checkpoint", o.checkpoint, "write a checkpoint there every --checkpoint-every steps and at the end")
      ->type_name("PATH");
  app.add_option("--checkpoint-every", o.checkpoint_every, "steps between checkpoints (0: --eval-every)")
      ->type_name("K")->check(cli::at_least(0));
  app.add_option("--checkpoint-keep", o.checkpoint_keep,
                 "rotate: PATH's stem + -STEP.safetensors, STEM.latest naming the newest, the last K kept")
      ->type_name("K")->check(cli::at_least(0));
  app.add_option("--resume", o.resume, "continue from --checkpoint; 'auto': start fresh when there is none")
      ->type_name("[auto]")->expected(0, 1)->default_str("file")->check(cli::one_of({"file", "auto"}));
  app.add_option("--log", o.log, "write step, learning rate, train and validation loss there (CSV)")->type_name("CSV");
  app.add_flag("--deterministic", o.deterministic,
               "the same model bit for bit at any rank count (micro-batches, exact sums, dropout per micro-batch)");
  app.add_option("--sample", o.sample_bytes, "bytes of text generated at the end (0: none)")->type_name("BYTES")
      ->check(cli::at_least(0));
  app.callback([&o, ranks] {
    const Preset p = preset_of(o.preset);
    if (o.steps < 0) o.steps = p.steps;
    if (o.batch < 0) o.batch = p.batch;
    if (o.micro_batch < 0) o.micro_batch = p.micro_batch;
    if (o.eval_every < 0) o.eval_every = p.eval_every;
    if (o.warmup < 0) o.warmup = p.warmup;
    if (o.lr < 0) o.lr = p.lr;
    if (o.sample_bytes < 0) o.sample_bytes = p.sample_bytes;
    if (o.checkpoint_every == 0) o.checkpoint_every = o.eval_every;
    if (o.stop_after > o.steps)
      throw cli::refused("--stop-after", std::to_string(o.stop_after) + " is past --steps " + std::to_string(o.steps));
    if (o.deterministic && o.batch % o.micro_batch != 0)
      throw cli::refused("--batch", std::to_string(o.batch) + " is not a multiple of --micro-batch " +
                                        std::to_string(o.micro_batch));
    if (!o.deterministic && o.batch % ranks != 0)
      throw cli::refused("--batch", std::to_string(o.batch) + " is not a multiple of the " + std::to_string(ranks) +
                                        " ranks (the global batch is split evenly; --deterministic deals micro-batches)");
    if (!o.resume.empty() && o.checkpoint.empty()) throw cli::refused("--resume", "needs --checkpoint PATH");
    if (o.checkpoint_keep > 0 && o.checkpoint.empty()) throw cli::refused("--checkpoint-keep", "needs --checkpoint PATH");
  });
}

// SplitMix64: the windows' offsets and the dropout seeds, from a few integers.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
std::uint64_t mix(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0) { return mix(mix(mix(a) ^ b) ^ c); }

// The corpus: a file, or a directory's regular files in name order. "" on success.
std::string read_corpus(const std::string& path, std::vector<std::uint8_t>& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (e.is_regular_file() && !e.is_symlink() && e.path().extension() != ".dat") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    if (files.empty()) return "--data " + path + ": no text files in this directory";
  } else if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  } else {
    return "--data " + path + ": no such file or directory" +
           (path == kDefaultData ? " (apt-get install fortunes, or name a text file)" : "");
  }
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) return "--data: cannot read " + f.string();
    out.insert(out.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return "";
}

// Windows of block+1 bytes starting at `starts`: inputs and next-byte targets, [n, block] int64.
std::pair<torch::Tensor, torch::Tensor> windows(const std::vector<std::uint8_t>& text, std::int64_t base,
                                                const std::vector<std::int64_t>& starts, std::int64_t block) {
  auto w = torch::empty({static_cast<std::int64_t>(starts.size()), block + 1}, torch::kLong);
  auto* d = w.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < starts.size(); ++i)
    for (std::int64_t j = 0; j <= block; ++j)
      d[static_cast<std::int64_t>(i) * (block + 1) + j] = text[static_cast<std::size_t>(base + starts[i] + j)];
  return {w.narrow(1, 0, block), w.narrow(1, 1, block)};
}

// Sums per-item values that each rank filled for its own items (zeros elsewhere): the sum across
// ranks is exact (x + 0), and the total runs in item order, so every rank, at any rank count,
// gets the same value.
double agreed_sum(ls::Backend& backend, std::vector<double>& items) {
  if (!items.empty())
    backend.allreduce(ls::TensorView{items.data(), static_cast<std::int64_t>(items.size()), ls::DType::f64,
                                     ls::Device::cpu()}, ls::ReduceOp::sum);
  double s = 0;
  for (double v : items) s += v;
  return s;
}

// The learning rate of step s (0-based): linear warm-up to the peak, cosine down to a tenth.
double lr_at(const Options& o, std::int64_t s) {
  if (s < o.warmup) return o.lr * static_cast<double>(s + 1) / static_cast<double>(o.warmup);
  const double span = static_cast<double>(std::max<std::int64_t>(1, o.steps - o.warmup));
  const double t = std::min(1.0, static_cast<double>(s - o.warmup) / span);
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * t)));
}

// The default CPU generator's state (dropout's masks) as hex, and back.
std::string rng_state_hex() {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor st;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    st = gen.get_state();
  }
  static const char* digits = "0123456789abcdef";
  std::string s;
  const auto* p = st.data_ptr<std::uint8_t>();
  for (std::int64_t i = 0; i < st.numel(); ++i) (s += digits[p[i] >> 4]) += digits[p[i] & 15];
  return s;
}
bool set_rng_state_hex(const std::string& s) {
  if (s.size() % 2 != 0) return false;
  auto st = torch::empty({static_cast<std::int64_t>(s.size() / 2)}, torch::kByte);
  auto* p = st.data_ptr<std::uint8_t>();
  auto nib = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (std::size_t i = 0; i < s.size() / 2; ++i) p[i] = static_cast<std::uint8_t>(nib(s[2 * i]) * 16 + nib(s[2 * i + 1]));
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(st);
  return true;
}

// Every rank's generator state, gathered (one allgather of fixed-size hex strings).
std::vector<std::string> gather_rng(ls::Backend& backend) {
  const std::string mine = rng_state_hex();
  const std::int64_t n = static_cast<std::int64_t>(mine.size());
  std::vector<char> all(static_cast<std::size_t>(n * backend.size()));
  backend.allgather(ls::TensorView{const_cast<char*>(mine.data()), n, ls::DType::u8, ls::Device::cpu()},
                    ls::TensorView{all.data(), n * backend.size(), ls::DType::u8, ls::Device::cpu()});
  std::vector<std::string> out;
  for (int r = 0; r < backend.size(); ++r) out.emplace_back(all.data() + r * n, static_cast<std::size_t>(n));
  return out;
}

int run(const Options& o, ls::Backend& backend) {
  const int rank = backend.rank(), ranks = backend.size();
  const bool root = rank == 0;
  torch::set_num_threads(o.threads);
  const Preset preset = preset_of(o.preset);
  const Config cfg = preset.model;
  const std::int64_t T = cfg.block;

  // Every rank reads the corpus; they agree on success before training.
  std::vector<std::uint8_t> text;
  std::string read_error = read_corpus(o.data, text);
  if (read_error.empty() && static_cast<std::int64_t>(text.size()) < 20 * (T + 1))
    read_error = "--data " + o.data + ": " + std::to_string(text.size()) + " bytes, too few for windows of " +
                 std::to_string(T + 1) + " (at least " + std::to_string(20 * (T + 1)) + ")";
  std::int32_t ok = read_error.empty() ? 1 : 0;
  backend.allreduce(ls::TensorView{&ok, 1, ls::DType::i32, ls::Device::cpu()}, ls::ReduceOp::min);
  if (!read_error.empty()) throw ls::InvalidArgument(read_error);
  if (ok == 0) throw ls::InvalidArgument("another rank could not read the corpus (see its message)");
  const std::int64_t n_bytes = static_cast<std::int64_t>(text.size());
  const std::int64_t n_train = n_bytes * 9 / 10, n_val = n_bytes - n_train;
  const std::int64_t val_windows = 4 * o.batch;

  torch::manual_seed(o.seed);
  GPT net(cfg);
  lt::synchronize(backend, *net, 0);  // the same start on every rank whatever its generator did

  // AdamW with two groups: decay for the matrices, none for biases and LayerNorm gains. The tied
  // weight is listed once (named_parameters lists it under both of its names).
  std::vector<torch::Tensor> decay, no_decay;
  {
    std::vector<const void*> seen;
    for (const auto& p : net->named_parameters()) {
      if (std::find(seen.begin(), seen.end(), p.value().unsafeGetTensorImpl()) != seen.end()) continue;
      seen.push_back(p.value().unsafeGetTensorImpl());
      (p.value().dim() >= 2 ? decay : no_decay).push_back(p.value());
    }
  }
  auto group_options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, group_options(0.1));
  groups.emplace_back(no_decay, group_options(0.0));
  torch::optim::AdamW adamw(std::move(groups), torch::optim::AdamWOptions(o.lr));

  // What a checkpoint must match to be resumed by this command.
  std::map<std::string, std::string> run_meta{{"preset", o.preset},
                                              {"seed", std::to_string(o.seed)},
                                              {"steps", std::to_string(o.steps)},
                                              {"batch", std::to_string(o.batch)}};
  if (o.deterministic) run_meta["micro_batch"] = std::to_string(o.micro_batch);

  std::optional<ls::CheckpointRotation> rotation;
  if (o.checkpoint_keep > 0) rotation.emplace(o.checkpoint, o.checkpoint_keep);
  std::optional<std::filesystem::path> resume_from;
  if (!o.resume.empty()) {
    if (rotation) {
      resume_from = ls::latest_checkpoint(backend, o.checkpoint);
    } else {
      double found = root && std::filesystem::exists(o.checkpoint) ? 1 : 0;
      backend.allreduce(ls::TensorView{&found, 1, ls::DType::f64, ls::Device::cpu()}, ls::ReduceOp::sum);
      if (found > 0) resume_from = o.checkpoint;
    }
    if (!resume_from && o.resume == "file")
      throw ls::CheckpointError("--resume: no checkpoint at " +
                                (rotation ? rotation->pointer_path().string() : o.checkpoint) +
                                "; --resume auto starts afresh instead");
    if (!resume_from && root)
      std::printf("no checkpoint at %s: starting afresh (--resume auto)\n",
                  (rotation ? rotation->pointer_path().string() : o.checkpoint).c_str());
  }
  // Dropout: in ordinary mode each rank draws from its own stream (seeded by the seed and the
  // rank; a checkpoint restores it); --deterministic reseeds it per micro-batch below.
  torch::manual_seed(mix(o.seed, 1000 + static_cast<std::uint64_t>(rank)));
  if (resume_from) {
    const auto meta = lt::load_checkpoint(backend, *resume_from, *net, adamw);
    for (const auto& [key, want] : run_meta) {
      const auto it = meta.find(key);
      if (it == meta.end() || it->second != want)
        throw ls::InvalidArgument("--resume: " + resume_from->string() + " was written with " + key + " " +
                                  (it == meta.end() ? std::string("(none)") : it->second) + ", this run has " + want +
                                  " (resume with the same --preset, --seed, --steps, --batch and --micro-batch)");
    }
    const auto saved_ranks = meta.find("ranks");
    const auto my_rng = meta.find("rng." + std::to_string(rank));
    if (saved_ranks != meta.end() && saved_ranks->second == std::to_string(ranks) && my_rng != meta.end()) {
      set_rng_state_hex(my_rng->second);
    } else if (root && !o.deterministic) {
      std::printf("note: the checkpoint was written at %s ranks: dropout streams start afresh at %d\n",
                  saved_ranks == meta.end() ? "?" : saved_ranks->second.c_str(), ranks);
    }
    if (root)
      std::printf("resumed from %s after step %lld\n", resume_from->string().c_str(),
                  static_cast<long long>(net->step_done.item<std::int64_t>()));
  }

  lt::DistributedOptimizer opt(backend, adamw, ls::DistributedOptions{.deterministic = o.deterministic},
                               lt::TorchOptions{.names_from = net.get(), .deterministic_threads = o.threads,
                                                .max_grad_norm = 1.0});

  const std::int64_t first_step = net->step_done.item<std::int64_t>();
  const std::int64_t last_step = o.stop_after >= 0 ? o.stop_after : o.steps;
  if (root) {
    std::printf("gpt %s: %lld layers, %lld heads, width %lld, context %lld bytes, %lld parameters; %lld bytes of "
                "%s (%lld train, %lld validation); %d ranks, global batch %lld windows",
                o.preset.c_str(), static_cast<long long>(cfg.layers), static_cast<long long>(cfg.heads),
                static_cast<long long>(cfg.width), static_cast<long long>(T),
                static_cast<long long>(gpt::count_parameters(*net)), static_cast<long long>(n_bytes), o.data.c_str(),
                static_cast<long long>(n_train), static_cast<long long>(n_val), ranks, static_cast<long long>(o.batch));
    if (o.deterministic)
      std::printf(" (%lld micro-batches of %lld, deterministic)", static_cast<long long>(o.batch / o.micro_batch),
                  static_cast<long long>(o.micro_batch));
    std::printf(", AdamW lr %g, %lld steps\n", o.lr, static_cast<long long>(o.steps));
    std::fflush(stdout);
  }

  // The CSV (rank 0): on a resume, the rows up to the checkpoint's step are kept.
  // Whether it can be written is agreed (rank 0's failure is every rank's error, not a hang).
  std::ofstream csv;
  std::int32_t csv_ok = 1;
  if (root && !o.log.empty()) {
    std::vector<std::string> kept;
    if (first_step > 0) {
      std::ifstream old(o.log);
      std::string line;
      while (std::getline(old, line)) {
        const std::string step_field = line.substr(0, line.find(','));
        if (!step_field.empty() && std::all_of(step_field.begin(), step_field.end(), ::isdigit) &&
            std::stoll(step_field) <= first_step)
          kept.push_back(line);
      }
    }
    csv.open(o.log, std::ios::trunc);
    csv << "step,lr,train_loss,val_loss\n";
    for (const auto& l : kept) csv << l << "\n";
    csv.flush();
    csv_ok = csv ? 1 : 0;
  }
  backend.broadcast(ls::TensorView{&csv_ok, 1, ls::DType::i32, ls::Device::cpu()}, 0);
  if (csv_ok == 0) throw ls::InvalidArgument("--log " + o.log + ": rank 0 cannot write this file");

  const ls::MicroBatches mine =
      o.deterministic ? ls::micro_batches_of(o.batch, o.micro_batch, rank, ranks) : ls::MicroBatches{};
  const std::int64_t share = o.deterministic ? 0 : o.batch / ranks;
  auto train_starts = [&](std::int64_t step, std::int64_t from, std::int64_t count) {
    std::vector<std::int64_t> s;
    for (std::int64_t i = from; i < from + count; ++i)
      s.push_back(static_cast<std::int64_t>(mix(o.seed, static_cast<std::uint64_t>(step), static_cast<std::uint64_t>(i)) %
                                            static_cast<std::uint64_t>(n_train - T - 1)));
    return s;
  };
  auto cross_entropy = [&](const torch::Tensor& logits, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, gpt::kVocab}), y.reshape({-1}));
  };

  // The validation loss: val_windows fixed windows, evenly spaced; each rank scores its share.
  auto validate = [&] {
    torch::NoGradGuard no_grad;
    net->eval();
    std::vector<double> losses(static_cast<std::size_t>(val_windows), 0.0);
    const std::int64_t lo = val_windows * rank / ranks, hi = val_windows * (rank + 1) / ranks;
    for (std::int64_t a = lo; a < hi; a += o.batch) {
      const std::int64_t b = std::min(hi, a + o.batch);
      std::vector<std::int64_t> starts;
      for (std::int64_t j = a; j < b; ++j) starts.push_back(j * (n_val - T - 1) / val_windows);
      auto [x, y] = windows(text, n_train, starts, T);
      auto per = torch::nn::functional::cross_entropy(
                     net->forward(x).reshape({-1, gpt::kVocab}), y.reshape({-1}),
                     torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
                     .view({b - a, T})
                     .mean(1)
                     .to(torch::kDouble);
      for (std::int64_t j = a; j < b; ++j) losses[static_cast<std::size_t>(j)] = per[j - a].item<double>();
    }
    net->train();
    return agreed_sum(backend, losses) / static_cast<double>(val_windows);
  };

  auto save = [&](std::int64_t step) {
    std::map<std::string, std::string> meta = run_meta;
    meta["ranks"] = std::to_string(ranks);
    const auto states = gather_rng(backend);
    for (int r = 0; r < ranks; ++r) meta["rng." + std::to_string(r)] = states[static_cast<std::size_t>(r)];
    if (!rotation) {
      lt::save_checkpoint(backend, o.checkpoint, *net, adamw, meta);
      return;
    }
    if (root) rotation->create_directory();
    lt::save_checkpoint(backend, rotation->path_for(step), *net, adamw, meta);
    std::int32_t committed = 1;
    if (root) {
      try {
        rotation->commit(step);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        committed = 0;
      }
    }
    backend.broadcast(ls::TensorView{&committed, 1, ls::DType::i32, ls::Device::cpu()}, 0);
    if (committed == 0)
      throw ls::CheckpointError("the checkpoint of step " + std::to_string(step) + " was written but rank 0 could "
                                "not commit it (its message says why)");
  };

  net->train();
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t step = first_step;
  double train_loss = NAN, val_loss = NAN;
  while (step < last_step) {
    const double lr = lr_at(o, step);
    for (auto& g : adamw.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    opt.zero_grad();
    std::vector<double> losses;
    if (o.deterministic) {
      // Each micro-batch alone: its dropout masks from (seed, step, micro-batch), its gradient
      // into the exact sum. The step divides by the total count: the mean over the global batch.
      losses.assign(static_cast<std::size_t>(mine.total), 0.0);
      for (std::int64_t m : mine) {
        torch::manual_seed(mix(o.seed, static_cast<std::uint64_t>(step), 1000000 + static_cast<std::uint64_t>(m)));
        auto [x, y] = windows(text, 0, train_starts(step, m * o.micro_batch, o.micro_batch), T);
        auto loss = cross_entropy(net->forward(x), y);
        loss.backward();
        opt.accumulate();
        losses[static_cast<std::size_t>(m)] = loss.item<double>();
      }
    } else {
      losses.assign(static_cast<std::size_t>(ranks), 0.0);
      auto [x, y] = windows(text, 0, train_starts(step, rank * share, share), T);
      auto loss = cross_entropy(net->forward(x), y);
      loss.backward();  // buckets are averaged across ranks as backward goes
      losses[static_cast<std::size_t>(rank)] = loss.item<double>();
    }
    opt.step();  // clipped by the global norm, then AdamW
    ++step;
    net->step_done.fill_(step);
    train_loss = agreed_sum(backend, losses) / static_cast<double>(losses.size());
    const bool eval = step % o.eval_every == 0 || step == last_step;
    if (eval) val_loss = validate();
    if (root) {
      if (eval) {
        std::printf("step %lld train loss %.4f val loss %.4f (lr %.2e, grad norm %.3f)\n", static_cast<long long>(step),
                    train_loss, val_loss, lr, opt.last_grad_norm());
        std::fflush(stdout);
      }
      if (csv.is_open()) {
        csv << step << "," << lr << "," << train_loss << ",";
        if (eval) csv << val_loss;
        csv << "\n" << std::flush;
      }
    }
    if (!o.checkpoint.empty() && (step % o.checkpoint_every == 0 || step == last_step)) save(step);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (step == first_step) val_loss = validate();
  if (root) {
    const double tokens = static_cast<double>((step - first_step) * o.batch * T);
    std::printf("done: step %lld of %lld (%lld this run) on %d ranks in %.2f s, %.0f tokens/s\n",
                static_cast<long long>(step), static_cast<long long>(o.steps),
                static_cast<long long>(step - first_step), ranks, seconds, seconds > 0 ? tokens / seconds : 0.0);
    std::printf("final val loss %.6f\n", val_loss);
    if (o.sample_bytes > 0) {
      // Sampled at temperature 0.8 from a generator of its own: the same text for the same model.
      const std::string sample = gpt::generate(*net, o.sample_bytes, 0.8, o.seed);
      std::printf("sample:\n%s\n", sample.c_str());
    }
    if (!o.log.empty()) {
      csv.close();
      const std::string png = o.log + ".png";
      const std::string why_not = examples::plot_csv(
          o.log, png, "set xlabel 'step'\nset ylabel 'loss (nats per byte)'\nset title 'lockstep gpt'\n",
          "plot '%s' using 1:3 skip 1 with lines title 'train', '' using 1:4 skip 1 with linespoints title 'validation'");
      if (why_not.empty())
        std::printf("loss plot: %s\n", std::filesystem::absolute(png).c_str());
      else
        std::printf("loss plot: skipped: %s\n", why_not.c_str());
    }
    std::printf("model hash %s\n", lt::model_hash(*net).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  examples::keep_freed_memory();  // each step's temporaries stay mapped (examples/common/allocator.hpp)
  ls::initialize<ls::MPIBackend>();
  ls::Backend& backend = ls::get_distributed_backend<ls::MPIBackend>();
  const int ranks = backend.size();
  Options o;
  lockstep_cli::App app("gpt", "A byte-level GPT trained on a text corpus with lockstep::torch.\n"
                               "Run as: mpiexec -n N gpt [flags]");
  add_flags(app, o, ranks);
  return lockstep_cli::run_main(app, argc, argv, [&] { return run(o, backend); });
}
