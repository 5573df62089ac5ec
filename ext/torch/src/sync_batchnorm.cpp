// lockstep::torch::SyncBatchNorm and convert_sync_batchnorm (see lockstep/torch/sync_batchnorm.hpp).
#include "lockstep/torch/sync_batchnorm.hpp"
#include "internal.hpp"

#include <torch/torch.h>

#include <string>
#include <utility>

#include "lockstep/comm/consensus.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/reliability/call_site.hpp"

namespace lockstep::torch {

using detail::concat;

namespace {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

// The shape that broadcasts a per-channel vector over an (N, C, ...) input.
std::vector<std::int64_t> channel_shape(const at::Tensor& x) {
  std::vector<std::int64_t> s(static_cast<std::size_t>(x.dim()), 1);
  s[1] = x.size(1);
  return s;
}

// The dtype the fused CPU kernels compute an input of type t in: f64 stays, everything else
// (f32, and f16 / bf16, which LibTorch 1.13's CPU batch-norm kernels do not all take) goes in f32.
at::ScalarType kernel_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The global batch's statistics per channel (f64), from the forward allgather.
struct GlobalStats {
  at::Tensor mean, var;  // var: biased
  double n = 0;          // values per channel, every rank's
  bool input_grad = false;  // whether some rank's input needs a gradient (backward's collective)
};

// A rank's verdict on its training input. It travels in the rank's share of the forward
// allgather, so that an input one rank refuses is every rank's InvalidArgument, naming that
// rank, instead of one rank's error while the others wait in the collective.
enum class Refusal : int { none = -1, dims = 0, channels = 1, dtype = 2, failed = 3 };
struct InputVerdict {
  Refusal refusal = Refusal::none;
  double got = 0;        // the input's dimensionality, channels or scalar type
  std::string message;   // this rank's own text (Refusal::failed)
};

// What a rank's forward means for backward's collective: no autograd graph (under no_grad, or
// nothing needs a gradient: this rank's backward will not run), a graph whose input needs no
// gradient, or an input that needs one.
enum class GradState : int { no_graph = 0, graph = 1, input_grad = 2 };

// Collective (one allgather). Each rank's share: [count, its GradState, mean per channel,
// biased variance per channel], or, from a rank that refuses its input,
// [-1 - refusal, what it got, ...]. Every rank combines the shares with the law of total
// variance, over all ranks at once: mean = sum(n_r mean_r) / n, var = sum(n_r (var_r +
// (mean_r - mean)^2)) / n. It needs no sum of squares of the values, so it loses nothing to
// cancellation when the mean is large against the spread, and every rank computes it from the
// same gathered values with the same operations: the same statistics everywhere. Throws the same InvalidArgument on
// every rank when a rank refused its input, when some rank's input needs a gradient and another
// rank records no graph (backward's allreduce would wait for it), or when the global batch has
// fewer than 2 values per channel.
GlobalStats gather_stats(Backend& backend, const std::string& who, const std::string& expected_dims,
                         std::int64_t c, const at::Tensor& x, GradState grad, InputVerdict verdict) {
  auto mine = at::zeros({2 + 2 * c}, at::TensorOptions().dtype(at::kDouble));
  if (verdict.refusal == Refusal::none) {
    try {
      mine[0].fill_(static_cast<double>(c == 0 ? 0 : x.numel() / c));
      mine[1].fill_(static_cast<double>(grad));
      if (x.numel() > 0) {
        const auto [m, v] = at::batch_norm_update_stats(x, c10::nullopt, c10::nullopt, 0.0);
        mine.narrow(0, 2, c).copy_(m);
        mine.narrow(0, 2 + c, c).copy_(v);
      }
    } catch (const std::exception& e) {
      verdict = {Refusal::failed, 0, e.what()};
    }
  }
  if (verdict.refusal != Refusal::none) {
    mine[0].fill_(-1.0 - static_cast<double>(verdict.refusal));
    mine[1].fill_(verdict.got);
  }
  const int ranks = backend.size();
  auto all = at::empty({ranks, 2 + 2 * c}, mine.options());
  backend.allgather(view(mine), view(all));
  const auto status = all.select(1, 0);
  const auto status_copy = status.contiguous();
  const double* st = status_copy.data_ptr<double>();
  std::vector<int> refused;
  for (int r = 0; r < ranks; ++r)
    if (st[r] < 0) refused.push_back(r);
  if (!refused.empty()) {
    const int r = refused.front();
    const double got = all[r][1].item<double>();
    std::string what;
    switch (static_cast<Refusal>(static_cast<int>(-1.0 - st[r]))) {
      case Refusal::dims: what = concat("'s input is ", got, "D, expected ", expected_dims, " input");
        break;
      case Refusal::channels: what = concat("'s input has ", got, " channels, the module ", c);
        break;
      case Refusal::dtype:
        what = concat("'s input is ", c10::toString(static_cast<at::ScalarType>(static_cast<int>(got))),
                      ", expected a floating-point input (f16, bf16, f32 or f64)");
        break;
      default:
        what = r == backend.rank()
                   ? concat(": computing the batch statistics failed: ", verdict.message)
                   : std::string(": computing the batch statistics failed (that rank's error says why)");
        break;
    }
    std::string others;
    if (refused.size() > 1) {
      others = refused.size() > 2 ? " (also ranks " : " (also rank ";
      for (std::size_t i = 1; i < refused.size(); ++i) others += concat(i == 1 ? "" : ", ", refused[i]);
      others += ")";
    }
    detail::throw_invalid(concat(who, ": rank ", r, what, others, "; the training forward was not run on any rank"));
  }
  GlobalStats g;
  const auto counts = status.unsqueeze(1);  // [ranks, 1]
  g.n = status.sum().item<double>();
  const auto grads = all.select(1, 1).contiguous();
  const double* gs = grads.data_ptr<double>();
  int needs = -1, none = -1;  // the lowest rank whose input needs a gradient; that records no graph
  for (int r = ranks - 1; r >= 0; --r) {
    if (gs[r] == static_cast<double>(GradState::input_grad)) needs = r;
    if (gs[r] == static_cast<double>(GradState::no_graph)) none = r;
  }
  g.input_grad = needs >= 0;
  LOCKSTEP_CHECK_ARG(needs < 0 || none < 0, who, ": rank ", needs, "'s input needs a gradient, but rank ", none,
                     "'s forward records no autograd graph (under no_grad, or neither its input nor the weight and "
                     "bias need a gradient), so rank ", needs, "'s backward would wait for rank ", none,
                     " in its allreduce; run the training forward the same way on every rank (the batch was not "
                     "counted)");
  LOCKSTEP_CHECK_ARG(g.n > 1, who, ": expected more than 1 value per channel in the global batch when training, got ",
                     g.n, " (input ", x.sizes(), " on rank ", backend.rank(), ")");
  const auto means = all.narrow(1, 2, c), vars = all.narrow(1, 2 + c, c);
  g.mean = (means * counts).sum(0) / g.n;
  g.var = ((vars + (means - g.mean).square()) * counts).sum(0) / g.n;
  return g;
}

// The backend a training forward used, kept in its autograd graph for backward's collective:
// a BackendRef, so that a backward after the backend was destroyed is an error, not a call on
// freed memory. (Autograd keeps non-tensor state as IValues; a capsule holds any object.)
struct BackendCapsule : ::torch::CustomClassHolder {
  explicit BackendCapsule(BackendRef r) : ref(std::move(r)) {}
  BackendRef ref;
};

// The backend `ref` refers to; InvalidArgument naming `who` and `when` once it was destroyed.
Backend& live_backend(const BackendRef& ref, const std::string& who, const char* when) {
  Backend* b = ref.get();
  LOCKSTEP_CHECK_ARG(b != nullptr, who, ": ", when, " after its backend was destroyed (finalize<B>() destroys the "
                     "global backend; a backend of the caller's ends with its scope); nothing was computed");
  return *b;
}

// Normalises with the global batch's statistics (given: gather_stats's, f64, not
// differentiable; the gradient through them is backward's explicit formula).
//
// The per-element work goes through LibTorch's own fused CPU batch-norm kernels, as
// torch::nn::BatchNorm2d's does: this rank's mean and variance per channel in one call
// (batch_norm_update_stats, in gather_stats), the normalisation as an evaluation-mode batch norm
// with the global statistics (native_batch_norm), and backward's two sums per channel as an
// evaluation-mode batch-norm backward (native_batch_norm_backward): one pass each, where the same
// work composed from elementwise operations and sums takes several passes with a temporary each
// (8-16x BatchNorm2d's time, docs/performance/where-the-time-goes.md). f16 inputs,
// which these CPU kernels do not take in LibTorch 1.13, are computed in f32 and the results
// rounded back.
struct SyncBatchNormFunction : public ::torch::autograd::Function<SyncBatchNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight_in,
                               const at::Tensor& bias_in, const at::Tensor& global_mean, const at::Tensor& global_var,
                               const BackendRef& backend, const std::string& who, double n,
                               bool input_grad_anywhere, double eps) {
    const bool widen = kernel_type(input.scalar_type()) != input.scalar_type();
    const auto x = widen ? input.to(at::kFloat) : input;
    const auto weight = weight_in.to(x.scalar_type()), bias = bias_in.to(x.scalar_type());
    const auto mean_x = global_mean.to(x.scalar_type()), var_x = global_var.to(x.scalar_type());
    // (LibTorch's CPU kernel divides by the batch size: a rank with 0 rows skips it.)
    auto y = x.numel() == 0 ? at::empty_like(x)
                            : std::get<0>(at::native_batch_norm(x, weight, bias, mean_x, var_x, /*training=*/false,
                                                                0.0, eps));
    ctx->save_for_backward({x, weight, mean_x, var_x});
    ctx->saved_data["backend"] = c10::IValue::make_capsule(c10::make_intrusive<BackendCapsule>(backend));
    ctx->saved_data["who"] = who;
    ctx->saved_data["n"] = n;
    ctx->saved_data["input_grad"] = input_grad_anywhere;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["weight_type"] = static_cast<std::int64_t>(weight_in.scalar_type());
    ctx->saved_data["bias_type"] = static_cast<std::int64_t>(bias_in.scalar_type());
    return {widen ? y.to(input.scalar_type()) : y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &mean = saved[2], &var = saved[3];
    const double n = ctx->saved_data["n"].toDouble(), eps = ctx->saved_data["eps"].toDouble();
    const auto in_type = grad_outputs[0].defined() ? grad_outputs[0].scalar_type() : x.scalar_type();
    at::Tensor dy = grad_outputs[0].defined() ? grad_outputs[0].to(x.scalar_type()) : at::zeros_like(x);
    const std::int64_t c = x.size(1);
    // This rank's sums per channel: of dy (the gradient of bias) and of dy * xhat (of weight),
    // xhat = (x - mean) / sqrt(var + eps) with the global statistics; the optimizer averages
    // them.
    auto sums = at::zeros({2 * c}, x.options().dtype(at::kDouble));
    if (x.numel() > 0) {
      const auto g = at::native_batch_norm_backward(dy, x, weight, mean, var, at::Tensor(), at::Tensor(),
                                                    /*train=*/false, eps, {false, true, true});
      sums.narrow(0, 0, c).copy_(std::get<2>(g));
      sums.narrow(0, c, c).copy_(std::get<1>(g));
    }
    at::Tensor grad_weight, grad_bias, grad_x;
    const auto weight_type = static_cast<at::ScalarType>(ctx->saved_data["weight_type"].toInt());
    const auto bias_type = static_cast<at::ScalarType>(ctx->saved_data["bias_type"].toInt());
    // Copies (copy=true): an f64 weight would otherwise be a view of `sums`, which the allreduce
    // below turns into the global sums, every rank's share counted on every rank.
    if (ctx->needs_input_grad(1)) grad_weight = sums.narrow(0, c, c).to(weight_type, false, /*copy=*/true);
    if (ctx->needs_input_grad(2)) grad_bias = sums.narrow(0, 0, c).to(bias_type, false, /*copy=*/true);
    // One collective when some rank's input needs a gradient (forward agreed on it, so every
    // rank that runs this backward makes it, also one whose own input needs none): the global
    // batch's sums of dy and dy * xhat per channel. Then
    // grad_x = (dy - mean(dy) - xhat * mean(dy * xhat)) * invstd * weight, per channel an affine
    // function of dy and x: k * dy + a * x + b, with the coefficients in f64.
    if (ctx->saved_data["input_grad"].toBool()) {
      const auto capsule = ctx->saved_data["backend"].toCapsule();
      live_backend(static_cast<const BackendCapsule*>(capsule.get())->ref, ctx->saved_data["who"].toStringRef(),
                   "backward")
          .allreduce(view(sums), ReduceOp::sum);
    }
    if (ctx->needs_input_grad(0)) {
      const auto invstd = (var.to(at::kDouble) + eps).rsqrt();
      const auto mean_dy = sums.narrow(0, 0, c) / n, mean_dy_xhat = sums.narrow(0, c, c) / n;
      const auto k = invstd * weight.to(at::kDouble);
      const auto a = -k * invstd * mean_dy_xhat;
      const auto b = -k * mean_dy - a * mean.to(at::kDouble);
      const auto shape = channel_shape(x);
      grad_x = at::addcmul(b.to(x.scalar_type()).view(shape), x, a.to(x.scalar_type()).view(shape));
      grad_x.addcmul_(dy, k.to(x.scalar_type()).view(shape));
      if (grad_x.scalar_type() != in_type) grad_x = grad_x.to(in_type);
    }
    return {grad_x,       grad_weight,  grad_bias,    at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

template <std::size_t D>
SyncBatchNormImpl<D>::SyncBatchNormImpl(Backend& backend, const ::torch::nn::BatchNormOptions& options_)
    : options(options_), backend_(backend.ref()) {
  reset();
}

template <std::size_t D>
SyncBatchNormImpl<D>::SyncBatchNormImpl(Backend& backend, const ::torch::nn::BatchNormOptions& options_,
                                        std::vector<at::Tensor> adopt)
    : options(options_), backend_(backend.ref()), adopt_(std::move(adopt)) {
  LOCKSTEP_CHECK_ARG(adopt_.size() == 5, "lockstep::torch::SyncBatchNorm: 5 tensors to adopt, got ", adopt_.size());
  reset();
}

template <std::size_t D>
Backend& SyncBatchNormImpl<D>::backend() const {
  return live_backend(backend_, concat("lockstep::torch::SyncBatchNorm", D, "d"), "backend()");
}

template <std::size_t D>
void SyncBatchNormImpl<D>::reset() {
  std::vector<at::Tensor> adopt = std::move(adopt_);
  adopt_.clear();
  const bool adopting = !adopt.empty();
  const std::int64_t c = options.num_features();
  if (options.affine()) {
    // An adopted parameter keeps its trained or frozen state.
    weight = this->register_parameter("weight", adopting ? adopt[0] : ::torch::empty({c}),
                                      adopting ? adopt[0].requires_grad() : true);
    bias = this->register_parameter("bias", adopting ? adopt[1] : ::torch::empty({c}),
                                    adopting ? adopt[1].requires_grad() : true);
  } else {
    weight = this->register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = this->register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = this->register_buffer("running_mean", adopting ? adopt[2] : ::torch::zeros({c}));
    running_var = this->register_buffer("running_var", adopting ? adopt[3] : ::torch::ones({c}));
    num_batches_tracked = this->register_buffer(
        "num_batches_tracked", adopting ? adopt[4] : ::torch::tensor(0, ::torch::dtype(::torch::kLong)));
  } else {
    running_mean = this->register_buffer("running_mean", at::Tensor());
    running_var = this->register_buffer("running_var", at::Tensor());
    num_batches_tracked = this->register_buffer("num_batches_tracked", at::Tensor());
  }
  if (!adopting) reset_parameters();
}

template <std::size_t D>
void SyncBatchNormImpl<D>::reset_running_stats() {
  if (!options.track_running_stats()) return;
  ::torch::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

template <std::size_t D>
void SyncBatchNormImpl<D>::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    ::torch::nn::init::ones_(weight);
    ::torch::nn::init::zeros_(bias);
  }
}

template <std::size_t D>
void SyncBatchNormImpl<D>::pretty_print(std::ostream& stream) const {
  stream << "lockstep::torch::SyncBatchNorm" << D << "d(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum().has_value())
    stream << *options.momentum();
  else
    stream << "None";
  stream << ", affine=" << (options.affine() ? "true" : "false")
         << ", track_running_stats=" << (options.track_running_stats() ? "true" : "false") << ")";
}

template <std::size_t D>
void SyncBatchNormImpl<D>::check_input_dim(const at::Tensor& input) const {
  const auto dim = input.dim();
  const bool ok = D == 1 ? (dim == 2 || dim == 3) : dim == static_cast<std::int64_t>(D) + 2;
  LOCKSTEP_CHECK_ARG(ok, "lockstep::torch::SyncBatchNorm", D, "d: expected ",
                     D == 1 ? std::string("2D or 3D") : std::to_string(D + 2) + "D", " input (got ", dim, "D input)");
  LOCKSTEP_CHECK_ARG(input.size(1) == options.num_features(), "lockstep::torch::SyncBatchNorm", D, "d: input has ",
                     input.size(1), " channels, the module ", options.num_features());
}

template <std::size_t D>
at::Tensor SyncBatchNormImpl<D>::forward(const at::Tensor& input) {
  if (!this->is_training()) {
    // The running statistics (or, without them, this rank's own batch): no collective.
    check_input_dim(input);
    return at::batch_norm(input, weight, bias, running_mean, running_var,
                          /*training=*/!options.track_running_stats(), /*momentum=*/0.0, options.eps(),
                          /*cudnn_enabled=*/true);
  }
  // Training: this rank's verdict on its input goes into the forward collective, so that a
  // refusal is every rank's error.
  const std::int64_t c = options.num_features();
  const std::string who = concat("lockstep::torch::SyncBatchNorm", D, "d");
  const std::string expected_dims = D == 1 ? std::string("2D or 3D") : std::to_string(D + 2) + "D";
  // Deterministic mode (a deterministic DistributedOptimizer lives: the same on every rank, whose
  // setup agreed on it): the statistics of the rows the ranks hold at the same moment depend on
  // the rank count, which that mode must not. Refused before any collective, on every rank.
  LOCKSTEP_CHECK_ARG(!internal::deterministic_live(), who, ": not in deterministic mode (a deterministic "
                     "lockstep::torch::DistributedOptimizer lives): the global batch's statistics depend on how the "
                     "ranks split it; use BatchNorm, whose statistics are each micro-batch's");
  const auto dim = input.dim();
  InputVerdict verdict;
  if (!(D == 1 ? (dim == 2 || dim == 3) : dim == static_cast<std::int64_t>(D) + 2))
    verdict = {Refusal::dims, static_cast<double>(dim), {}};
  else if (input.size(1) != c)
    verdict = {Refusal::channels, static_cast<double>(input.size(1)), {}};
  else if (!at::isFloatingType(input.scalar_type()))
    verdict = {Refusal::dtype, static_cast<double>(static_cast<int>(input.scalar_type())), {}};
  const bool fine = verdict.refusal == Refusal::none;
  const auto x = fine ? input.to(kernel_type(input.scalar_type())) : at::Tensor();
  const auto needs = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  const GradState grad = !::torch::GradMode::is_enabled() || !(needs(input) || needs(weight) || needs(bias))
                             ? GradState::no_graph
                             : needs(input) ? GradState::input_grad : GradState::graph;
  const auto g = gather_stats(live_backend(backend_, who, "forward"), who, expected_dims, c, x, grad, verdict);
  // LibTorch's autograd Function takes no undefined inputs: without affine, a constant 1 and 0.
  const auto w = weight.defined() ? weight : at::ones({c}, input.options());
  const auto b = bias.defined() ? bias : at::zeros({c}, input.options());
  auto out = SyncBatchNormFunction::apply(input, w, b, g.mean, g.var, backend_, who, g.n, g.input_grad, options.eps());
  if (options.track_running_stats()) {
    ::torch::NoGradGuard no_grad;
    num_batches_tracked += 1;
    const double factor = options.momentum().has_value() ? *options.momentum()
                                                         : 1.0 / num_batches_tracked.template item<double>();
    const auto unbiased = g.var * (g.n / (g.n - 1));
    running_mean.mul_(1 - factor).add_(g.mean.to(running_mean.scalar_type()), factor);
    running_var.mul_(1 - factor).add_(unbiased.to(running_var.scalar_type()), factor);
  }
  return out[0];
}

template class SyncBatchNormImpl<1>;
template class SyncBatchNormImpl<2>;
template class SyncBatchNormImpl<3>;

// ---------------------------------------------------------------------------------------------
// convert_sync_batchnorm
// ---------------------------------------------------------------------------------------------

namespace {

// A BatchNorm{1,2,3}d found inside the module, where it is held.
struct Found {
  std::string path;                         // "features.1"
  ::torch::nn::Module* parent = nullptr;    // the container (or the module holding it)
  std::string name;                         // its name in parent
  std::shared_ptr<::torch::nn::Module> bn;  // the BatchNorm
};

int batchnorm_dims(const ::torch::nn::Module& m) {
  if (dynamic_cast<const ::torch::nn::BatchNorm1dImpl*>(&m) != nullptr) return 1;
  if (dynamic_cast<const ::torch::nn::BatchNorm2dImpl*>(&m) != nullptr) return 2;
  if (dynamic_cast<const ::torch::nn::BatchNorm3dImpl*>(&m) != nullptr) return 3;
  return 0;
}

bool is_container(const ::torch::nn::Module& m) {
  return dynamic_cast<const ::torch::nn::SequentialImpl*>(&m) != nullptr ||
         dynamic_cast<const ::torch::nn::ModuleListImpl*>(&m) != nullptr ||
         dynamic_cast<const ::torch::nn::ModuleDictImpl*>(&m) != nullptr;
}

void find_batchnorms(::torch::nn::Module& m, const std::string& prefix, std::vector<Found>& out) {
  for (const auto& child : m.named_children()) {
    const std::string path = prefix.empty() ? child.key() : prefix + "." + child.key();
    if (batchnorm_dims(*child.value()) != 0)
      out.push_back({path, &m, child.key(), child.value()});
    else
      find_batchnorms(*child.value(), path, out);
  }
}

template <std::size_t D, class BN>
std::shared_ptr<SyncBatchNormImpl<D>> make_sync(Backend& backend, const ::torch::nn::Module& m) {
  const auto& bn = dynamic_cast<const BN&>(m);
  auto sync = std::make_shared<SyncBatchNormImpl<D>>(
      backend, bn.options,
      std::vector<at::Tensor>{bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked});
  sync->train(bn.is_training());
  return sync;
}

template <std::size_t D>
void swap_in(Found& f, const std::shared_ptr<SyncBatchNormImpl<D>>& sync) {
  if (auto* seq = dynamic_cast<::torch::nn::SequentialImpl*>(f.parent)) {
    for (auto& any : *seq)
      if (any.ptr().get() == f.bn.get()) any = ::torch::nn::AnyModule(sync);
  } else if (auto* list = dynamic_cast<::torch::nn::ModuleListImpl*>(f.parent)) {
    for (auto& p : *list)
      if (p.get() == f.bn.get()) p = sync;
  } else if (auto* dict = dynamic_cast<::torch::nn::ModuleDictImpl*>(f.parent)) {
    for (auto& item : *dict)
      if (item.value().get() == f.bn.get()) item.value() = sync;
  }
  f.parent->replace_module(f.name, sync);
}

}  // namespace

std::size_t convert_sync_batchnorm(Backend& backend, ::torch::nn::Module& module, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::convert_sync_batchnorm");
  std::vector<Found> found;
  const auto verdict = detail::verdict_of([&] {
    const int root_dims = batchnorm_dims(module);
    LOCKSTEP_CHECK_ARG(root_dims == 0, "lockstep::torch::convert_sync_batchnorm: the module itself is a BatchNorm",
                       root_dims, "d, which has no container to be replaced in; declare lt::SyncBatchNorm", root_dims,
                       "d instead");
    find_batchnorms(module, "", found);
    for (const auto& f : found) {
      const int d = batchnorm_dims(*f.bn);
      LOCKSTEP_CHECK_ARG(is_container(*f.parent), "lockstep::torch::convert_sync_batchnorm: BatchNorm", d, "d '",
                         f.path, "' is held by a module's own member, whose forward LibTorch calls directly, so it "
                         "cannot be replaced; declare it as lt::SyncBatchNorm", d, "d(backend, options), or hold it in "
                         "a Sequential, ModuleList or ModuleDict");
    }
  });
  detail::agree(backend, "lockstep::torch::convert_sync_batchnorm", 0, verdict, 0, "no BatchNorm was replaced");
  for (auto& f : found) {
    switch (batchnorm_dims(*f.bn)) {
      case 1: swap_in<1>(f, make_sync<1, ::torch::nn::BatchNorm1dImpl>(backend, *f.bn));
        break;
      case 2: swap_in<2>(f, make_sync<2, ::torch::nn::BatchNorm2dImpl>(backend, *f.bn));
        break;
      default: swap_in<3>(f, make_sync<3, ::torch::nn::BatchNorm3dImpl>(backend, *f.bn));
        break;
    }
  }
  return found.size();
}

}  // namespace lockstep::torch
