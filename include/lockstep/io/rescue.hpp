// Rescue states: what a lost rank or host costs is one step, not a checkpoint interval.
//
// In data parallelism every rank holds a whole replica of the model and of its optimizer state.
// When a collective of a step fails (a peer lost, a deadline passed, an MPI error), each
// surviving rank still holds the state of the last completed step, provided the failed step
// changed nothing: DistributedOptimizer reduces all of a step's gradients before it applies
// the rule to any parameter (replicated and deterministic modes), so a step whose reduction
// failed is not applied at all. The survivors write that state, each to a directory of its own
// host (write_rescue_state: no communication, atomic, within a bound on the time), and the next
// run resumes from the freshest state that any of its ranks can read, rescue states and
// regular checkpoints alike (resume_freshest): the ranks agree on the newest verified one
// (step, content hash), the rank that holds it reads it and every rank gets it from there.
//
// A sharded optimizer state (ZeRO-1) is not whole on any rank. With
// DistributedOptions::rescue_buddy each rank also keeps a copy of another host's rank's shard
// (the buddy copy, taken at the end of every step): write_rescue_state then writes a shard
// rescue file (DIR/shard-SSSSSSSSS-rR.safetensors: this rank's shard and its buddy copy, of the
// last completed step), and resume_freshest first assembles a whole rescue state from the
// survivors' shard files when together they hold every shard. Without it, write_rescue_state
// writes nothing for a sharded state and says so (resume then finds the newest checkpoint).
//
//   try {
//     train_step(...);                         // update(state, model, grads), ...
//   } catch (const std::exception& e) {
//     if (ls::is_collective_failure(e))
//       ls::write_rescue_state(ls::rescue_directory("run/ck.rescue"), step, backend.rank(), state_ref, meta);
//     throw;
//   }
//   ...
//   auto found = ls::resume_freshest(backend, state_ref, ls::rescue_directory("run/ck.rescue"), {"run/ck.safetensors"});
#pragma once

#include <concepts>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/comm/consensus.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/core/traverse.hpp"
#include "lockstep/io/checkpoint.hpp"
#include "lockstep/train/buddy_copy.hpp"

namespace lockstep {

/// Metadata key of the step a checkpoint or rescue state holds (a decimal integer): what
/// resume_freshest orders states by. A checkpoint without it counts as older than any with it.
inline constexpr std::string_view kStepKey = "lockstep.step";
/// Metadata key set in a rescue state: "rank R of N on host H".
inline constexpr std::string_view kRescueKey = "lockstep.rescue";

/// Where this rank writes and looks for rescue states: LOCKSTEP_RESCUE_DIR when set (it may
/// differ between ranks), else `fallback` when not empty, else $TMPDIR/lockstep-rescue
/// (/tmp/lockstep-rescue without TMPDIR).
[[nodiscard]] std::filesystem::path rescue_directory(const std::filesystem::path& fallback = {});

/// True for the errors a collective throws when its peers fail: TimeoutError (a deadline
/// passed: a peer lost or silent), MpiError, MismatchError (which is also how a peer that left
/// shows). What a collective throws for bad arguments (InvalidArgument) is not.
[[nodiscard]] bool is_collective_failure(const std::exception& e) noexcept;

/// DIR/rescue-SSSSSSSSS-rR.safetensors: the rescue state of step S written by rank R.
[[nodiscard]] std::filesystem::path rescue_path(const std::filesystem::path& dir, std::int64_t step, int rank);
/// DIR/shard-SSSSSSSSS-rR.safetensors: the shard rescue file of step S written by rank R
/// (rescue_buddy): whole-state names and shapes, holding valid values only in two shards.
[[nodiscard]] std::filesystem::path shard_rescue_path(const std::filesystem::path& dir, std::int64_t step, int rank);

namespace detail {
/// Walks x for a sharded optimizer state (an object with sharded() and checkpoint phases).
/// With rescue_buddy, what write_rescue_state needs of it: the copy, the full-size view of the
/// slots (for their names) and where the rule's step count lives.
struct ShardedFinder {
  bool found = false;
  int count = 0;
  const BuddyCopy* copy = nullptr;
  std::function<void(bool)> view;
  std::function<std::vector<std::vector<const Tensor*>>()> fields;
  const void* step_address = nullptr;
  template <class L>
  void leaf(const std::string&, L&) {}
  template <class T>
  void object(T& o) {
    if constexpr (requires { { o.sharded() } -> std::convertible_to<bool>; }) {
      if (!o.sharded()) return;
      found = true;
      ++count;
      if constexpr (requires { o.buddy_copy(); o.rescue_view(true); o.rescue_fields(); o.rule_step_address(); }) {
        if (o.buddy_copy() != nullptr) {
          copy = o.buddy_copy();
          view = [&o](bool on) { o.rescue_view(on); };
          fields = [&o] { return o.rescue_fields(); };
          step_address = o.rule_step_address();
        }
      }
    }
  }
};
template <class X>
ShardedFinder find_sharded_state(const X& x) {
  ShardedFinder v;
  PathBuilder path;
  walk<false>(x, v, path);
  return v;
}
template <class X>
bool holds_sharded_state(const X& x) {
  return find_sharded_state(x).found;
}

/// The names a shard rescue file needs, in flat order: each trainable tensor's (`params`) and,
/// for each used field of the rule's slot, that field's tensor of each trainable tensor
/// (`fields[f][i]`), and the rule's step count (`step`).
struct ShardNames {
  std::vector<std::string> params;
  std::vector<std::vector<std::string>> fields;
  std::string step;
};
/// Makes ck (add_to_checkpoint of x with the full-size view) a shard rescue file: the trainable
/// tensors copied (not the live ones) and, with the slots, filled in the two shards of `copy`;
/// the step count set to the copy's; the layout in the metadata. Throws InvalidArgument when x
/// does not match the copy (names a reason).
void fill_shard_rescue(Checkpoint& ck, const BuddyCopy& copy, const ShardNames& names);
/// Collective, at the start of resume_freshest: when the shard rescue files of the newest step
/// that any rank has hold every shard together, the lowest rank holding one assembles the whole
/// state into rescue_path(dir, step, rank) (its own directory), where best_local_state finds it;
/// otherwise says why on rank 0 (resume then goes on from the other states). One allreduce
/// when no rank has a shard file.
void assemble_shard_rescue(Backend& backend, const std::filesystem::path& dir);
/// The step of a state file name "HEAD-SSSSSSSSS-rR.safetensors" (HEAD "rescue" or "shard"), or
/// -1 for another name.
std::int64_t step_of_state_file(const std::string& name, std::string_view head) noexcept;

/// Writes ck (already holding the step and rescue keys) to `path` atomically, giving up after
/// `seconds` (the write goes on in a thread that owns the bytes; the file appears only when it
/// is whole). Prints the one line that says where, or why not. Returns whether it was written.
bool write_rescue_file(const std::filesystem::path& path, int rank, const Checkpoint& ck, double seconds);
/// kRescueKey's value: "rank R on host H".
std::string rescue_origin(int rank);
/// One line on stderr: no rescue state written, and why.
void say_no_rescue(int rank, const std::string& why);

/// One candidate for resume_freshest: a file this rank read and verified.
struct StateCandidate {
  std::filesystem::path path;
  std::int64_t step = -1;  // -1: the file has no kStepKey
  std::uint32_t hash = 0;  // CRC-32C of its tensors (model_hash_of)
  bool rescue = false;
};
/// Reads and verifies this rank's candidates (the rescue states in `dir`, newest first, and
/// `checkpoints`) and returns the newest that verifies; `failed` counts those that did not
/// (each said in one line on stderr). Local: no communication.
std::optional<StateCandidate> best_local_state(const std::filesystem::path& dir,
                                               const std::vector<std::filesystem::path>& checkpoints,
                                               int& failed);
/// Collective: the ranks agree on the newest candidate any of them holds (the lowest rank among
/// those holding that step). Returns (holder, step, hash, rescue) on every rank, holder -1 when
/// none has one; a rank's candidates that failed to verify with none verified anywhere are a
/// CheckpointError on every rank (a restart must not silently start over).
struct AgreedState {
  int holder = -1;
  std::int64_t step = -1;
  std::uint32_t hash = 0;
  bool rescue = false;
  std::string path;  // the holder's path (the others cannot open it)
};
AgreedState agree_freshest(Backend& backend, const std::optional<StateCandidate>& mine, int failed);
}  // namespace detail

namespace detail {
/// write_rescue_state of a sharded state with rescue_buddy: x with the full-size view, filled
/// from the buddy copy, to shard_rescue_path(dir, step, rank).
template <class X>
std::optional<std::filesystem::path> write_shard_rescue(const std::filesystem::path& dir, std::int64_t step, int rank,
                                                        const X& x, ShardedFinder& found,
                                                        std::map<std::string, std::string> metadata, double seconds) {
  if (found.count > 1) {
    say_no_rescue(rank, "x holds more than one sharded optimizer state; pass the model and one optimizer state");
    return std::nullopt;
  }
  if (found.copy->rule_step < 0) {
    say_no_rescue(rank, "the optimizer state is sharded and no step has completed yet, so there is no buddy copy");
    return std::nullopt;
  }
  found.view(true);
  struct Off {
    ShardedFinder& f;
    ~Off() { f.view(false); }
  } off{found};
  Checkpoint ck;
  metadata[std::string(kStepKey)] = std::to_string(step);
  metadata[std::string(kRescueKey)] = rescue_origin(rank);
  ck.metadata = std::move(metadata);
  add_to_checkpoint(ck, x);
  // Names: the slot tensors by address; every other floating tensor is a trainable one.
  const auto fields = found.fields();
  std::map<const void*, std::pair<std::size_t, std::size_t>> slot_at;
  for (std::size_t f = 0; f < fields.size(); ++f)
    for (std::size_t i = 0; i < fields[f].size(); ++i) slot_at[fields[f][i]] = {f, i};
  ShardNames names;
  names.fields.assign(fields.size(), std::vector<std::string>(fields.empty() ? 0 : fields[0].size()));
  for_each_leaf_with_path(x, [&](const std::string& path, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    const void* at = &leaf;
    if (at == found.step_address) names.step = path;
    if constexpr (std::is_same_v<L, Tensor>) {
      const auto it = slot_at.find(at);
      if (it != slot_at.end()) names.fields[it->second.first][it->second.second] = path;
      else if (is_floating(leaf.dtype())) names.params.push_back(path);
    }
  });
  fill_shard_rescue(ck, *found.copy, names);
  const std::filesystem::path path = shard_rescue_path(dir, step, rank);
  if (!write_rescue_file(path, rank, ck, seconds)) return std::nullopt;
  return path;
}
}  // namespace detail

/// Writes x and `metadata` (plus kStepKey = step and kRescueKey) to rescue_path(dir, step, rank)
/// on this rank alone (no communication: the other ranks may be gone), atomically, within
/// `seconds` (a disk that hangs cannot hold the rank longer), creating `dir` if needed. Prints
/// one line on stderr: "lockstep: rescue state of step S written to PATH (...)", or why none
/// was. x must hold the state of the last completed step. A sharded optimizer state (ZeRO-1)
/// is not whole on this rank: with rescue_buddy, the file is shard_rescue_path(dir, step, rank)
/// and holds this rank's shard and its buddy copy (the state of the last step whose update and
/// copy completed: parameters and rule state of those shards, and the rule's step count); the
/// rest of x as it is. Without it, nothing is written, and the line says to resume from the
/// newest full checkpoint. Returns the path written, or nullopt. Never throws.
template <class X>
std::optional<std::filesystem::path> write_rescue_state(const std::filesystem::path& dir, std::int64_t step, int rank,
                                                        const X& x,
                                                        std::map<std::string, std::string> metadata = {},
                                                        double seconds = 30) noexcept {
  try {
    detail::ShardedFinder sharded = detail::find_sharded_state(x);
    if (sharded.found && sharded.copy == nullptr) {
      detail::say_no_rescue(rank,
                            "the optimizer state is sharded (ZeRO-1): this rank holds only its shard, so "
                            "a restart resumes from the newest full checkpoint (DistributedOptions::rescue_buddy "
                            "keeps each shard on two hosts)");
      return std::nullopt;
    }
    if (sharded.found) return detail::write_shard_rescue(dir, step, rank, x, sharded, std::move(metadata), seconds);
    Checkpoint ck;
    metadata[std::string(kStepKey)] = std::to_string(step);
    metadata[std::string(kRescueKey)] = detail::rescue_origin(rank);
    ck.metadata = std::move(metadata);
    add_to_checkpoint(ck, x);
    const std::filesystem::path path = rescue_path(dir, step, rank);
    if (!detail::write_rescue_file(path, rank, ck, seconds)) return std::nullopt;
    return path;
  } catch (...) {
    try {
      detail::say_no_rescue(rank, detail::current_error_message());
    } catch (...) {
    }
    return std::nullopt;
  }
}

/// What resume_freshest found and loaded.
struct FreshestState {
  int holder = -1;                            ///< the rank that read it
  std::int64_t step = -1;                     ///< its kStepKey (-1: none)
  std::string hash;                           ///< "crc32c:XXXXXXXX" of its tensors
  bool rescue = false;                        ///< a rescue state (else a regular checkpoint)
  std::filesystem::path path;                 ///< where the holder read it
  std::map<std::string, std::string> metadata;  ///< on every rank
};

/// Resume from the freshest state anywhere; a collective. Each rank reads and verifies (CRC)
/// its own candidates: every rescue state in `rescue_dir` (its host's directory: other hosts
/// need not see it) and the files in `checkpoints` (pass them on the ranks that may read them;
/// any rank may pass none). The ranks agree on the newest (by kStepKey), the lowest rank holding
/// it loads it into x with load_checkpoint(backend, path, x, holder) and every rank gets it from
/// there. Returns nullopt on every rank when no rank has any (a fresh start). A file that does
/// not verify is skipped with a line on stderr; when no rank has one that verifies but some
/// rank had one that did not, every rank throws CheckpointError. Holders of the newest step that
/// disagree on its content hash are reported on stderr by the lowest one (its copy is taken).
/// First, the shard rescue files (rescue_buddy) of the newest step any rank has in its
/// `rescue_dir` are assembled into a whole rescue state when together they hold every shard
/// (assemble_shard_rescue), which then takes part as any rescue state.
template <class X>
std::optional<FreshestState> resume_freshest(Backend& backend, X& x, const std::filesystem::path& rescue_dir,
                                             const std::vector<std::filesystem::path>& checkpoints) {
  // Shard rescue files (rescue_buddy) assembled into a whole rescue state first, where they can be.
  detail::assemble_shard_rescue(backend, rescue_dir);
  int failed = 0;
  std::optional<detail::StateCandidate> mine;
  try {
    mine = detail::best_local_state(rescue_dir, checkpoints, failed);
  } catch (...) {
    failed += 1;  // best_local_state reports each file; this is the directory itself
  }
  const detail::AgreedState agreed = detail::agree_freshest(backend, mine, failed);
  if (agreed.holder < 0) return std::nullopt;
  FreshestState out;
  out.holder = agreed.holder;
  out.step = agreed.step;
  out.rescue = agreed.rescue;
  out.path = agreed.path;
  char text[24];
  std::snprintf(text, sizeof text, "crc32c:%08x", static_cast<unsigned>(agreed.hash));
  out.hash = text;
  out.metadata = load_checkpoint(backend, out.path, x, agreed.holder);
  return out;
}

/// Removes this rank's view of stale rescue states: every rescue file (and shard rescue file)
/// in `dir` of a step at or below `step` (a checkpoint of `step` or later supersedes them). Local; never throws. Returns
/// how many were removed.
std::size_t prune_rescue_states(const std::filesystem::path& dir, std::int64_t step) noexcept;

}  // namespace lockstep
