// maml: TorchOpt's distributed MAML example, in SPMD form and in its driver/worker form, on
// few-shot sine regression.
//
// Each meta-iteration draws a batch of tasks (sine waves y = A sin(x - phase), A in [0.1, 5],
// phase in [0, pi], x in [-5, 5]); `parallelize` with `exclusive_batch_partitioner` spreads the
// tasks over the ranks, each rank adapts the meta-model to each of its tasks (inner loop: plain
// gradient steps on K support points) and returns the query loss and its gradient; `mean_reducer`
// averages both over all tasks and ranks, and every rank applies the same Adam step to the
// meta-model, so the replicas stay in lockstep. TorchOpt runs this with RPC workers; here every
// rank is a worker.
//
// The model is the MAML paper's MLP 1 => 40 => 40 => 1 (ReLU) with hand-written gradients.
// This is FIRST-ORDER MAML (FOMAML): the meta-gradient is the query-loss gradient at the adapted
// weights, without differentiating through the inner loop (no second derivatives).
//
// Progress is measured on held-out tasks: the loss on their query points after adapting on their
// support points; it falls as the meta-model learns a good starting point.
//
// With --driver it runs in TorchOpt's own form instead: main's work is wrapped by
// ls::auto_init_rpc (a remote session on every rank), rank 0 holds the meta-model and runs the
// outer loop (ls::rank_zero_only), and the other ranks return at once and serve, in the session's
// graceful close, the tasks that come to them as remote calls (ls::remote_parallelize_sync with
// exclusive_batch_partitioner and mean_reducer over the registered functions meta_task and
// eval_task; docs/remote.md). Same seed, same result as the SPMD form.
//
// Run (from the repository root, after building into build/):
//   mpiexec -n 4 --oversubscribe build/examples/parallelize/maml
// `maml --help` lists the flags; docs/examples.md shows the expected output.
#include <lockstep/lockstep.hpp>

#include "lockstep_cli.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace ls = lockstep;

namespace {

constexpr int kHidden = 40;
constexpr double kPi = 3.14159265358979323846;

/// MLP 1 => 40 => 40 => 1 with ReLU; weights out x in.
struct MLP {
  ls::Tensor w1, b1, w2, b2, w3, b3;
};
LOCKSTEP_FIELDS(MLP, w1, b1, w2, b2, w3, b3)

/// What one task contributes: the gradient of its query loss at the adapted weights (first-order
/// meta-gradient) and the query loss itself. parallelize averages both over the tasks.
struct TaskResult {
  MLP grad;
  double loss = 0;
};
LOCKSTEP_FIELDS(TaskResult, grad, loss)

struct Options {
  int iterations = 1000;
  int tasks = 16;         // meta-batch
  int shots = 10;         // K support points per task
  int queries = 10;       // query points per task
  int inner_steps = 1;
  float inner_lr = 0.01f;
  float meta_lr = 1e-3f;
  int eval_tasks = 32;
  int eval_every = 100;
  std::uint64_t seed = 1;
  bool driver = false;  // TorchOpt's form: rank 0 drives, the others run tasks by remote calls
};

/// The flags, one line each; lockstep_cli::parse then checks them the same way on every rank.
void add_flags(CLI::App& app, Options& o) {
  namespace cli = lockstep_cli;
  app.add_option("--iterations", o.iterations, "meta-iterations")->type_name("I")->check(cli::at_least(0));
  app.add_option("--tasks", o.tasks, "tasks per meta-batch, spread over the ranks")->type_name("T")
      ->check(cli::at_least(1));
  app.add_option("--shots", o.shots, "support points per task")->type_name("K")->check(cli::at_least(1));
  app.add_option("--queries", o.queries, "query points per task")->type_name("Q")->check(cli::at_least(1));
  app.add_option("--inner-steps", o.inner_steps, "adaptation steps per task")->type_name("S")
      ->check(cli::at_least(0));
  app.add_option("--inner-lr", o.inner_lr, "adaptation step size")->type_name("A")->check(cli::at_least(0));
  app.add_option("--meta-lr", o.meta_lr, "Adam learning rate of the meta-model")->type_name("B")
      ->check(cli::positive());
  app.add_option("--eval-tasks", o.eval_tasks, "held-out tasks")->type_name("E")->check(cli::at_least(1));
  app.add_option("--eval-every", o.eval_every, "evaluate every P iterations")->type_name("P")
      ->check(cli::at_least(1));
  app.add_option("--seed", o.seed, "seed")->type_name("SEED")->check(cli::at_least(0));
  app.add_flag("--driver", o.driver,
               "TorchOpt's driver/worker form: rank 0 runs the outer loop and sends the tasks to every "
               "rank by remote calls (same result as the SPMD form)");
}

/// Uniform double in [0, 1) from the top 53 bits (std:: distributions differ between libraries).
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

/// Kaiming-uniform-like weights and zero biases (PyTorch's Linear default, roughly).
MLP init_mlp(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  MLP m{ls::Tensor::empty({kHidden, 1}), ls::Tensor::zeros({kHidden}), ls::Tensor::empty({kHidden, kHidden}),
        ls::Tensor::zeros({kHidden}), ls::Tensor::empty({1, kHidden}), ls::Tensor::zeros({1})};
  auto fill = [&](ls::Tensor& w, int fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    for (float& v : w.span<float>()) v = static_cast<float>((2 * uniform01(rng) - 1) * bound);
  };
  fill(m.w1, 1), fill(m.w2, kHidden), fill(m.w3, kHidden);
  fill(m.b1, 1), fill(m.b2, kHidden), fill(m.b3, kHidden);
  return m;
}

/// Mean squared error of the MLP on (x, y); if g is given, its gradient is written there.
double mse(const MLP& m, const std::vector<float>& x, const std::vector<float>& y, MLP* g) {
  const int n = static_cast<int>(x.size());
  const float* w1 = m.w1.data<float>();
  const float* b1 = m.b1.data<float>();
  const float* w2 = m.w2.data<float>();
  const float* b2 = m.b2.data<float>();
  const float* w3 = m.w3.data<float>();
  const float b3 = *m.b3.data<float>();
  if (g != nullptr) ls::for_each_tensor(*g, [](ls::Tensor& t) { t.zero_(); });
  float a1[kHidden], a2[kHidden], d2[kHidden], d1[kHidden];
  double loss = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < kHidden; ++j) a1[j] = std::max(0.0f, w1[j] * x[i] + b1[j]);
    for (int j = 0; j < kHidden; ++j) {
      float z = b2[j];
      for (int k = 0; k < kHidden; ++k) z += w2[j * kHidden + k] * a1[k];
      a2[j] = std::max(0.0f, z);
    }
    float out = b3;
    for (int j = 0; j < kHidden; ++j) out += w3[j] * a2[j];
    const float err = out - y[i];
    loss += static_cast<double>(err) * err;
    if (g == nullptr) continue;
    const float dout = 2.0f * err / static_cast<float>(n);
    *g->b3.data<float>() += dout;
    float* gw3 = g->w3.data<float>();
    for (int j = 0; j < kHidden; ++j) {
      gw3[j] += dout * a2[j];
      d2[j] = a2[j] > 0 ? dout * w3[j] : 0.0f;
    }
    float* gw2 = g->w2.data<float>();
    float* gb2 = g->b2.data<float>();
    for (int k = 0; k < kHidden; ++k) d1[k] = 0;
    for (int j = 0; j < kHidden; ++j) {
      gb2[j] += d2[j];
      for (int k = 0; k < kHidden; ++k) {
        gw2[j * kHidden + k] += d2[j] * a1[k];
        d1[k] += d2[j] * w2[j * kHidden + k];
      }
    }
    float* gw1 = g->w1.data<float>();
    float* gb1 = g->b1.data<float>();
    for (int k = 0; k < kHidden; ++k) {
      const float dz = a1[k] > 0 ? d1[k] : 0.0f;
      gw1[k] += dz * x[i];
      gb1[k] += dz;
    }
  }
  return loss / n;
}

/// One task's points: support and query sets of y = amp sin(x - phase), x uniform in [-5, 5).
struct TaskData {
  std::vector<float> xs, ys, xq, yq;
};
TaskData sample_points(double amp, double phase, std::uint64_t seed, int shots, int queries) {
  std::mt19937_64 rng(seed);
  TaskData d;
  auto draw = [&](std::vector<float>& x, std::vector<float>& y, int n) {
    for (int i = 0; i < n; ++i) {
      const double xi = -5.0 + 10.0 * uniform01(rng);
      x.push_back(static_cast<float>(xi));
      y.push_back(static_cast<float>(amp * std::sin(xi - phase)));
    }
  };
  draw(d.xs, d.ys, shots);
  draw(d.xq, d.yq, queries);
  return d;
}

/// A batch of tasks as an f64 tensor [T, 3]: amplitude, phase, seed of the task's points.
/// Every rank draws the same batch; the partitioner decides who runs which task.
ls::Tensor sample_tasks(std::mt19937_64& rng, int n) {
  ls::Tensor t = ls::Tensor::empty({n, 3}, ls::DType::f64);
  double* p = t.data<double>();
  for (int i = 0; i < n; ++i) {
    p[3 * i] = 0.1 + 4.9 * uniform01(rng);
    p[3 * i + 1] = kPi * uniform01(rng);
    p[3 * i + 2] = static_cast<double>(rng() >> 12);  // exact in a double
  }
  return t;
}

/// Inner loop: `steps` gradient steps of size lr on the support set, from the meta-model.
MLP adapt(const MLP& meta, const TaskData& d, int steps, float lr) {
  MLP fast = ls::clone_tree(meta);
  MLP g = ls::zeros_like(meta);
  for (int s = 0; s < steps; ++s) {
    mse(fast, d.xs, d.ys, &g);
    auto fp = ls::tensor_leaves(fast);
    auto gp = ls::tensor_leaves(g);
    for (std::size_t i = 0; i < fp.size(); ++i) {
      auto f = fp[i]->span<float>();
      auto gg = gp[i]->span<const float>();
      for (std::size_t k = 0; k < f.size(); ++k) f[k] -= lr * gg[k];
    }
  }
  return fast;
}

struct EvalResult {
  double before = 0;  // query loss of the meta-model itself
  double after = 0;   // query loss after adaptation
};
LOCKSTEP_FIELDS(EvalResult, before, after)

// ---- TorchOpt's form: remote functions, run wherever the partitioner sends a task ----

/// One meta-training task (a row amplitude, phase, seed): adapt, then the first-order
/// meta-gradient on the query set.
TaskResult meta_task(const MLP& meta, const ls::Tensor& task, int shots, int queries, int inner_steps,
                     float inner_lr) {
  const double* t = task.data<double>();
  const TaskData d = sample_points(t[0], t[1], static_cast<std::uint64_t>(t[2]), shots, queries);
  const MLP fast = adapt(meta, d, inner_steps, inner_lr);
  TaskResult r{ls::zeros_like(meta), 0.0};
  r.loss = mse(fast, d.xq, d.yq, &r.grad);
  return r;
}

/// One held-out task: query loss before and after adaptation.
EvalResult eval_task(const MLP& meta, const ls::Tensor& task, int shots, int inner_steps, float inner_lr) {
  const double* t = task.data<double>();
  const TaskData d = sample_points(t[0], t[1], static_cast<std::uint64_t>(t[2]), shots, 100);
  EvalResult e;
  e.before = mse(meta, d.xq, d.yq, nullptr);
  e.after = mse(adapt(meta, d, inner_steps, inner_lr), d.xq, d.yq, nullptr);
  return e;
}

}  // namespace
LOCKSTEP_REMOTE(meta_task)
LOCKSTEP_REMOTE(eval_task)
namespace {

/// The outer loop, on rank 0.
int outer_loop(const Options& o, ls::Backend& backend) {
  MLP meta = init_mlp(o.seed * 1000);  // what synchronize gives every rank in the SPMD form
  auto state = ls::setup(ls::Adam{.lr = o.meta_lr}, meta);
  auto meta_batch = ls::remote_parallelize_sync(backend, ls::exclusive_batch_partitioner, ls::mean_reducer, meta_task);
  auto evaluate = ls::remote_parallelize_sync(backend, ls::exclusive_batch_partitioner, ls::mean_reducer, eval_task);
  std::mt19937_64 eval_rng(o.seed ^ 0xE7A1ull);
  const ls::Tensor eval_tasks = sample_tasks(eval_rng, o.eval_tasks);
  std::printf("first-order MAML on sine regression (driver form): %d ranks, %d tasks per meta-batch, "
              "%d-shot, %d inner step(s) of %g, Adam %g\n",
              backend.size(), o.tasks, o.shots, o.inner_steps, static_cast<double>(o.inner_lr),
              static_cast<double>(o.meta_lr));
  std::mt19937_64 task_rng(o.seed);
  double first_after = 0, last_after = 0, train_loss = 0;
  for (int it = 0; it <= o.iterations; ++it) {
    if (it % o.eval_every == 0 || it == o.iterations) {
      const EvalResult e = evaluate(meta, eval_tasks, o.shots, o.inner_steps, o.inner_lr);
      if (it == 0) first_after = e.after;
      last_after = e.after;
      std::printf("iter %5d  meta-batch loss %8.4f  held-out loss before adaptation %8.4f  "
                  "after %8.4f\n",
                  it, it == 0 ? std::nan("") : train_loss, e.before, e.after);
    }
    if (it == o.iterations) break;
    const ls::Tensor tasks = sample_tasks(task_rng, o.tasks);
    TaskResult r = meta_batch(meta, tasks, o.shots, o.queries, o.inner_steps, o.inner_lr);
    train_loss = r.loss;
    ls::update(state, meta, r.grad);
  }
  std::printf("held-out post-adaptation loss: %.4f -> %.4f (%.0f%% lower)\n", first_after, last_after,
              first_after > 0 ? 100.0 * (1.0 - last_after / first_after) : 0.0);
  std::fflush(stdout);
  return 0;
}

/// TorchOpt's form (its @auto_init_rpc main with a @rank_zero_only outer loop): rank 0 holds
/// the meta-model and its optimizer and runs the outer loop; every rank (rank 0 too, while it
/// waits) runs the tasks that exclusive_batch_partitioner sends it, and mean_reducer averages
/// the results on rank 0. The other ranks' function returns at once: they serve in the close of
/// the session, until rank 0's has returned.
int run_driver_form(const Options& o, ls::Backend& backend) {
  auto main_fn = ls::auto_init_rpc()(
      [&] { return ls::rank_zero_only([&] { return outer_loop(o, backend); }).value_or(0); });
  return main_fn();
}

int run(const Options& o, ls::Backend& backend) {
  if (o.driver) return run_driver_form(o, backend);
  const bool root = backend.rank() == 0;
  // Every rank starts from its own random model; synchronize makes them all rank 0's.
  MLP meta = init_mlp(o.seed * 1000 + static_cast<std::uint64_t>(backend.rank()));
  ls::synchronize(backend, meta, 0);
  auto state = ls::setup(ls::Adam{.lr = o.meta_lr}, meta);

  // One meta-training task: adapt, then the first-order meta-gradient on the query set.
  auto meta_batch = ls::parallelize(backend, ls::exclusive_batch_partitioner, ls::mean_reducer,
                                    [&](const ls::Tensor& task) {
                                      const double* t = task.data<double>();
                                      const TaskData d = sample_points(t[0], t[1], static_cast<std::uint64_t>(t[2]),
                                                                       o.shots, o.queries);
                                      const MLP fast = adapt(meta, d, o.inner_steps, o.inner_lr);
                                      TaskResult r{ls::zeros_like(meta), 0.0};
                                      r.loss = mse(fast, d.xq, d.yq, &r.grad);
                                      return r;
                                    });
  // Held-out evaluation, spread over the ranks the same way (more query points, fixed tasks).
  std::mt19937_64 eval_rng(o.seed ^ 0xE7A1ull);
  const ls::Tensor eval_tasks = sample_tasks(eval_rng, o.eval_tasks);
  auto evaluate = ls::parallelize(backend, ls::exclusive_batch_partitioner, ls::mean_reducer,
                                  [&](const ls::Tensor& task) {
                                    const double* t = task.data<double>();
                                    const TaskData d = sample_points(t[0], t[1], static_cast<std::uint64_t>(t[2]),
                                                                     o.shots, 100);
                                    EvalResult e;
                                    e.before = mse(meta, d.xq, d.yq, nullptr);
                                    e.after = mse(adapt(meta, d, o.inner_steps, o.inner_lr), d.xq, d.yq, nullptr);
                                    return e;
                                  });

  if (root)
    std::printf("first-order MAML on sine regression: %d ranks, %d tasks per meta-batch, %d-shot, "
                "%d inner step(s) of %g, Adam %g\n",
                backend.size(), o.tasks, o.shots, o.inner_steps, static_cast<double>(o.inner_lr),
                static_cast<double>(o.meta_lr));
  std::mt19937_64 task_rng(o.seed);
  double first_after = 0, last_after = 0, train_loss = 0;
  for (int it = 0; it <= o.iterations; ++it) {
    if (it % o.eval_every == 0 || it == o.iterations) {
      const EvalResult e = evaluate(eval_tasks);
      if (it == 0) first_after = e.after;
      last_after = e.after;
      if (root)
        std::printf("iter %5d  meta-batch loss %8.4f  held-out loss before adaptation %8.4f  "
                    "after %8.4f\n",
                    it, it == 0 ? std::nan("") : train_loss, e.before, e.after);
    }
    if (it == o.iterations) break;
    const ls::Tensor tasks = sample_tasks(task_rng, o.tasks);
    TaskResult r = meta_batch(tasks);  // mean over every task of every rank
    train_loss = r.loss;
    ls::update(state, meta, r.grad);
  }
  // The replicas never drifted apart: same averaged gradients, same updates.
  ls::check_replicas(backend, meta);
  if (root) {
    std::printf("held-out post-adaptation loss: %.4f -> %.4f (%.0f%% lower)\n", first_after, last_after,
                first_after > 0 ? 100.0 * (1.0 - last_after / first_after) : 0.0);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  auto& backend = ls::get_distributed_backend<ls::MPIBackend>();
  Options o;
  lockstep_cli::App app("maml", "TorchOpt's distributed MAML (first-order) on few-shot sine regression.\n"
                                "Run as: mpiexec -n N maml [flags]");
  add_flags(app, o);
  return lockstep_cli::run_main(app, argc, argv, [&] { return run(o, backend); });
}
