// lockstep::torch::SyncBatchNorm1d/2d/3d and convert_sync_batchnorm: BatchNorm whose training
// statistics are those of the global batch (every rank's rows), PyTorch's nn.SyncBatchNorm.
//
//   #include <torch/torch.h>
//   #include <lockstep/torch/sync_batchnorm.hpp>
//   namespace lt = lockstep::torch;
//
//   bn = register_module("bn", lt::SyncBatchNorm2d(backend, torch::nn::BatchNorm2dOptions(16)));
//   // or keep torch::nn::BatchNorm2d inside Sequential / ModuleList / ModuleDict and convert:
//   lt::convert_sync_batchnorm(backend, *net);
//
// Unlike lockstep/torch.hpp this header includes LibTorch's module headers (a module holder
// needs them); include it where the model is declared.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <source_location>
#include <vector>

#include "lockstep/torch.hpp"

namespace lockstep::torch {

/// BatchNorm over D spatial dimensions (1: input (N, C) or (N, C, L); 2: (N, C, H, W); 3:
/// (N, C, D, H, W)) with torch::nn::BatchNormNd's options, parameters and buffers (`weight`,
/// `bias`, `running_mean`, `running_var`, `num_batches_tracked`: the same state_dict names, so
/// checkpoints of one load into the other).
///
/// Training mode: the input is normalised with the mean and (biased) variance of the global
/// batch, every rank's rows, weighted by each rank's row count (a rank may have 0 rows). Forward
/// makes one collective (an allgather of every rank's count and per-channel mean and biased
/// variance, f64, which every rank combines in rank order), backward one (the per-channel sums
/// of dy and dy * xhat, f64; none when no rank's input needs a gradient: forward tells the
/// ranks, so every rank whose backward runs makes it, also one whose own input needs none); the
/// gradient of the input is that of the global batch, the gradients of weight and bias are this rank's share (the
/// optimizer's average over ranks makes them the global batch's mean). running_mean and
/// running_var are updated with the global mean and unbiased variance (momentum, or a
/// cumulative average when momentum is unset), so they stay equal on every rank. Every rank
/// must call forward (and backward) the same number of times: a backward run on some ranks
/// only leaves them waiting for the others (until the deadline). Fewer than 2 values per channel
/// in the global batch, or an input one rank refuses (its dimensionality, channels or a
/// non-floating dtype), is an InvalidArgument on every rank naming the rank, before any rank
/// normalises or counts the batch; so is a forward that records no autograd graph on one rank
/// (no_grad, or nothing there needs a gradient) while another rank's input needs a gradient
/// (that rank's backward would wait for it).
///
/// Eval mode: the running statistics, no collective. With track_running_stats(false), eval
/// mode normalises with this rank's own batch (no collective), as PyTorch's SyncBatchNorm does.
template <std::size_t D>
class SyncBatchNormImpl : public ::torch::nn::Cloneable<SyncBatchNormImpl<D>> {
 public:
  /// The module keeps a BackendRef to `backend`, and so does every training forward's autograd
  /// graph: a training forward, or a backward, after the backend was destroyed (finalize, or a
  /// backend of the caller's gone out of scope) is an InvalidArgument saying so, on every rank
  /// where it happens (no collective is attempted). Eval mode needs no backend.
  SyncBatchNormImpl(Backend& backend, const ::torch::nn::BatchNormOptions& options);
  /// For convert_sync_batchnorm: registers these tensors themselves (weight, bias, running_mean,
  /// running_var, num_batches_tracked; undefined where the options have none), so that an
  /// optimizer over the old module's parameters keeps training the new one.
  SyncBatchNormImpl(Backend& backend, const ::torch::nn::BatchNormOptions& options,
                    std::vector<at::Tensor> adopt);

  at::Tensor forward(const at::Tensor& input);
  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// The backend; InvalidArgument once it was destroyed.
  Backend& backend() const;

  ::torch::nn::BatchNormOptions options;
  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  void check_input_dim(const at::Tensor& input) const;
  BackendRef backend_;
  std::vector<at::Tensor> adopt_;  // consumed by the first reset()
};

extern template class SyncBatchNormImpl<1>;
extern template class SyncBatchNormImpl<2>;
extern template class SyncBatchNormImpl<3>;

using SyncBatchNorm1dImpl = SyncBatchNormImpl<1>;
using SyncBatchNorm2dImpl = SyncBatchNormImpl<2>;
using SyncBatchNorm3dImpl = SyncBatchNormImpl<3>;
// The module holders (TORCH_MODULE's, spelled out: inside this namespace `torch::` is ours).
#define LOCKSTEP_TORCH_SYNC_BN_HOLDER(Name)                                   \
  class Name : public ::torch::nn::ModuleHolder<Name##Impl> {                 \
   public:                                                                    \
    using ::torch::nn::ModuleHolder<Name##Impl>::ModuleHolder;                \
    using Impl = Name##Impl;                                                  \
  }
LOCKSTEP_TORCH_SYNC_BN_HOLDER(SyncBatchNorm1d);
LOCKSTEP_TORCH_SYNC_BN_HOLDER(SyncBatchNorm2d);
LOCKSTEP_TORCH_SYNC_BN_HOLDER(SyncBatchNorm3d);
#undef LOCKSTEP_TORCH_SYNC_BN_HOLDER

/// Collective: replaces every torch::nn::BatchNorm1d/2d/3d held by a container (Sequential,
/// ModuleList, ModuleDict) anywhere inside `module` with the SyncBatchNorm of the same options,
/// which takes over the old module's tensors themselves (weights and running statistics; an
/// optimizer built before still trains them). Returns how many were replaced (the same on every
/// rank when the models are).
///
/// A BatchNorm held by a module's own member (a torch::nn::BatchNorm2d field registered with
/// register_module) cannot be replaced: LibTorch calls the member's forward directly. Then
/// nothing is changed and every rank throws InvalidArgument naming it (declare
/// lt::SyncBatchNorm2d there instead); the ranks agree on the verdict (one allgather).
std::size_t convert_sync_batchnorm(Backend& backend, ::torch::nn::Module& module,
                                   std::source_location loc = std::source_location::current());

}  // namespace lockstep::torch
