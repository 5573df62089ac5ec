// Buddy copies of a sharded optimizer state (DistributedOptions::rescue_buddy): each rank keeps,
// besides its own shard, a copy of another rank's shard taken at the end of the last completed
// step, on a rank of another host, so that the survivors of one lost host hold every shard.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/train/gradient_reducer.hpp"

namespace lockstep::detail {

/// Who holds whose copy: this rank sends its shard to `holder` and keeps the shard of `source`.
struct BuddyPlan {
  int holder = -1;
  int source = -1;
  bool one_host = false;  ///< every rank on one host: the copy survives a lost rank only
  std::string host;       ///< this rank's host, as the plan saw it
};

/// Collective: the host map (each rank's host name; with LOCKSTEP_TEST_HOST_SIZE=k, a test
/// setting of fault-injection builds, ranks [0,k), [k,2k), ... count as separate hosts, as
/// MPIBackend counts them), then the plan. Ranks ordered by host (hosts in order of their lowest
/// rank), each rank's holder is the rank m places further on, m the most ranks any host has:
/// another host whenever no host has more than half of the ranks. A host with more is an
/// InvalidArgument on every rank (the same host map everywhere); one host: the next rank.
BuddyPlan plan_buddies(Backend& backend);

/// The state of the last completed step for two shards: this rank's (owner[0]) and its
/// source's (owner[1]). Each blob packs the shard's parameters (its ranges of the flat space,
/// in order), then each used field of the rule's slot over the same ranges.
struct BuddyCopy {
  int world = 0;
  std::int64_t rule_step = -1;  ///< the rule's step count at the copy; -1: no step completed yet
  int owner[2] = {-1, -1};
  std::vector<FlatRange> ranges[2];
  Tensor blob[2];                       ///< the packed bytes (i32 words; the tail past the shard unused)
  std::vector<std::int64_t> leaf_numel;  ///< every trainable tensor's, in flat order
  std::size_t param_bytes = 0;          ///< bytes per element of the parameters
  std::vector<std::size_t> field_bytes;  ///< bytes per element of each used field
  Tensor send, recv, all;                ///< the exchange's buffers, kept between steps
};

/// Collective, at the end of a step: packs this rank's shard (`params`: every trainable tensor,
/// full size; `fields[f]`: this rank's pieces of used field f) and exchanges it (one allgather of
/// one block, the largest shard), so that `copy` holds this rank's and its source's shard of
/// this step. The blobs are written only once the exchange succeeded: a failed one leaves the
/// copy of the previous step whole (the blobs and rule_step are of one step).
void take_buddy_copy(GradientReducer& red, const BuddyPlan& plan, const std::vector<Tensor*>& params,
                     const std::vector<std::vector<Tensor*>>& fields, const std::vector<std::size_t>& field_bytes,
                     std::int64_t rule_step, BuddyCopy& copy);

}  // namespace lockstep::detail
