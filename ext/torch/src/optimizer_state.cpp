// LibTorch optimizers' state as named Lockstep tensors: the known optimizers field by field, the
// others as their own archive; the ranks' check that their optimizers match; synchronize of an
// optimizer, state_bytes, and the prepared state that checkpoints fill and install.
#include "internal.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "lockstep/core/errors.hpp"
#include "lockstep/train/synchronize.hpp"

namespace lockstep::torch {

using detail::concat;
using namespace internal;

namespace internal {

Kind kind_of(::torch::optim::Optimizer& o) {
  if (dynamic_cast<::torch::optim::Adam*>(&o)) return Kind::adam;
  if (dynamic_cast<::torch::optim::AdamW*>(&o)) return Kind::adamw;
  if (dynamic_cast<::torch::optim::SGD*>(&o)) return Kind::sgd;
  if (dynamic_cast<::torch::optim::RMSprop*>(&o)) return Kind::rmsprop;
  if (dynamic_cast<::torch::optim::Adagrad*>(&o)) return Kind::adagrad;
  return Kind::other;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::adam: return "Adam";
    case Kind::adamw: return "AdamW";
    case Kind::sgd: return "SGD";
    case Kind::rmsprop: return "RMSprop";
    case Kind::adagrad: return "Adagrad";
    case Kind::other: return "other";
  }
  return "?";
}

// The state map's key for parameter p, as LibTorch's optimizers compute it (a string of the
// TensorImpl's address in 1.x; the address itself in later versions).
template <class Map>
typename Map::key_type state_key(const at::Tensor& p) {
  using K = typename Map::key_type;
  if constexpr (std::is_same_v<K, std::string>)
    return c10::guts::to_string(p.unsafeGetTensorImpl());
  else
    return reinterpret_cast<K>(p.unsafeGetTensorImpl());
}
using StateMap = std::remove_reference_t<decltype(std::declval<::torch::optim::Optimizer&>().state())>;

// The tensor fields of each known state, and whether it has a step counter.
const std::vector<const char*>& tensor_fields(Kind k) {
  static const std::vector<const char*> adam{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static const std::vector<const char*> sgd{"momentum_buffer"};
  static const std::vector<const char*> rms{"square_avg", "momentum_buffer", "grad_avg"};
  static const std::vector<const char*> ada{"sum"};
  static const std::vector<const char*> none{};
  switch (k) {
    case Kind::adam:
    case Kind::adamw: return adam;
    case Kind::sgd: return sgd;
    case Kind::rmsprop: return rms;
    case Kind::adagrad: return ada;
    default: return none;
  }
}
bool has_step(Kind k) { return k == Kind::adam || k == Kind::adamw || k == Kind::rmsprop || k == Kind::adagrad; }

template <class S>
at::Tensor* field_of(S& s, std::string_view f);
template <>
at::Tensor* field_of(::torch::optim::AdamParamState& s, std::string_view f) {
  if (f == "exp_avg") return &s.exp_avg();
  if (f == "exp_avg_sq") return &s.exp_avg_sq();
  if (f == "max_exp_avg_sq") return &s.max_exp_avg_sq();
  return nullptr;
}
template <>
at::Tensor* field_of(::torch::optim::AdamWParamState& s, std::string_view f) {
  if (f == "exp_avg") return &s.exp_avg();
  if (f == "exp_avg_sq") return &s.exp_avg_sq();
  if (f == "max_exp_avg_sq") return &s.max_exp_avg_sq();
  return nullptr;
}
template <>
at::Tensor* field_of(::torch::optim::SGDParamState& s, std::string_view f) {
  return f == "momentum_buffer" ? &s.momentum_buffer() : nullptr;
}
template <>
at::Tensor* field_of(::torch::optim::RMSpropParamState& s, std::string_view f) {
  if (f == "square_avg") return &s.square_avg();
  if (f == "momentum_buffer") return &s.momentum_buffer();
  if (f == "grad_avg") return &s.grad_avg();
  return nullptr;
}
template <>
at::Tensor* field_of(::torch::optim::AdagradParamState& s, std::string_view f) {
  return f == "sum" ? &s.sum() : nullptr;
}

// The state object of a parameter, as its known type, and how to make a new one.
struct StateAccess {
  at::Tensor* (*field)(::torch::optim::OptimizerParamState&, std::string_view);
  std::int64_t* (*step)(::torch::optim::OptimizerParamState&);
  std::unique_ptr<::torch::optim::OptimizerParamState> (*make)();
};
template <class S>
StateAccess access_for() {
  StateAccess a;
  a.field = [](::torch::optim::OptimizerParamState& s, std::string_view f) {
    return field_of(static_cast<S&>(s), f);
  };
  a.step = [](::torch::optim::OptimizerParamState& s) -> std::int64_t* {
    if constexpr (requires(S& x) { x.step(); }) return &static_cast<S&>(s).step();
    else return nullptr;
  };
  a.make = []() -> std::unique_ptr<::torch::optim::OptimizerParamState> { return std::make_unique<S>(); };
  return a;
}
StateAccess access(Kind k) {
  switch (k) {
    case Kind::adam: return access_for<::torch::optim::AdamParamState>();
    case Kind::adamw: return access_for<::torch::optim::AdamWParamState>();
    case Kind::sgd: return access_for<::torch::optim::SGDParamState>();
    case Kind::rmsprop: return access_for<::torch::optim::RMSpropParamState>();
    case Kind::adagrad: return access_for<::torch::optim::AdagradParamState>();
    default: return {};
  }
}

std::vector<OptParam> optimizer_params(::torch::optim::Optimizer& o, const ::torch::nn::Module* names) {
  std::unordered_map<const void*, std::string> by_impl;
  if (names != nullptr)
    for (const auto& p : names->named_parameters(true)) by_impl.emplace(p.value().unsafeGetTensorImpl(), p.key());
  std::vector<OptParam> out;
  const auto& groups = o.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& ps = groups[g].params();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto it = by_impl.find(ps[i].unsafeGetTensorImpl());
      out.push_back({ps[i], it != by_impl.end() ? it->second : concat("param_groups.", g, ".params.", i), g});
    }
  }
  return out;
}

// A parameter DistributedOptimizer reduces the gradient of (the others it leaves alone).
bool trained(const at::Tensor& p) { return p.requires_grad() && p.is_floating_point(); }

// Optimizers whose state a live DistributedOptimizer shards (see ShardInfo).
std::mutex g_shard_mutex;
std::unordered_map<const ::torch::optim::Optimizer*, ShardInfo>& sharded_optimizers() {
  static std::unordered_map<const ::torch::optim::Optimizer*, ShardInfo> m;
  return m;
}
std::optional<ShardInfo> shard_info(const ::torch::optim::Optimizer& o) {
  std::lock_guard lock(g_shard_mutex);
  auto it = sharded_optimizers().find(&o);
  if (it == sharded_optimizers().end()) return std::nullopt;
  return it->second;
}
std::string sharding_desc(const ::torch::optim::Optimizer& o) {
  const auto info = shard_info(o);
  return info ? concat("sharded over ", info->nranks, " ranks by a DistributedOptimizer") : std::string("replicated");
}

// The kind, the groups and every parameter, by name (the module's, or its position), with its
// dtype, shape, device and whether it is trained: what the ranks' optimizers must share. Shapes
// alone would not tell apart ranks that froze different layers of one shape.
std::string param_desc(const OptParam& p) {
  return concat(describe(p.p), " in group ", p.group, trained(p.p) ? ", trained" : ", frozen (no gradient)");
}
std::string optimizer_signature(::torch::optim::Optimizer& o, const std::vector<OptParam>& ps) {
  std::string s = concat("optimizer ", kind_name(kind_of(o)), "; groups ", o.param_groups().size(), "; ",
                         sharding_desc(o), ";");
  for (const auto& p : ps) s += concat(p.name, "=", param_desc(p), ";");
  return s;
}

void check_same_optimizer(Backend& backend, ::torch::optim::Optimizer& o, const ::torch::nn::Module* names,
                          int root, const char* what) {
  const auto ps = optimizer_params(o, names);
  const std::string sig = optimizer_signature(o, ps);
  detail::check_same_structure(backend, sig, 0, root, what, [&] {
    std::vector<detail::StructureEntry> e;
    e.push_back({"optimizer", concat(kind_name(kind_of(o)), " with ", o.param_groups().size(), " group(s)")});
    e.push_back({"optimizer state", sharding_desc(o)});
    for (const auto& p : ps) e.push_back({p.name, param_desc(p)});
    return e;
  });
}

// Which state a rank's optimizer holds: per parameter, "-" (none) or the defined tensor fields,
// one line each; for an optimizer of another kind, the size of its archive.
std::string state_layout(::torch::optim::Optimizer& o, const std::vector<OptParam>& ps) {
  const Kind k = kind_of(o);
  std::string s;
  if (k == Kind::other) return s;
  const StateAccess a = access(k);
  auto& st = o.state();
  for (const auto& p : ps) {
    auto it = st.find(state_key<StateMap>(p.p));
    if (it == st.end()) {
      s += "-\n";
      continue;
    }
    for (const char* f : tensor_fields(k)) {
      const at::Tensor* t = a.field(*it->second, f);
      if (t != nullptr && t->defined()) (s += f) += ' ';
    }
    s += "+\n";
  }
  return s;
}

std::vector<std::uint8_t> archive_bytes(::torch::optim::Optimizer& o) {
  ::torch::serialize::OutputArchive ar;
  o.save(ar);
  std::ostringstream os;
  ar.save_to(os);
  const std::string s = os.str();
  return {s.begin(), s.end()};
}

void load_archive(::torch::optim::Optimizer& o, const std::uint8_t* data, std::size_t n) {
  ::torch::serialize::InputArchive ar;
  ar.load_from(reinterpret_cast<const char*>(data), n);
  o.load(ar);
}

PreparedState::PreparedState(::torch::optim::Optimizer& o, std::vector<OptParam> ps, const std::string& layout,
              std::size_t archive_size)
    : o_(o), ps_(std::move(ps)), kind_(kind_of(o)) {
  const auto& groups = o.param_groups();
  lrs_.resize(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    try {
      lrs_[g] = groups[g].options().get_lr();
      has_lr_ = true;
    } catch (const std::exception&) {
      has_lr_ = false;  // options without a learning rate (get_lr is not implemented)
      break;
    }
  }
  if (has_lr_)
    for (std::size_t g = 0; g < groups.size(); ++g)
      tensors_.emplace(concat("optimizer.param_groups.", g, ".lr"), Tensor::borrow(&lrs_[g], Shape{}, DType::f64));
  if (kind_ == Kind::other) {
    archive_.assign(archive_size, 0);
    tensors_.emplace("optimizer.torch_archive",
                     Tensor::borrow(archive_.data(), Shape{static_cast<std::int64_t>(archive_size)}, DType::u8));
    return;
  }
  const StateAccess a = access(kind_);
  auto& st = o.state();
  std::istringstream lines(layout);
  plans_.resize(ps_.size());
  for (std::size_t i = 0; i < ps_.size(); ++i) {
    std::string line;
    std::getline(lines, line);
    Plan& plan = plans_[i];
    if (line == "-" || line.empty()) continue;  // no state there: this one's is dropped
    plan.has = true;
    std::istringstream words(line);
    std::string w;
    while (words >> w)
      if (w != "+") plan.fields.push_back(w);
    auto it = st.find(state_key<StateMap>(ps_[i].p));
    ::torch::optim::OptimizerParamState* s = it == st.end() ? nullptr : it->second.get();
    const std::string prefix = concat("optimizer.state.", ps_[i].name, ".");
    if (has_step(kind_)) {
      std::int64_t* step = s != nullptr ? a.step(*s) : &steps_.emplace_back(0);
      plan.step = step;
      tensors_.emplace(prefix + "step", Tensor::borrow(step, Shape{}, DType::i64));
    }
    for (const auto& f : plan.fields) {
      at::Tensor* t = s != nullptr ? a.field(*s, f) : nullptr;
      LOCKSTEP_CHECK_ARG(s == nullptr || t != nullptr, "optimizer state field '", f, "' unknown");
      at::Tensor target;
      if (t != nullptr && t->defined()) {
        target = *t;
      } else {
        target = at::zeros_like(ps_[i].p, at::MemoryFormat::Contiguous);
        plan.fresh.emplace_back(f, target);
      }
      tensors_.emplace(prefix + f, borrow(target));
    }
  }
}

// Makes the optimizer hold what the tensors now hold: new state objects and fields
// installed, state the layout does not have dropped, learning rates set.
void PreparedState::install() {
  if (has_lr_)
    for (std::size_t g = 0; g < lrs_.size(); ++g) o_.param_groups()[g].options().set_lr(lrs_[g]);
  if (kind_ == Kind::other) {
    load_archive(o_, archive_.data(), archive_.size());
    return;
  }
  const StateAccess a = access(kind_);
  auto& st = o_.state();
  for (std::size_t i = 0; i < ps_.size(); ++i) {
    const auto key = state_key<StateMap>(ps_[i].p);
    Plan& plan = plans_[i];
    if (!plan.has) {
      st.erase(key);
      continue;
    }
    auto it = st.find(key);
    if (it == st.end()) it = st.emplace(key, a.make()).first;
    auto& s = *it->second;
    if (plan.step != nullptr && a.step(s) != plan.step) *a.step(s) = *plan.step;
    for (auto& [f, t] : plan.fresh) *a.field(s, f) = t;
    // Fields the layout does not have are undefined, as they are there.
    for (const char* f : tensor_fields(kind_))
      if (std::find(plan.fields.begin(), plan.fields.end(), f) == plan.fields.end()) *a.field(s, f) = at::Tensor();
  }
}

// Sharded state: drops what this rank holds for parameters another rank owns.
void drop_unowned_state(::torch::optim::Optimizer& o, const std::vector<OptParam>& ps, const ShardInfo& info,
                        int rank) {
  auto& st = o.state();
  for (std::size_t i = 0; i < ps.size() && i < info.owner.size(); ++i)
    if (info.owner[i] >= 0 && info.owner[i] != rank) st.erase(state_key<StateMap>(ps[i].p));
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

}  // namespace internal

std::int64_t state_bytes(::torch::optim::Optimizer& o) {
  const Kind k = kind_of(o);
  if (k == Kind::other) return static_cast<std::int64_t>(archive_bytes(o).size());
  const StateAccess a = access(k);
  std::int64_t n = 0;
  for (auto& [key, s] : o.state()) {
    for (const char* f : tensor_fields(k)) {
      const at::Tensor* t = a.field(*s, f);
      if (t != nullptr && t->defined()) n += static_cast<std::int64_t>(t->nbytes());
    }
  }
  return n;
}

void synchronize(Backend& backend, ::torch::optim::Optimizer& optimizer, int root, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::synchronize");
  check_same_optimizer(backend, optimizer, nullptr, root, "lockstep::torch::synchronize(optimizer)");
  // The check above compared whether the optimizer is sharded: every rank refuses alike.
  LOCKSTEP_CHECK_ARG(!shard_info(optimizer),
                     "lockstep::torch::synchronize(optimizer): the optimizer's state is sharded by a "
                     "DistributedOptimizer (shard_optimizer_state): each rank holds the state of its own parameters "
                     "only, so there is no root state to copy; nothing was changed (save_checkpoint and "
                     "load_checkpoint gather and split it)");
  auto ps = optimizer_params(optimizer, nullptr);
  // Root's layout (which state exists), or for another kind root's archive.
  std::vector<std::uint8_t> archive;
  std::string layout;
  if (backend.rank() == root) {
    if (kind_of(optimizer) == Kind::other) archive = archive_bytes(optimizer);
    layout = concat(archive.size(), "\n", state_layout(optimizer, ps));
  }
  layout = detail::broadcast_string(backend, layout, root);
  const auto nl = layout.find('\n');
  const std::size_t archive_size = std::stoull(layout.substr(0, nl));
  std::optional<PreparedState> prepared;
  agreed(backend, "lockstep::torch::synchronize(optimizer)", root,
         [&] { prepared.emplace(optimizer, ps, layout.substr(nl + 1), archive_size); },
         "no rank's optimizer was changed");
  if (backend.rank() == root && !archive.empty())
    std::copy(archive.begin(), archive.end(),
              prepared->tensors().at("optimizer.torch_archive").data<std::uint8_t>());
  ::torch::NoGradGuard no_grad;
  lockstep::synchronize(backend, prepared->tensors(), root);
  if (backend.rank() != root) prepared->install();  // root's optimizer is the source
}

}  // namespace lockstep::torch
