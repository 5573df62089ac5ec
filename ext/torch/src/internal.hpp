// What the files of lockstep::torch share (internal: not installed). Each group is defined in the
// file it names:
//   bridge.cpp                 at::Tensor <-> Lockstep tensors (view, borrow: the public part)
//   module_state.cpp           a module's parameters and buffers by name; synchronize(module)
//   optimizer_state.cpp        an optimizer's state as named tensors; synchronize(optimizer)
//   checkpoint.cpp             save_checkpoint / load_checkpoint of a module and its optimizer
//   distributed_optimizer.cpp  DistributedOptimizer (hooks, buckets, the sharded step)
//   deterministic.cpp          deterministic mode's LibTorch settings and checks; model_hash
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/comm/consensus.hpp"
#include "lockstep/torch.hpp"

namespace lockstep::torch::internal {

// --- bridge.cpp --------------------------------------------------------------------------------

// "f32 [2, 3] on cpu", for messages.
std::string describe(const at::Tensor& t);
// The Lockstep dtype of a LibTorch scalar type (nullopt: none).
std::optional<DType> dtype_of(c10::ScalarType s);
Shape shape_of(const at::Tensor& t);

// --- module_state.cpp --------------------------------------------------------------------------

using TensorMap = std::map<std::string, Tensor>;

// Every parameter and buffer of m, by name, as borrowed Lockstep tensors; a tensor registered
// under several names (a tied weight) once, under its first name (named_parameters order). Throws
// InvalidArgument naming the first one that has no flat view; call it inside an agreement.
void add_module(TensorMap& out, const ::torch::nn::Module& m);

// Runs f() on every rank and makes the ranks agree on its outcome: every rank throws the
// lowest failing rank's error if any failed.
template <class F>
void agreed(Backend& backend, const char* what, int root, F&& f, const char* consequence) {
  detail::agree(backend, what, root, detail::verdict_of(std::forward<F>(f)), 0, consequence);
}

// --- optimizer_state.cpp -----------------------------------------------------------------------

// The optimizers whose state Lockstep knows field by field; the others go through their own
// save()/load() (an archive of bytes).
enum class Kind { adam, adamw, sgd, rmsprop, adagrad, other };
Kind kind_of(::torch::optim::Optimizer& o);
const char* kind_name(Kind k);
// The tensor fields of each known state, and whether it has a step counter.
const std::vector<const char*>& tensor_fields(Kind k);
bool has_step(Kind k);

// The optimizer's parameters in order (group by group), with a name for each: the module's
// name when `names` knows the parameter, else its position.
struct OptParam {
  at::Tensor p;
  std::string name;
  std::size_t group = 0;
};
std::vector<OptParam> optimizer_params(::torch::optim::Optimizer& o, const ::torch::nn::Module* names);
// A parameter DistributedOptimizer reduces the gradient of (the others it leaves alone).
bool trained(const at::Tensor& p);

// Optimizers whose state a live DistributedOptimizer shards (shard_optimizer_state): per
// parameter of optimizer_params() (frozen ones included), the rank that owns it, -1 for one
// that is not trained (its state, if any, is kept on every rank as it is). The registry is
// sharded_optimizers(), guarded by g_shard_mutex.
struct ShardInfo {
  int nranks = 1;
  std::vector<int> owner;
};
extern std::mutex g_shard_mutex;
std::unordered_map<const ::torch::optim::Optimizer*, ShardInfo>& sharded_optimizers();
std::optional<ShardInfo> shard_info(const ::torch::optim::Optimizer& o);

// A parameter as the ranks' check of their optimizers names it.
std::string param_desc(const OptParam& p);
// The ranks' check that their optimizers hold the same parameters (MismatchError otherwise).
void check_same_optimizer(Backend& backend, ::torch::optim::Optimizer& o, const ::torch::nn::Module* names,
                          int root, const char* what);
// Which state a rank's optimizer holds: per parameter, "-" (none) or the defined tensor fields,
// one line each; for an optimizer of another kind, the size of its archive.
std::string state_layout(::torch::optim::Optimizer& o, const std::vector<OptParam>& ps);
// The optimizer's own save() (an optimizer Lockstep does not know field by field).
std::vector<std::uint8_t> archive_bytes(::torch::optim::Optimizer& o);

// The optimizer's state as named Lockstep tensors, laid out as `layout` says (another rank's
// or a file's), without changing the optimizer: tensors that exist are borrowed in place, the
// ones to create are new (zeros like their parameter) and installed by install(), after the
// collective that fills them succeeded.
class PreparedState {
 public:
  PreparedState(::torch::optim::Optimizer& o, std::vector<OptParam> ps, const std::string& layout,
                std::size_t archive_size);

  TensorMap& tensors() noexcept { return tensors_; }

  // Makes the optimizer hold what the tensors now hold: new state objects and fields
  // installed, state the layout does not have dropped, learning rates set.
  void install();

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
                        int rank);
std::vector<std::string> split_lines(const std::string& s);

// --- deterministic.cpp -------------------------------------------------------------------------

// LibTorch's settings of deterministic mode, held while the object lives (one per deterministic
// DistributedOptimizer): intra-op threads (at::set_num_threads, and OpenBLAS's pool where
// LibTorch uses OpenBLAS) set to `threads`, deterministic algorithms on. The values from before
// the first such object are restored when the last one goes.
class DeterministicSettings {
 public:
  explicit DeterministicSettings(int threads);
  ~DeterministicSettings();
  DeterministicSettings(const DeterministicSettings&) = delete;
  DeterministicSettings& operator=(const DeterministicSettings&) = delete;
};
// True while some deterministic DistributedOptimizer lives in this process (SyncBatchNorm's
// training forward then refuses).
bool deterministic_live();
// The name of the first lt::SyncBatchNorm inside m (m itself included), or "" if none.
std::string find_sync_batchnorm(const ::torch::nn::Module& m);

// --- join.cpp ----------------------------------------------------------------------------------

// Whether this rank takes the current step of a Join loop over `backend` without a batch (set by
// Join::next; false once the loop ends). A deterministic DistributedOptimizer on that backend
// then drops the step's zero-row gradient instead of counting it as a micro-batch.
void set_joined(const Backend* backend, bool joined);
bool joined(const Backend* backend);

}  // namespace lockstep::torch::internal
