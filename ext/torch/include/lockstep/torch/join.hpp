// lockstep::torch::Join: uneven inputs, DDP's join(). See docs/torch.md, "Uneven inputs: Join".
#pragma once

#include <cstdint>
#include <source_location>

#include "lockstep/comm/backend.hpp"

namespace lockstep::torch {

/// Ranks whose data runs out before the others' keep taking part in every step with an empty
/// batch (0 rows), until no rank has a batch left, so that no rank waits forever in a collective
/// of a step the others do not take:
///
///   lt::Join join(backend);
///   for (std::int64_t i = 0; join.next(i < my_batches); ++i) {
///     auto [x, y] = i < my_batches ? my_batch(i) : empty_batch();   // 0 rows once joined
///     opt.zero_grad();
///     loss(net->forward(x), y).backward();   // a joined rank's gradients are 0
///     opt.step();
///   }
///
/// A joined rank runs the step's forward, backward and step() on 0 rows: its gradients are 0
/// (use a loss whose gradient on 0 rows is 0: mean and sum reductions are), its SyncBatchNorms
/// contribute a count of 0, and DistributedOptimizer's collectives match the other ranks'.
/// The average divides by the initial world size, as DDP's join with
/// divide_by_initial_world_size=True (its default): a joined rank counts as a zero gradient.
/// For the mean over the ranks that had a batch (divide_by_initial_world_size=False), scale the
/// loss by size() / active_ranks(). next() costs one allreduce of two int32 per step.
///
/// A rank that ran out of data stays out until the loop ends: a rank that passes true again
/// after a step it passed false for (a data loader restarted by mistake) is refused, with the
/// same InvalidArgument on every rank naming it and both steps (an allgather more, then). Once
/// next() returned false (no rank had a batch) the loop is over, and the next call starts a new
/// one in which every rank may have batches again.
class Join {
 public:
  explicit Join(Backend& backend) : backend_(&backend) {}

  /// Collective, once before every step on every rank: `has_batch` is whether this rank has a
  /// batch for it. Returns false on every rank once no rank has one (the loop ends everywhere).
  /// InvalidArgument on every rank when a rank has a batch again after a step without one.
  bool next(bool has_batch, std::source_location loc = std::source_location::current());
  /// Ranks that had a batch at the last next() (the same on every rank).
  int active_ranks() const noexcept { return active_; }
  /// Steps started by next() (the same on every rank), and those this rank took without a batch.
  std::int64_t steps() const noexcept { return steps_; }
  std::int64_t joined_steps() const noexcept { return joined_steps_; }

 private:
  Backend* backend_;
  int active_ = 0;
  std::int64_t steps_ = 0, joined_steps_ = 0;
  std::int64_t joined_at_ = -1;  // the step of this loop this rank first had no batch for; -1: none
};

}  // namespace lockstep::torch
