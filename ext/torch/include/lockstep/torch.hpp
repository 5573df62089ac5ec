// lockstep::torch: data-parallel training of LibTorch models, the DistributedDataParallel that
// LibTorch's C++ frontend lacks. Target lockstep::torch (ext/torch), built when CMake finds
// LibTorch (find_package(Torch)); the core never needs it.
//
//   #include <torch/torch.h>
//   #include <lockstep/torch.hpp>
//   namespace lt = lockstep::torch;
//
//   lt::synchronize(backend, *net, 0);                    // parameters and buffers, by name
//   torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
//   lt::DistributedOptimizer opt(backend, adam);          // wraps any torch::optim optimizer
//   for (...) {
//     opt.zero_grad();                                   // not adam.zero_grad()
//     torch::mse_loss(net->forward(x), y).backward();    // buckets reduce during backward
//     opt.step();                                        // waits, then adam.step()
//   }
//   lt::save_checkpoint(backend, "ck.safetensors", *net, adam);
//
// This header declares LibTorch's types without including LibTorch (its headers are slow to
// compile); code that calls these functions includes <torch/torch.h> itself. Inside namespace
// lockstep::torch, LibTorch's own namespace is ::torch.
//
// Also: lt::Join (uneven inputs, lockstep/torch/join.hpp, included here) and lt::SyncBatchNorm1d/
// 2d/3d with lt::convert_sync_batchnorm (<lockstep/torch/sync_batchnorm.hpp>, included on its own:
// its module holders need LibTorch's headers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/train/gradient_reducer.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/torch/join.hpp"

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace lockstep::torch {

/// A zero-copy view of a contiguous, dense at::Tensor on the cpu or a cuda device, of a dtype
/// both sides have (f16, bf16, f32, f64, i32, i64, u8; bool as u8). InvalidArgument naming what
/// is wrong otherwise (non-contiguous, sparse, undefined, another dtype or device).
TensorView view(const at::Tensor& t);
/// The same as an ls::Tensor that borrows the memory (the at::Tensor must outlive it).
Tensor borrow(const at::Tensor& t);

/// Collective: every parameter and buffer of `module` (BatchNorm's running statistics too),
/// by name, made bitwise equal to root's. First the ranks check that their modules have the
/// same names, shapes, dtypes and devices: MismatchError on every rank naming the first
/// difference otherwise, and nothing is changed.
/// A tied weight (one tensor under several names) is broadcast once.
void synchronize(Backend& backend, ::torch::nn::Module& module, int root = 0,
                 std::source_location loc = std::source_location::current());
/// Collective: the optimizer's state (Adam's step and moments, SGD's momentum buffers...) and
/// each parameter group's learning rate made equal to root's. State LibTorch has not created
/// yet (it creates it at the first step) is created where root has it and dropped where root
/// has none. The ranks first check that their optimizers have the same kind and the same
/// parameter groups (position by position: shapes, dtypes, trained or frozen): MismatchError on
/// every rank otherwise. Optimizers other than Adam, AdamW, SGD, RMSprop and Adagrad go through
/// their own save()/load(). An optimizer whose state a live DistributedOptimizer shards is
/// refused (InvalidArgument on every rank).
void synchronize(Backend& backend, ::torch::optim::Optimizer& optimizer, int root = 0,
                 std::source_location loc = std::source_location::current());

/// What DistributedOptimizer does with a trainable parameter that got no gradient in a step
/// on some rank (a branch the forward pass did not take: DDP's find_unused_parameters).
enum class UnusedParameters {
  error,  ///< every rank throws InvalidArgument naming the parameter (the default)
  zero,   ///< its gradient counts as zero on that rank (the optimizer still steps it)
};

/// What lockstep::torch adds to ls::DistributedOptions.
struct TorchOptions {
  UnusedParameters unused_parameters = UnusedParameters::error;
  /// Names the parameters in messages and in the ranks' setup check ("0.weight"); without it
  /// they are named by position ("param_groups.0.params.3"), and ranks whose optimizers hold
  /// only their trainable parameters, different ones of the same shapes, cannot be told apart.
  const ::torch::nn::Module* names_from = nullptr;
  /// Deterministic mode (DistributedOptions::deterministic) only: LibTorch's intra-op threads
  /// (at::set_num_threads, and OpenBLAS's where LibTorch uses it) are set to this count on every
  /// rank, whatever the rank count, because a parallel reduction inside an operator may split its
  /// sum by thread: runs compared bit for bit must use the same value (the ranks must agree).
  int deterministic_threads = 1;
  /// Gradient clipping by the global norm (torch::nn::utils::clip_grad_norm_ with norm 2): after
  /// the reduction, before the wrapped optimizer's step, if the 2-norm of all reduced gradients
  /// together exceeds this, every gradient is multiplied by max_grad_norm / (norm + 1e-6). The
  /// reduced gradients are the same bits on every rank, so the norm is computed from them locally,
  /// in one fixed order (optimizer order, element order, in f64, no threads): the same value on
  /// every rank and, in deterministic mode, at any rank count. No extra collective. Unset: none.
  std::optional<double> max_grad_norm = std::nullopt;
};

/// Wraps a torch::optim optimizer (held by reference; it must outlive this) so that gradients
/// are averaged (or summed) across ranks before its step. Collective to construct: every rank
/// must wrap an optimizer over the same parameters (by name, in the same order and groups, with
/// the same shapes, dtypes and devices, the same ones trained and frozen) with the same options:
/// MismatchError on every rank naming the first difference otherwise, and nothing is changed.
/// Each tensor once: a tied weight (the embedding and the output head sharing one tensor) is
/// listed once per name by LibTorch's Module::parameters(), and an optimizer given it twice is
/// refused (InvalidArgument on every rank; torch::optim would step it twice); given once, its
/// gradient (the sum of both uses, as autograd makes it) is reduced once and named by its first name.
/// Sparse gradients (Embedding(sparse)) are added into the dense buffers. A failure while taking
/// a gradient on one rank is thrown by the cycle's last step() on every rank, naming the
/// parameter and the rank; the step is not taken.
///
/// The gradients become views into one flat buffer per run of parameters of one dtype and
/// device (DDP's gradient_as_bucket_view): buckets are reduced in place, and the reductions
/// start during backward, from autograd hooks, as soon as every gradient of a bucket is final.
/// Use this object's zero_grad(): it zeroes the buffers in place (torch's own zero_grad also
/// works, but may set gradients to none; they are then copied back into the buffers).
///
/// Options (ls::DistributedOptions): bucket_bytes and op as for the core; accumulation_steps =
/// k: the first k-1 step() calls of a cycle only let gradients accumulate locally (no
/// communication, no inner step; zero_grad() leaves them), the k-th reduces the sum once
/// (divided by k too with ReduceOp::avg) and steps; skip_non_finite: a NaN or infinity in any
/// rank's gradient skips the inner step on every rank; check_replicas_every = K: the
/// parameters and the optimizer state are compared across ranks every K steps.
///
/// wire_dtype = bf16 or f16: f32 gradients travel as 16-bit floats (half the bytes), summed in
/// f32 where the path allows it and divided in f32; the wrapped optimizer sees f32 gradients.
/// Every trained parameter must then be f32 (InvalidArgument on every rank naming one that is
/// not).
///
/// shard_optimizer_state (PyTorch's ZeroRedundancyOptimizer over DDP): each trained parameter,
/// whole, is owned by one rank (largest first, each to the rank with the fewest bytes so far: the
/// same assignment on every rank, owners()). Gradients are reduced as without it; then each rank
/// runs the wrapped optimizer's step() on its own parameters only (the others' gradients are
/// hidden from it for that call, so it creates state for its own only; state it held for the
/// others' is dropped at construction), and each owner's updated parameters reach every rank by
/// one broadcast per bucket (bucket_bytes; a parameter of bucket_bytes or more is broadcast in
/// place). For Adam, AdamW, SGD, RMSprop and Adagrad (others: InvalidArgument). save_checkpoint
/// writes the same file as without sharding (root gathers the state), load_checkpoint reads any
/// file at any number of ranks, lt::synchronize(optimizer) refuses a sharded optimizer.
///
/// deterministic (docs/torch.md, "Deterministic training"): the parameters after every step are
/// the same bits at any rank count. Each micro-batch's gradient is computed alone (zero_grad,
/// backward) and handed to accumulate(), which adds it into an exact, order-independent sum (the
/// core's, docs/training.md) and zeroes the gradients; a rank may accumulate any number of
/// micro-batches, zero included. step() (collective) accumulates a gradient that backward left
/// since the last accumulate(), sums every micro-batch of every rank exactly, divides by their
/// total count (ReduceOp::avg), and calls the optimizer's step(). Setup also sets LibTorch's
/// intra-op threads (TorchOptions::deterministic_threads) and its deterministic algorithms
/// (at::globalContext().setDeterministicAlgorithms(true, false)) for as long as a deterministic
/// DistributedOptimizer lives. Refused at setup on every rank (InvalidArgument):
/// shard_optimizer_state, wire_dtype, a trained parameter that is not f32, a cuda parameter, and
/// lt::SyncBatchNorm in names_from's module (its statistics are over what the ranks process at
/// the same moment, which depends on the rank count; a SyncBatchNorm's training forward refuses
/// too while a deterministic DistributedOptimizer lives). accumulation_steps = k: the first k-1
/// step() calls only accumulate; skip_non_finite and check_replicas_every work as without it.
///
/// Parameters on a cuda device are refused for now (InvalidArgument): Debian's LibTorch is
/// CPU-only and this adapter has not run on a GPU.
class DistributedOptimizer {
 public:
  DistributedOptimizer(Backend& backend, ::torch::optim::Optimizer& optimizer,
                       DistributedOptions options = {}, TorchOptions torch_options = {},
                       std::source_location loc = std::source_location::current());
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  /// Zeroes every gradient in place (inside an accumulation cycle: does nothing, so that the
  /// micro-batches' gradients add up).
  void zero_grad();
  /// Collective. Reduces what backward has not, waits for every bucket, checks that every
  /// parameter got a gradient on every rank, then calls the optimizer's step(). Returns true if
  /// it stepped; false for an accumulate-only micro-step or a step skipped for a non-finite
  /// gradient.
  bool step(std::source_location loc = std::source_location::current());
  /// Deterministic mode: adds the gradients backward produced since the last zero_grad() or
  /// accumulate() (one micro-batch; a parameter without gradient counts as zero, or is the step's
  /// error with UnusedParameters::error) into the exact sums, and zeroes the gradients. Local
  /// (no communication): a failure here is thrown by the next step() on every rank.
  /// InvalidArgument outside deterministic mode (use accumulation_steps there).
  void accumulate();
  /// Micro-batches this rank accumulated since the last step (deterministic mode).
  std::int64_t accumulated() const noexcept;
  /// TorchOptions::max_grad_norm: the global 2-norm of the last step's reduced gradients, before
  /// clipping (the same on every rank); NaN before the first step or without max_grad_norm.
  double last_grad_norm() const noexcept;
  bool deterministic() const noexcept;

  ::torch::optim::Optimizer& optimizer() const noexcept;
  const GradientReducer& reducer() const noexcept;
  /// Steps skipped for non-finite gradients, and steps applied; the same on every rank.
  std::int64_t skipped_steps() const noexcept;
  std::int64_t applied_steps() const noexcept;
  /// The flat gradient buffers (one per run of parameters of one dtype and device).
  std::size_t buffer_count() const noexcept;
  /// shard_optimizer_state: true; owners()[i] is the rank that steps the i-th trained parameter
  /// (optimizer order, frozen ones left out; every entry is this rank when not sharded), and
  /// owned_bytes() the bytes of this rank's parameters. Parameter broadcasts per step:
  /// broadcast_count().
  bool sharded() const noexcept;
  const std::vector<int>& owners() const noexcept;
  std::int64_t owned_bytes() const noexcept;
  std::size_t broadcast_count() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// "crc32c:" and 8 lowercase hex digits: the CRC-32C of the bytes of every parameter of `module`
/// (named_parameters, recursively), in the order of their names compared bytewise (as Python
/// sorts a state_dict's keys), the same hash ls::model_hash gives for Lockstep tensors; a tied
/// weight (one tensor registered under several names) once, under its first name. Buffers
/// (BatchNorm's running statistics) are not hashed. Local: no communication.
std::string model_hash(const ::torch::nn::Module& module);

/// The bytes of the tensors in the optimizer's state on this rank (Adam's moments, SGD's
/// momentum buffers...; for an optimizer Lockstep does not know field by field, the size of its
/// save() archive). Not collective.
std::int64_t state_bytes(::torch::optim::Optimizer& optimizer);

/// Collective: root writes the module's parameters and buffers (names as the module names
/// them: "0.weight", "bn.running_mean"; a tied weight, one tensor registered under several names,
/// once, under the first name named_parameters gives it, as safetensors' save_model does) and, when given, the optimizer's state
/// ("optimizer.state.0.weight.exp_avg", "optimizer.param_groups.0.lr") to one safetensors file
/// that Python reads (docs/torch.md has a reader for Debian 12, which lacks python3-safetensors). Atomic, checksummed, and the
/// same error on every rank, as ls::save_checkpoint. Each parameter's optimizer state is root's,
/// or, where root has none, that of the lowest rank that has it (a sharded state: its owner's),
/// so a sharded optimizer writes the replicated form's file.
/// `metadata` (string keys and values; keys starting with "lockstep." are reserved) is stored in
/// the file's header and returned by load_checkpoint.
void save_checkpoint(Backend& backend, const std::filesystem::path& path, ::torch::nn::Module& module,
                     const std::map<std::string, std::string>& metadata = {},
                     std::source_location loc = std::source_location::current());
void save_checkpoint(Backend& backend, const std::filesystem::path& path, ::torch::nn::Module& module,
                     ::torch::optim::Optimizer& optimizer, const std::map<std::string, std::string>& metadata = {},
                     std::source_location loc = std::source_location::current());
/// Collective resume, all or nothing: every rank's module (and optimizer) is checked against
/// the file before anything changes; then every rank holds root's file's values, bitwise.
/// Returns the file's metadata on every rank. It may be called before or after a
/// DistributedOptimizer wraps the optimizer (parameters and state are written in place; its
/// applied_steps() and skipped_steps() count that object's own steps and are not restored).
std::map<std::string, std::string> load_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                   ::torch::nn::Module& module,
                                                   std::source_location loc = std::source_location::current());
std::map<std::string, std::string> load_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                   ::torch::nn::Module& module, ::torch::optim::Optimizer& optimizer,
                                                   std::source_location loc = std::source_location::current());

}  // namespace lockstep::torch
