// lockstep::torch: the LibTorch adapter (see lockstep/torch.hpp). One translation unit, so that
// LibTorch's slow headers are compiled once.
#include "lockstep/torch.hpp"

#include <torch/torch.h>

#include <c10/util/string_utils.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <optional>
#include <cstring>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/io/checkpoint.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/reliability/settings.hpp"
#include "lockstep/train/replicas.hpp"
#include "lockstep/train/synchronize.hpp"

namespace lockstep::torch {

using detail::concat;

// ---------------------------------------------------------------------------------------------
// The bridge
// ---------------------------------------------------------------------------------------------

namespace {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream os;
  os << t.scalar_type() << " " << t.sizes() << " on " << t.device();
  return os.str();
}

std::optional<DType> dtype_of(c10::ScalarType s) {
  switch (s) {
    case c10::kHalf: return DType::f16;
    case c10::kBFloat16: return DType::bf16;
    case c10::kFloat: return DType::f32;
    case c10::kDouble: return DType::f64;
    case c10::kInt: return DType::i32;
    case c10::kLong: return DType::i64;
    case c10::kByte: return DType::u8;
    case c10::kBool: return DType::u8;  // one byte, 0 or 1: its bits are u8's
    default: return std::nullopt;
  }
}

Shape shape_of(const at::Tensor& t) { return Shape(t.sizes().begin(), t.sizes().end()); }

}  // namespace

TensorView view(const at::Tensor& t) {
  LOCKSTEP_CHECK_ARG(t.defined(), "lockstep::torch::view: the tensor is undefined");
  LOCKSTEP_CHECK_ARG(t.layout() == c10::kStrided, "lockstep::torch::view: a ", t.layout(),
                     " tensor (", describe(t), "); only dense (strided) tensors have a flat view");
  LOCKSTEP_CHECK_ARG(t.is_contiguous(), "lockstep::torch::view: the tensor (", describe(t),
                     ") is not contiguous; call .contiguous() first (that copies)");
  const auto dt = dtype_of(t.scalar_type());
  LOCKSTEP_CHECK_ARG(dt.has_value(), "lockstep::torch::view: dtype ", t.scalar_type(),
                     " has no Lockstep dtype (supported: Half, BFloat16, Float, Double, Int, Long, "
                     "Byte, Bool)");
  Device dev = Device::cpu();
  if (t.device().is_cuda())
    dev = Device::cuda(t.device().index());
  else
    LOCKSTEP_CHECK_ARG(t.device().is_cpu(), "lockstep::torch::view: a tensor on ", t.device(),
                       "; Lockstep has cpu and cuda tensors");
  return TensorView{t.numel() == 0 ? nullptr : t.data_ptr(), t.numel(), *dt, dev};
}

Tensor borrow(const at::Tensor& t) {
  const TensorView v = view(t);
  return Tensor::borrow(v.data, shape_of(t), v.dtype, v.device);
}

// ---------------------------------------------------------------------------------------------
// Modules: parameters and buffers by name
// ---------------------------------------------------------------------------------------------

namespace {

using TensorMap = std::map<std::string, Tensor>;

// Every parameter and buffer of m, by name, as borrowed Lockstep tensors. Throws
// InvalidArgument naming the first one that has no flat view; call it inside an agreement.
void add_module(TensorMap& out, const ::torch::nn::Module& m) {
  auto add = [&](const std::string& name, const at::Tensor& t, const char* kind) {
    if (!t.defined()) return;  // an unset optional parameter or buffer
    try {
      out.emplace(name, borrow(t));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(concat("module ", kind, " '", name, "': ", e.what()));
    }
  };
  for (const auto& p : m.named_parameters(/*recurse=*/true)) add(p.key(), p.value(), "parameter");
  for (const auto& b : m.named_buffers(/*recurse=*/true)) add(b.key(), b.value(), "buffer");
}

// Runs f() on every rank and makes the ranks agree on its outcome: every rank throws the
// lowest failing rank's error if any failed.
template <class F>
void agreed(Backend& backend, const char* what, int root, F&& f, const char* consequence) {
  detail::agree(backend, what, root, detail::verdict_of(std::forward<F>(f)), 0, consequence);
}

}  // namespace

void synchronize(Backend& backend, ::torch::nn::Module& module, int root, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::synchronize");
  TensorMap tensors;
  agreed(backend, "lockstep::torch::synchronize", root, [&] { add_module(tensors, module); },
         "no rank's module was changed");
  // The core's synchronize checks names, dtypes, shapes and devices across ranks first
  // (MismatchError naming the first difference), then broadcasts in place.
  ::torch::NoGradGuard no_grad;
  lockstep::synchronize(backend, tensors, root);
}

// ---------------------------------------------------------------------------------------------
// Optimizer state
// ---------------------------------------------------------------------------------------------

namespace {

// The optimizers whose state Lockstep knows field by field; the others go through their own
// save()/load() (an archive of bytes).
enum class Kind { adam, adamw, sgd, rmsprop, adagrad, other };

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

// The optimizer's parameters in order (group by group), with a name for each: the module's
// name when `names` knows the parameter, else its position.
struct OptParam {
  at::Tensor p;
  std::string name;
  std::size_t group = 0;
};
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

// Optimizers whose state a live DistributedOptimizer shards (shard_optimizer_state): per
// parameter of optimizer_params() (frozen ones included), the rank that owns it, -1 for one
// that is not trained (its state, if any, is kept on every rank as it is).
struct ShardInfo {
  int nranks = 1;
  std::vector<int> owner;
};
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

// The optimizer's state as named Lockstep tensors, laid out as `layout` says (another rank's
// or a file's), without changing the optimizer: tensors that exist are borrowed in place, the
// ones to create are new (zeros like their parameter) and installed by install(), after the
// collective that fills them succeeded.
class PreparedState {
 public:
  PreparedState(::torch::optim::Optimizer& o, std::vector<OptParam> ps, const std::string& layout,
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

  TensorMap& tensors() noexcept { return tensors_; }

  // Makes the optimizer hold what the tensors now hold: new state objects and fields
  // installed, state the layout does not have dropped, learning rates set.
  void install() {
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

 private:
  struct Plan {
    bool has = false;
    std::vector<std::string> fields;
    std::int64_t* step = nullptr;
    std::vector<std::pair<std::string, at::Tensor>> fresh;
  };
  ::torch::optim::Optimizer& o_;
  std::vector<OptParam> ps_;
  Kind kind_;
  std::vector<Plan> plans_;
  std::deque<std::int64_t> steps_;
  std::vector<double> lrs_;
  bool has_lr_ = false;
  std::vector<std::uint8_t> archive_;
  TensorMap tensors_;
};

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

}  // namespace

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

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

namespace {

constexpr const char* kOptPrefix = "optimizer.";

void check_no_optimizer_names(const TensorMap& module_tensors) {
  for (const auto& [name, t] : module_tensors)
    LOCKSTEP_CHECK_ARG(name.rfind(kOptPrefix, 0) != 0, "lockstep::torch checkpoint: the module's tensor '",
                       name, "' starts with 'optimizer.', which names the optimizer's state in the file");
}

void save_impl(Backend& backend, const std::filesystem::path& path, ::torch::nn::Module& module,
               ::torch::optim::Optimizer* optimizer, const std::map<std::string, std::string>& user_meta) {
  TensorMap all;
  std::optional<PreparedState> prepared;
  agreed(backend, "lockstep::torch::save_checkpoint", 0, [&] {
    add_module(all, module);
    check_no_optimizer_names(all);
  }, "nothing was written");
  agreed(backend, "lockstep::torch::save_checkpoint", 0, [&] {
    for (const auto& [k, v] : user_meta)
      LOCKSTEP_CHECK_ARG(k.rfind("lockstep.", 0) != 0, "lockstep::torch::save_checkpoint: metadata key '", k,
                         "' starts with 'lockstep.', which Lockstep reserves");
  }, "nothing was written");
  std::map<std::string, std::string> meta = user_meta;
  meta["lockstep.torch.module"] = "1";
  if (optimizer != nullptr) {
    check_same_optimizer(backend, *optimizer, &module, 0, "lockstep::torch::save_checkpoint");
    auto ps = optimizer_params(*optimizer, &module);
    std::vector<std::uint8_t> archive;
    if (backend.rank() == 0 && kind_of(*optimizer) == Kind::other) archive = archive_bytes(*optimizer);
    // Root writes what a replicated state holds: each parameter's state as the rank that has it
    // holds it. Sharded (now, or by a DistributedOptimizer since destroyed: the state stays
    // split), that is its owner; replicated, root itself. Every rank learns every rank's layout
    // (one string broadcast per rank); each parameter's state comes from root if root has it,
    // else from the lowest rank that has it.
    const bool known = kind_of(*optimizer) != Kind::other;
    std::string layout = state_layout(*optimizer, ps);
    std::vector<std::vector<std::string>> lines;  // every rank's layout, line by line
    std::vector<int> source(ps.size(), 0);
    bool gather = false;
    if (known) {
      for (int r = 0; r < backend.size(); ++r)
        lines.push_back(split_lines(detail::broadcast_string(backend, layout, r)));
      auto has = [&](int r, std::size_t i) {
        const auto& l = lines[static_cast<std::size_t>(r)];
        return i < l.size() && !l[i].empty() && l[i] != "-";
      };
      std::string merged;
      for (std::size_t i = 0; i < ps.size(); ++i) {
        for (int r = 0; r < backend.size(); ++r)
          if (has(r, i)) {
            source[i] = r;
            break;
          }
        gather = gather || source[i] != 0;
        const auto& l = lines[static_cast<std::size_t>(source[i])];
        merged += (i < l.size() ? l[i] : std::string("-")) + "\n";
      }
      if (backend.rank() == 0) layout = std::move(merged);
    }
    agreed(backend, "lockstep::torch::save_checkpoint", 0, [&] {
      prepared.emplace(*optimizer, ps, layout, archive.size());
    }, "nothing was written");
    if (gather) {  // the same on every rank: computed from the same layouts
      // Each other rank sends root the state root lacks, packed (one broadcast of its size and
      // one of its bytes per rank): root's prepared tensors are new ones for them.
      std::string transfer_error;  // root's, agreed after the transfers
      for (int r = 1; r < backend.size(); ++r) {
        std::vector<Tensor*> mine;
        const auto& l = lines[static_cast<std::size_t>(r)];
        if (backend.rank() == r || backend.rank() == 0) {
          for (std::size_t i = 0; i < ps.size(); ++i) {
            if (source[i] != r) continue;
            const std::string prefix = concat("optimizer.state.", ps[i].name, ".");
            auto& tm = prepared->tensors();
            if (has_step(kind_of(*optimizer))) mine.push_back(&tm.at(prefix + "step"));
            std::istringstream words(l[i]);
            std::string w;
            while (words >> w)
              if (w != "+") mine.push_back(&tm.at(prefix + w));
          }
        }
        std::int64_t bytes = 0;
        for (Tensor* t : mine) bytes += static_cast<std::int64_t>(t->nbytes());
        backend.broadcast(TensorView{&bytes, 1, DType::i64, Device::cpu()}, r);
        if (bytes == 0) continue;
        std::vector<std::uint8_t> blob(static_cast<std::size_t>(bytes));
        if (backend.rank() == r) {
          std::size_t off = 0;
          for (Tensor* t : mine) {
            if (t->nbytes() > 0) std::memcpy(blob.data() + off, t->raw_data(), t->nbytes());
            off += t->nbytes();
          }
        }
        backend.broadcast(TensorView{blob.data(), bytes, DType::u8, Device::cpu()}, r);
        if (backend.rank() == 0) {
          std::int64_t expect = 0;
          for (Tensor* t : mine) expect += static_cast<std::int64_t>(t->nbytes());
          if (expect != bytes) {  // not expected: the state's tensors are shaped like their parameters
            if (transfer_error.empty())
              transfer_error = concat("lockstep::torch::save_checkpoint: rank ", r, " sent ", bytes,
                                      " bytes of optimizer state where root expected ", expect,
                                      " (a state tensor not shaped like its parameter?)");
            continue;
          }
          std::size_t off = 0;
          for (Tensor* t : mine) {
            if (t->nbytes() > 0) std::memcpy(t->raw_data(), blob.data() + off, t->nbytes());
            off += t->nbytes();
          }
        }
      }
      agreed(backend, "lockstep::torch::save_checkpoint", 0, [&] {
        if (!transfer_error.empty()) throw Error(transfer_error);
      }, "nothing was written");
    }
    if (!archive.empty())
      std::copy(archive.begin(), archive.end(),
                prepared->tensors().at("optimizer.torch_archive").data<std::uint8_t>());
    for (auto& [name, t] : prepared->tensors()) all.emplace(name, t.reshape_view(t.shape()));
    meta["lockstep.torch.optimizer"] = kind_name(kind_of(*optimizer));
  }
  lockstep::save_checkpoint(backend, path, all, meta, 0);
}

std::map<std::string, std::string> load_impl(Backend& backend, const std::filesystem::path& path,
                                             ::torch::nn::Module& module, ::torch::optim::Optimizer* optimizer) {
  TensorMap all;
  agreed(backend, "lockstep::torch::load_checkpoint", 0, [&] {
    add_module(all, module);
    check_no_optimizer_names(all);
  }, "nothing was restored on any rank");
  std::optional<PreparedState> prepared;
  if (optimizer != nullptr) {
    check_same_optimizer(backend, *optimizer, &module, 0, "lockstep::torch::load_checkpoint");
    auto ps = optimizer_params(*optimizer, &module);
    // Which state the file holds decides what is prepared: root reads the file's names (and
    // sends its error instead if it cannot).
    std::string layout;
    if (backend.rank() == 0) {
      try {
        const Checkpoint ck = lockstep::load_checkpoint(path);
        std::unordered_map<std::string, std::int64_t> numel;
        for (const auto& [name, t] : ck.tensors) numel.emplace(name, t.numel());
        const Kind k = kind_of(*optimizer);
        std::string lines;
        for (const auto& p : ps) {
          const std::string prefix = concat("optimizer.state.", p.name, ".");
          std::string line;
          for (const char* f : tensor_fields(k))
            if (numel.count(prefix + f)) (line += f) += ' ';
          const bool any = !line.empty() || (has_step(k) && numel.count(prefix + "step"));
          lines += any ? line + "+\n" : "-\n";
        }
        auto a = numel.find("optimizer.torch_archive");
        layout = concat("C", a == numel.end() ? 0 : a->second, "\n", lines);
      } catch (...) {
        layout = "E" + detail::current_error_message();
      }
    }
    layout = detail::broadcast_string(backend, layout, 0);
    if (layout.empty() || layout[0] != 'C') detail::throw_root_error(backend, layout.substr(1), 0);
    const auto nl = layout.find('\n');
    const std::size_t archive_size = std::stoull(layout.substr(1, nl - 1));
    agreed(backend, "lockstep::torch::load_checkpoint", 0, [&] {
      prepared.emplace(*optimizer, ps, layout.substr(nl + 1), archive_size);
    }, "nothing was restored on any rank");
    for (auto& [name, t] : prepared->tensors()) all.emplace(name, t.reshape_view(t.shape()));
  }
  std::map<std::string, std::string> meta;
  {
    ::torch::NoGradGuard no_grad;
    // All or nothing on every rank: checked against the file before anything is written.
    meta = lockstep::load_checkpoint(backend, path, all, 0);
  }
  if (prepared) {
    prepared->install();
    // A sharded optimizer keeps the state of its own parameters only.
    if (const auto info = shard_info(*optimizer))
      drop_unowned_state(*optimizer, optimizer_params(*optimizer, &module), *info, backend.rank());
  }
  for (auto it = meta.begin(); it != meta.end();) it = it->first.rfind("lockstep.", 0) == 0 ? meta.erase(it) : std::next(it);
  return meta;
}

}  // namespace

void save_checkpoint(Backend& backend, const std::filesystem::path& path, ::torch::nn::Module& module,
                     const std::map<std::string, std::string>& metadata, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::save_checkpoint");
  save_impl(backend, path, module, nullptr, metadata);
}
void save_checkpoint(Backend& backend, const std::filesystem::path& path, ::torch::nn::Module& module,
                     ::torch::optim::Optimizer& optimizer, const std::map<std::string, std::string>& metadata,
                     std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::save_checkpoint");
  save_impl(backend, path, module, &optimizer, metadata);
}
std::map<std::string, std::string> load_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                   ::torch::nn::Module& module, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::load_checkpoint");
  return load_impl(backend, path, module, nullptr);
}
std::map<std::string, std::string> load_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                   ::torch::nn::Module& module, ::torch::optim::Optimizer& optimizer,
                                                   std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::load_checkpoint");
  return load_impl(backend, path, module, &optimizer);
}

// ---------------------------------------------------------------------------------------------
// DistributedOptimizer
// ---------------------------------------------------------------------------------------------

namespace {
// The parameters some live DistributedOptimizer has hooks on: a second one over the same
// parameter would fight the first over its gradient.
std::mutex g_wrapped_mutex;
std::unordered_map<const void*, std::string>& wrapped() {
  static std::unordered_map<const void*, std::string> m;
  return m;
}

// The ranks' check of everything that decides which gradient meets which (see the constructor).
void check_same_structure_for_reduction(Backend& backend, const std::vector<OptParam>& all,
                                        const DistributedOptions& options, const TorchOptions& topts) {
  const char* unused = topts.unused_parameters == UnusedParameters::error ? "error" : "zero";
  const std::string opts = concat("op ", name(options.op), ", accumulation_steps ", options.accumulation_steps,
                                  ", unused_parameters ", unused, ", shard_optimizer_state ",
                                  options.shard_optimizer_state ? "true" : "false", ", wire_dtype ",
                                  options.wire_dtype ? name(*options.wire_dtype) : "none");
  auto desc = [](const OptParam& p) { return param_desc(p); };
  std::string sig = concat("lockstep::torch ", opts, ";");
  for (const auto& p : all) sig += concat(p.name, "=", desc(p), ";");
  detail::check_same_structure(
      backend, sig, 0, 0,
      "lockstep::torch::DistributedOptimizer: no optimizer was wrapped, the ranks' gradients would be averaged "
      "with other parameters' (every rank must train the same parameters, by name)",
      [&] {
        std::vector<detail::StructureEntry> e;
        e.push_back({"options", opts});
        for (const auto& p : all) e.push_back({p.name, desc(p)});
        return e;
      });
}

// Whether gradient g is the slot over the bucket buffer (a sparse gradient, which LibTorch stores
// when the gradient was none, has no data pointer to compare).
bool holds(const at::Tensor& g, const at::Tensor& slot) {
  return g.defined() && g.layout() == c10::kStrided && g.data_ptr() == slot.data_ptr();
}

// testing::fail_next_gradient: the next gradient hook in this process fails.
std::mutex g_fail_mutex;
std::atomic<bool> g_fail_next{false};
std::string g_fail_message;
void maybe_fail_for_testing() {
  if (!g_fail_next.load(std::memory_order_relaxed)) return;
  std::string msg;
  {
    std::lock_guard lock(g_fail_mutex);
    if (!g_fail_next.exchange(false)) return;
    msg = std::move(g_fail_message);
  }
  throw InvalidArgument(msg);
}
}  // namespace

namespace testing {
void fail_next_gradient(std::string message) {
  std::lock_guard lock(g_fail_mutex);
  g_fail_message = std::move(message);
  g_fail_next.store(true);
}
}  // namespace testing

struct DistributedOptimizer::Impl {
  struct Hook final : ::torch::autograd::FunctionPostHook {
    Impl* owner;
    std::size_t index;
    Hook(Impl* o, std::size_t i) : owner(o), index(i) {}
    ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                                const ::torch::autograd::variable_list& /*inputs*/) override {
      owner->on_gradient(index);
      return outputs;
    }
  };

  Backend* backend = nullptr;
  ::torch::optim::Optimizer* optimizer = nullptr;
  DistributedOptions options;
  TorchOptions topts;
  std::vector<OptParam> params;        // the trainable parameters, in optimizer order
  std::vector<at::Tensor> buffers;     // flat gradient buffers
  std::vector<at::Tensor> slots;       // each parameter's gradient: a tensor over its buffer
  std::vector<Tensor> slot_views;      // the same, as Lockstep tensors (what the reducer reduces)
  std::vector<std::pair<std::shared_ptr<::torch::autograd::Node>, std::uintptr_t>> hooks;
  std::unique_ptr<GradientReducer> reducer;

  // per step
  std::vector<int> reports;  // gradients received this micro-step, per parameter
  std::vector<char> used;    // got a gradient in some micro-step of this cycle
  std::vector<char> launched;  // handed to the reducer in this (final) micro-step
  int micro = 0;             // micro-steps of this cycle done (accumulation)
  bool launching = false;    // this micro-step is the cycle's last: hooks launch buckets
  std::string twice;         // first parameter reported twice in the final micro-step
  std::exception_ptr hook_error;  // this rank's first failure in this cycle, agreed at its end
  std::size_t hook_error_param = 0;  // the parameter whose gradient it was taking
  std::string local_bad;     // this rank's first non-finite gradient, before the reduction
  std::int64_t skipped = 0, applied = 0;

  // shard_optimizer_state: the rank that steps each parameter, and the broadcasts that send the
  // owners' updated parameters to every rank (a bucket of small parameters of one owner packed
  // into a staging buffer, or one parameter of bucket_bytes or more, broadcast in place).
  struct ParamBucket {
    int root = 0;
    std::vector<std::size_t> members;
    at::Tensor staging;  // undefined: members[0] is broadcast in place
  };
  bool sharded = false;
  std::vector<int> owners;
  std::int64_t owned_bytes = 0;
  std::vector<ParamBucket> pbuckets;

  void plan_shards(int nranks, int rank) {
    const std::size_t n = params.size();
    owners.assign(n, rank);
    if (!sharded) return;
    auto bytes = [&](std::size_t j) { return static_cast<std::int64_t>(params[j].p.nbytes()); };
    // Largest first, each to the rank with the fewest bytes so far (the lowest on a tie): the
    // same on every rank, since the ranks agreed on every parameter's shape and dtype.
    std::vector<std::size_t> order(n);
    for (std::size_t j = 0; j < n; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes(a) > bytes(b); });
    std::vector<std::int64_t> load(static_cast<std::size_t>(nranks), 0);
    for (std::size_t j : order) {
      const auto r = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      owners[j] = static_cast<int>(r);
      load[r] += bytes(j);
    }
    owned_bytes = load[static_cast<std::size_t>(rank)];
    if (nranks == 1) return;  // nothing to send
    const auto cap = static_cast<std::int64_t>(*options.bucket_bytes);
    for (int r = 0; r < nranks; ++r) {
      ParamBucket cur;
      std::int64_t cur_bytes = 0;
      auto close = [&] {
        if (cur.members.empty()) return;
        if (cur.members.size() > 1)
          cur.staging = at::empty({cur_bytes}, at::TensorOptions().dtype(at::kByte));
        pbuckets.push_back(std::move(cur));
        cur = ParamBucket{};
        cur_bytes = 0;
      };
      for (std::size_t j = 0; j < n; ++j) {
        if (owners[j] != r) continue;
        if (bytes(j) >= cap) {  // a bucket of its own, broadcast in place
          ParamBucket big;
          big.root = r;
          big.members.push_back(j);
          pbuckets.push_back(std::move(big));
          continue;
        }
        if (cur_bytes + bytes(j) > cap) close();
        cur.root = r;
        cur.members.push_back(j);
        cur_bytes += bytes(j);
      }
      close();
    }
  }

  // The owners' parameters to every rank: one broadcast per bucket, in bucket order.
  void broadcast_params() {
    ::torch::NoGradGuard no_grad;
    const int me = backend->rank();
    for (auto& b : pbuckets) {
      if (!b.staging.defined()) {
        backend->broadcast(view(params[b.members.front()].p), b.root);
        continue;
      }
      auto* base = static_cast<std::uint8_t*>(b.staging.data_ptr());
      if (b.root == me) {
        std::size_t off = 0;
        for (std::size_t j : b.members) {
          std::memcpy(base + off, params[j].p.data_ptr(), params[j].p.nbytes());
          off += params[j].p.nbytes();
        }
      }
      backend->broadcast(view(b.staging), b.root);
      if (b.root != me) {
        std::size_t off = 0;
        for (std::size_t j : b.members) {
          std::memcpy(params[j].p.data_ptr(), base + off, params[j].p.nbytes());
          off += params[j].p.nbytes();
        }
      }
    }
  }

  // The inner step on this rank's parameters only (the others' gradients hidden from it), then
  // the broadcasts. A failure of the inner step on one rank is every rank's error (one allreduce
  // of a flag; the broadcasts still happen, so the replicas stay equal).
  void sharded_step() {
    const int me = backend->rank();
    std::exception_ptr error;
    {
      ::torch::NoGradGuard no_grad;
      for (std::size_t j = 0; j < params.size(); ++j)
        if (owners[j] != me) params[j].p.mutable_grad() = at::Tensor();
      try {
        optimizer->step();
      } catch (...) {
        error = std::current_exception();
      }
      for (std::size_t j = 0; j < params.size(); ++j)
        if (owners[j] != me) params[j].p.mutable_grad() = slots[j];
    }
    std::int32_t failed = error ? 1 : 0;
    backend->allreduce(TensorView{&failed, 1, DType::i32, Device::cpu()}, ReduceOp::max);
    broadcast_params();
    if (failed == 0) return;
    detail::Verdict mine;
    if (error) {
      mine = detail::verdict_of([&] { std::rethrow_exception(error); });
      mine.message = concat("lockstep::torch::DistributedOptimizer: the wrapped optimizer's step() failed on its "
                            "share of the parameters: ", mine.message);
    }
    detail::agree(*backend, "lockstep::torch::DistributedOptimizer::step", 0, mine, 0,
                  "the owners' parameters were sent as they were after the failure");
    throw Error("lockstep::torch::DistributedOptimizer::step: the inner step failed on a rank");  // not reached
  }

  void ensure_slot(std::size_t j) {
    at::Tensor& g = params[j].p.mutable_grad();
    if (holds(g, slots[j])) return;
    // LibTorch replaced the gradient (zero_grad set it to none, or a first backward stole a
    // fresh tensor; a sparse one when the gradient was none, from Embedding(sparse) and the
    // like): its values go into the buffer, which becomes the gradient again. Into a dense
    // gradient LibTorch adds sparse ones in place.
    ::torch::NoGradGuard no_grad;
    if (!g.defined())
      slots[j].zero_();
    else if (g.layout() == c10::kStrided)
      slots[j].copy_(g);
    else
      slots[j].copy_(g.to_dense());
    g = slots[j];
  }

  void keep_error(std::size_t j) noexcept {
    if (hook_error) return;
    hook_error = std::current_exception();
    hook_error_param = j;
  }

  // Hands gradient j to the reducer (this rank's failures before are only kept: every rank makes
  // the same collectives, and the step's allreduce tells every rank that one failed).
  void launch(std::size_t j) {
    if (options.skip_non_finite && local_bad.empty()) {
      try {
        std::vector<Tensor*> one{&slot_views[j]};
        local_bad = detail::describe_non_finite(one, [&] { return std::vector<std::string>{params[j].name}; });
      } catch (...) {
        keep_error(j);
      }
    }
    reducer->grad_ready(slot_views[j]);
    launched[j] = 1;
  }

  void on_gradient(std::size_t j) noexcept {
    try {
      maybe_fail_for_testing();
      ensure_slot(j);
      used[j] = 1;
      if (++reports[j] > 1 && launching && twice.empty()) twice = params[j].name;
      if (!launching || launched[j]) return;
      launch(j);
    } catch (...) {
      keep_error(j);
    }
  }

  void start_micro_step() {
    std::fill(reports.begin(), reports.end(), 0);
    std::fill(launched.begin(), launched.end(), 0);
    launching = micro + 1 >= options.accumulation_steps;
  }
};

DistributedOptimizer::DistributedOptimizer(Backend& backend, ::torch::optim::Optimizer& optimizer,
                                           DistributedOptions options, TorchOptions topts,
                                           std::source_location loc)
    : impl_(std::make_unique<Impl>()) {
  detail::CallSiteScope site(loc, "lockstep::torch::DistributedOptimizer");
  auto& m = *impl_;
  m.backend = &backend;
  m.optimizer = &optimizer;
  // bucket_bytes unset follows the path (ls::host_bucket_bytes); the shard broadcasts use it too.
  m.options = lockstep::detail::resolved_options(options, backend);
  m.topts = topts;
  std::vector<OptParam> all;  // every parameter of the optimizer, frozen ones too
  agreed(backend, "lockstep::torch::DistributedOptimizer", 0, [&] {
    LOCKSTEP_CHECK_ARG(options.op == ReduceOp::avg || options.op == ReduceOp::sum,
                       "lockstep::torch::DistributedOptimizer: op must be avg or sum, got ", name(options.op));
    LOCKSTEP_CHECK_ARG(options.accumulation_steps >= 1,
                       "lockstep::torch::DistributedOptimizer: accumulation_steps must be >= 1, got ",
                       options.accumulation_steps);
    std::unordered_map<const void*, std::string> seen;
    all = optimizer_params(optimizer, topts.names_from);
    for (auto p : all) {
      auto [it, fresh] = seen.emplace(p.p.unsafeGetTensorImpl(), p.name);
      LOCKSTEP_CHECK_ARG(fresh, "lockstep::torch::DistributedOptimizer: parameter '", p.name,
                         "' is in the optimizer twice (also as '", it->second, "')");
      if (!trained(p.p)) continue;
      {
        std::lock_guard lock(g_wrapped_mutex);
        LOCKSTEP_CHECK_ARG(!wrapped().count(p.p.unsafeGetTensorImpl()),
                           "lockstep::torch::DistributedOptimizer: parameter '", p.name,
                           "' is already wrapped by another live DistributedOptimizer");
      }
      LOCKSTEP_CHECK_ARG(p.p.device().is_cpu(), "lockstep::torch::DistributedOptimizer: parameter '",
                         p.name, "' is on ", p.p.device(),
                         "; only cpu parameters are supported so far (this adapter has not run on a GPU)");
      LOCKSTEP_CHECK_ARG(p.p.layout() == c10::kStrided && dtype_of(p.p.scalar_type()).has_value(),
                         "lockstep::torch::DistributedOptimizer: parameter '", p.name, "' (", describe(p.p),
                         ") has no flat gradient buffer");
      LOCKSTEP_CHECK_ARG(!options.wire_dtype || p.p.scalar_type() == c10::kFloat,
                         "lockstep::torch::DistributedOptimizer: wire_dtype ",
                         options.wire_dtype ? name(*options.wire_dtype) : "", " compresses Float (f32) gradients; "
                         "parameter '", p.name, "' is ", describe(p.p));
      LOCKSTEP_CHECK_ARG(!options.shard_optimizer_state || p.p.is_contiguous(),
                         "lockstep::torch::DistributedOptimizer: shard_optimizer_state broadcasts each owner's "
                         "parameters in place; parameter '", p.name, "' (", describe(p.p), ") is not contiguous");
      m.params.push_back(std::move(p));
    }
    LOCKSTEP_CHECK_ARG(!options.wire_dtype || *options.wire_dtype == DType::bf16 || *options.wire_dtype == DType::f16,
                       "lockstep::torch::DistributedOptimizer: wire_dtype must be bf16 or f16 (a 16-bit float), got ",
                       options.wire_dtype ? name(*options.wire_dtype) : "none");
    LOCKSTEP_CHECK_ARG(!options.shard_optimizer_state || kind_of(optimizer) != Kind::other,
                       "lockstep::torch::DistributedOptimizer: shard_optimizer_state needs Adam, AdamW, SGD, RMSprop "
                       "or Adagrad (optimizers known to step only parameters that have a gradient, and whose state "
                       "Lockstep gathers field by field for a checkpoint); this optimizer is another kind");
  }, "no optimizer was wrapped");
  // Which numbers meet which in the reductions: the ranks must agree on every parameter of the
  // optimizer, in order, by name (the module's, or the position), with its group, dtype, shape,
  // device and whether it is trained, and on the options that decide what is reduced when.
  // Shapes alone do not tell a rank that froze l1 from one that froze l2 of the same shape: each
  // would average its l2 with the other's l1. Checked once, here (one allgather of a hash), before
  // anything is changed.
  check_same_structure_for_reduction(backend, all, options, topts);
  // The buffers: one per run of parameters of one dtype and device, in optimizer order, so that
  // every bucket of the reducer (buckets never span a dtype or device change) lies back to back
  // and is reduced in place.
  const std::size_t n = m.params.size();
  m.slots.resize(n);
  {
    ::torch::NoGradGuard no_grad;
    std::size_t i = 0;
    while (i < n) {
      std::size_t j = i;
      std::int64_t total = 0;
      while (j < n && m.params[j].p.scalar_type() == m.params[i].p.scalar_type() &&
             m.params[j].p.device() == m.params[i].p.device())
        total += m.params[j++].p.numel();
      at::Tensor buf = at::zeros({total}, m.params[i].p.options().requires_grad(false));
      std::int64_t off = 0;
      for (std::size_t k = i; k < j; ++k) {
        const at::Tensor& p = m.params[k].p;
        // A plain tensor over the buffer's memory, not a view: LibTorch's own zero_grad
        // (detach_ then zero_) works on it, and autograd accumulates into it in place.
        char* base = static_cast<char*>(buf.data_ptr()) + off * static_cast<std::int64_t>(buf.element_size());
        m.slots[k] = at::from_blob(base, p.sizes(), [keep = buf](void*) {}, buf.options());
        const at::Tensor& old = p.grad();
        if (old.defined()) m.slots[k].copy_(old.layout() == c10::kStrided ? old : old.to_dense());
        m.params[k].p.mutable_grad() = m.slots[k];
        off += p.numel();
      }
      m.buffers.push_back(std::move(buf));
      i = j;
    }
  }
  std::vector<Tensor*> ptrs;
  std::vector<std::string> names;
  m.slot_views.reserve(n);
  for (std::size_t k = 0; k < n; ++k) {
    m.slot_views.push_back(borrow(m.slots[k]));
    names.push_back(m.params[k].name);
  }
  for (auto& v : m.slot_views) ptrs.push_back(&v);
  // Accumulation happens in LibTorch's gradients: the reducer reduces once per cycle (the
  // ranks' accumulation_steps were compared above; the reducer's check covers its options).
  DistributedOptions reducer_options = options;
  reducer_options.accumulation_steps = 1;
  // Sharded, the gradients are still all-reduced (whole parameters, not the core's flat pieces):
  // the reducer does what it does without sharding.
  reducer_options.shard_optimizer_state = false;
  m.reducer = std::make_unique<GradientReducer>(backend, std::move(ptrs), std::move(names), reducer_options, loc);
  {
    std::lock_guard lock(g_wrapped_mutex);
    for (auto& p : m.params) wrapped().emplace(p.p.unsafeGetTensorImpl(), p.name);
  }
  m.reports.assign(n, 0);
  m.used.assign(n, 0);
  m.launched.assign(n, 0);
  m.start_micro_step();
  for (std::size_t k = 0; k < n; ++k) {
    auto acc = ::torch::autograd::impl::grad_accumulator(m.params[k].p);
    LOCKSTEP_CHECK_ARG(acc != nullptr, "lockstep::torch::DistributedOptimizer: parameter '", m.params[k].name,
                       "' has no gradient accumulator (is it a leaf that requires grad?)");
    const std::uintptr_t key = acc->add_post_hook(std::make_unique<Impl::Hook>(&m, k));
    m.hooks.emplace_back(std::move(acc), key);
  }
  // Last: nothing after this throws, so the registry never names an optimizer no live wrapper
  // shards.
  m.sharded = options.shard_optimizer_state;
  m.plan_shards(backend.size(), backend.rank());
  if (m.sharded) {
    ShardInfo info;
    info.nranks = backend.size();
    info.owner.assign(all.size(), -1);
    std::unordered_map<const void*, int> owner_of;
    for (std::size_t k = 0; k < n; ++k) owner_of.emplace(m.params[k].p.unsafeGetTensorImpl(), m.owners[k]);
    for (std::size_t i = 0; i < all.size(); ++i) {
      auto it = owner_of.find(all[i].p.unsafeGetTensorImpl());
      if (it != owner_of.end()) info.owner[i] = it->second;
    }
    // State the optimizer already holds (a checkpoint loaded before wrapping) is kept for this
    // rank's own parameters only.
    drop_unowned_state(optimizer, all, info, backend.rank());
    std::lock_guard lock(g_shard_mutex);
    sharded_optimizers()[&optimizer] = std::move(info);
  }
}

DistributedOptimizer::~DistributedOptimizer() {
  if (!impl_) return;
  for (auto& [node, key] : impl_->hooks) node->del_post_hook(key);
  if (impl_->sharded) {
    std::lock_guard lock(g_shard_mutex);
    sharded_optimizers().erase(impl_->optimizer);
  }
  std::lock_guard lock(g_wrapped_mutex);
  for (auto& p : impl_->params) wrapped().erase(p.p.unsafeGetTensorImpl());
}

void DistributedOptimizer::zero_grad() {
  auto& m = *impl_;
  if (m.micro > 0) return;  // inside an accumulation cycle: the gradients add up
  ::torch::NoGradGuard no_grad;
  for (auto& b : m.buffers) b.zero_();
  for (std::size_t j = 0; j < m.params.size(); ++j) {
    at::Tensor& g = m.params[j].p.mutable_grad();
    if (!holds(g, m.slots[j])) g = m.slots[j];
  }
}

bool DistributedOptimizer::step(std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::DistributedOptimizer::step");
  auto& m = *impl_;
  const std::size_t n = m.params.size();
  ++m.micro;
  if (m.micro < m.options.accumulation_steps) {
    // No collective here: a failure is kept, and every rank learns of it at the cycle's end.
    for (std::size_t j = 0; j < n; ++j) {
      try {
        if (m.reports[j] > 0) m.ensure_slot(j);
      } catch (...) {
        m.keep_error(j);
      }
    }
    m.start_micro_step();
    return false;
  }
  // The cycle's last micro-step. Parameters backward did not report are launched now, in bucket
  // order like the rest, whatever this rank saw, even after a failure here (a hook's, kept in
  // hook_error): every rank makes the same collectives, and the flags' allreduce below tells
  // every rank whether one failed.
  struct Reset {
    Impl& m;
    ~Reset() {
      m.micro = 0;
      std::fill(m.used.begin(), m.used.end(), 0);
      m.twice.clear();
      m.local_bad.clear();
      m.hook_error = nullptr;
      m.start_micro_step();
    }
  } reset{m};
  std::int32_t first_unused = static_cast<std::int32_t>(n);
  {
    ::torch::NoGradGuard no_grad;
    for (std::size_t j = 0; j < n; ++j) {
      try {
        if (!m.used[j]) {
          if (first_unused == static_cast<std::int32_t>(n)) first_unused = static_cast<std::int32_t>(j);
          m.slots[j].zero_();
          m.params[j].p.mutable_grad() = m.slots[j];
        } else {
          m.ensure_slot(j);
        }
      } catch (...) {
        m.keep_error(j);
      }
      if (!m.launched[j]) m.launch(j);
    }
  }
  m.reducer->reduce();
  // Every rank learns whether any rank failed before (a gradient hook, a gradient that could not
  // be taken), had a parameter without gradient or one reported twice (one allreduce of three
  // integers), and every rank throws the same error.
  std::int32_t flags[3] = {first_unused, m.twice.empty() ? 0 : -1, m.hook_error ? -1 : 0};
  if (m.topts.unused_parameters == UnusedParameters::zero) flags[0] = static_cast<std::int32_t>(n);
  m.backend->allreduce(TensorView{flags, 3, DType::i32, Device::cpu()}, ReduceOp::min);
  if (flags[2] != 0) {
    // The failing ranks' errors reach every rank (one allgather; one broadcast of the lowest
    // failing rank's message), which throws it.
    detail::Verdict mine;
    if (m.hook_error) {
      mine = detail::verdict_of([&] { std::rethrow_exception(m.hook_error); });
      mine.message = concat("lockstep::torch::DistributedOptimizer: taking the gradient of '",
                            m.params[m.hook_error_param].name, "' failed: ", mine.message);
    }
    detail::agree(*m.backend, "lockstep::torch::DistributedOptimizer::step", 0, mine, 0,
                  "the step was not taken on any rank");
    throw Error("lockstep::torch::DistributedOptimizer::step: a rank failed before the reduction; the step was "
                "not taken on any rank");  // not reached: agree threw the failing rank's error
  }
  if (flags[1] != 0)
    throw InvalidArgument(concat("lockstep::torch::DistributedOptimizer::step: a gradient was produced twice "
                                 "before step() on at least one rank", m.twice.empty() ? "" : " (here: '" + m.twice + "')",
                                 "; its reduction had already started. Call step() after every backward, or use "
                                 "DistributedOptions::accumulation_steps to accumulate; the step was not taken"));
  if (flags[0] < static_cast<std::int32_t>(n))
    throw InvalidArgument(concat(
        "lockstep::torch::DistributedOptimizer::step: parameter '", m.params[static_cast<std::size_t>(flags[0])].name,
        "' got no gradient in this step on at least one rank", first_unused == flags[0] ? " (this one)" : "",
        " (a branch the forward pass did not take?); the step was not taken on any rank. Pass "
        "TorchOptions{.unused_parameters = lockstep::torch::UnusedParameters::zero} to count such "
        "gradients as zero"));
  ::torch::NoGradGuard no_grad;
  if (m.options.accumulation_steps > 1 && m.options.op == ReduceOp::avg)
    for (auto& b : m.buffers) b.div_(static_cast<double>(m.options.accumulation_steps));
  if (m.options.skip_non_finite) {
    std::vector<Tensor*> all;
    for (auto& v : m.slot_views) all.push_back(&v);
    const std::size_t bad = detail::first_non_finite(all);
    if (bad < all.size()) {
      ++m.skipped;
      detail::log_skipped_step(*m.backend, m.skipped + m.applied, m.local_bad,
                               m.params[bad].name);
      return false;
    }
  }
  if (m.sharded)
    m.sharded_step();
  else
    m.optimizer->step();
  ++m.applied;
  if (m.options.check_replicas_every > 0 && m.applied % m.options.check_replicas_every == 0) {
    std::vector<OptParam> all = optimizer_params(*m.optimizer, m.topts.names_from);
    PreparedState state(*m.optimizer, all, state_layout(*m.optimizer, all), 0);
    TensorMap x;
    for (auto& p : all)
      if (p.p.defined()) x.emplace("param." + p.name, borrow(p.p));
    // Sharded, each rank's state is its own by design: the parameters and learning rates only.
    for (auto& [name, t] : state.tensors())
      if (name != "optimizer.torch_archive" && (!m.sharded || name.rfind("optimizer.state.", 0) != 0))
        x.emplace(name, t.reshape_view(t.shape()));
    lockstep::check_replicas(*m.backend, x);
  }
  return true;
}

::torch::optim::Optimizer& DistributedOptimizer::optimizer() const noexcept { return *impl_->optimizer; }
const GradientReducer& DistributedOptimizer::reducer() const noexcept { return *impl_->reducer; }
std::int64_t DistributedOptimizer::skipped_steps() const noexcept { return impl_->skipped; }
std::int64_t DistributedOptimizer::applied_steps() const noexcept { return impl_->applied; }
std::size_t DistributedOptimizer::buffer_count() const noexcept { return impl_->buffers.size(); }
bool DistributedOptimizer::sharded() const noexcept { return impl_->sharded; }
const std::vector<int>& DistributedOptimizer::owners() const noexcept { return impl_->owners; }
std::int64_t DistributedOptimizer::owned_bytes() const noexcept { return impl_->owned_bytes; }
std::size_t DistributedOptimizer::broadcast_count() const noexcept { return impl_->pbuckets.size(); }

}  // namespace lockstep::torch
