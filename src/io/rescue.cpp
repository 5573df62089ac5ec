// Rescue states (rescue.hpp): the write a surviving rank makes on its own, bounded in time, and
// the agreement of the ranks on the freshest state any of them can read.
#include "lockstep/io/rescue.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <memory>
#include <system_error>
#include <thread>

#if LOCKSTEP_FAULT_INJECTION
#include "reliability/fault.hpp"
#endif

#include "core/env.hpp"
#include "lockstep/io/model_hash.hpp"

namespace lockstep {

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "unknown-host";
  return buf;
}


std::int64_t step_of_metadata(const std::map<std::string, std::string>& meta) {
  const auto it = meta.find(std::string(kStepKey));
  if (it == meta.end()) return -1;
  char* end = nullptr;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || v < 0) return -1;
  return v;
}

std::uint32_t content_hash(const Checkpoint& ck) {
  std::vector<std::pair<std::string, const Tensor*>> ts;
  ts.reserve(ck.tensors.size());
  for (const auto& [name, t] : ck.tensors) ts.emplace_back(name, &t);
  const std::string h = detail::model_hash_of(std::move(ts));  // "crc32c:XXXXXXXX"
  return static_cast<std::uint32_t>(std::strtoul(h.c_str() + 7, nullptr, 16));
}

}  // namespace

std::filesystem::path rescue_directory(const std::filesystem::path& fallback) {
  if (const auto dir = detail::env::get("LOCKSTEP_RESCUE_DIR")) return *dir;
  if (!fallback.empty()) return fallback;
  const char* tmp = std::getenv("TMPDIR");
  return std::filesystem::path(tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp") / "lockstep-rescue";
}

bool is_collective_failure(const std::exception& e) noexcept {
  return dynamic_cast<const TimeoutError*>(&e) != nullptr || dynamic_cast<const MpiError*>(&e) != nullptr ||
         dynamic_cast<const MismatchError*>(&e) != nullptr;
}

std::filesystem::path rescue_path(const std::filesystem::path& dir, std::int64_t step, int rank) {
  LOCKSTEP_CHECK_ARG(step >= 0, "rescue_path: step must be >= 0, got ", step);
  char name[64];
  std::snprintf(name, sizeof name, "rescue-%09lld-r%d.safetensors", static_cast<long long>(step), rank);
  return dir / name;
}

namespace detail {
std::int64_t step_of_state_file(const std::string& name, std::string_view head) noexcept {
  constexpr std::string_view tail = ".safetensors";
  if (!name.starts_with(head) || name.size() <= head.size() || name[head.size()] != '-' || !name.ends_with(tail))
    return -1;
  const std::size_t first = head.size() + 1;
  const std::size_t dash = name.find("-r", first);
  if (dash == std::string::npos || dash == first) return -1;
  std::int64_t step = 0;
  for (std::size_t i = first; i < dash; ++i) {
    const char c = name[i];
    if (c < '0' || c > '9' || step > (std::numeric_limits<std::int64_t>::max() - 9) / 10) return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}
}  // namespace detail

std::size_t prune_rescue_states(const std::filesystem::path& dir, std::int64_t step) noexcept {
  std::size_t removed = 0;
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    // Whole rescue states and shard rescue files alike.
    const std::string name = it->path().filename().string();
    std::int64_t s = detail::step_of_state_file(name, "rescue");
    if (s < 0) s = detail::step_of_state_file(name, "shard");
    if (s >= 0 && s <= step) stale.push_back(it->path());
  }
  for (const auto& p : stale)
    if (std::filesystem::remove(p, ec)) ++removed;
  return removed;
}

namespace detail {

std::string rescue_origin(int rank) { return "rank " + std::to_string(rank) + " on host " + host_name(); }

void say_no_rescue(int rank, const std::string& why) {
  std::fprintf(stderr, "lockstep: rank %d wrote no rescue state: %s\n", rank, why.c_str());
  std::fflush(stderr);
}

bool write_rescue_file(const std::filesystem::path& path, int rank, const Checkpoint& ck, double seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  // The bytes are made here (memory only) and handed to a thread that owns them: if the disk
  // hangs past the bound, the rank goes on (to end) and the thread keeps what it writes alive.
  // The file appears only when it is whole (write_file_atomically), so giving up leaves at
  // most a temporary file behind.
  auto bytes = std::make_shared<std::vector<std::byte>>(serialize_checkpoint(ck));
  auto done = std::make_shared<std::promise<std::string>>();
  std::future<std::string> result = done->get_future();
  double stall = 0;
#if LOCKSTEP_FAULT_INJECTION
  stall = fault_rescue_delay(rank);
  if (stall > 0)
    std::fprintf(stderr, "lockstep: injecting fault kind=rescue_delay on rank %d: its rescue write waits %g s\n", rank,
                 stall);
#endif
  std::thread([bytes, done, path, stall] {
    try {
      std::error_code ec;
      std::filesystem::create_directories(path.parent_path(), ec);
      if (stall > 0) std::this_thread::sleep_for(std::chrono::duration<double>(stall));
      write_file_atomically(path, *bytes);
      done->set_value("");
    } catch (...) {
      done->set_value(current_error_message());
    }
  }).detach();
  const auto bound = std::chrono::duration<double>(seconds > 0 ? seconds : 0);
  if (result.wait_for(bound) != std::future_status::ready) {
    char limit[32];
    std::snprintf(limit, sizeof limit, "%g", seconds);
    say_no_rescue(rank, "writing " + path.string() + " did not end within " + limit +
                            " s (given up; the file appears only if it is ever complete)");
    return false;
  }
  const std::string err = result.get();
  if (!err.empty()) {
    say_no_rescue(rank, err);
    return false;
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto step = ck.metadata.find(std::string(kStepKey));
  std::fprintf(stderr, "lockstep: rescue state of step %s written to %s (rank %d, host %s, %zu bytes, %.3f s)\n",
               step == ck.metadata.end() ? "?" : step->second.c_str(), path.c_str(), rank, host_name().c_str(),
               bytes->size(), dt);
  std::fflush(stderr);
  return true;
}

std::optional<StateCandidate> best_local_state(const std::filesystem::path& dir,
                                               const std::vector<std::filesystem::path>& checkpoints,
                                               int& failed) {
  // Rescue states newest first (by the step in the name; the file's own step is what counts).
  std::vector<std::pair<std::int64_t, std::filesystem::path>> rescues;
  std::error_code ec;
  if (!dir.empty())
    for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::int64_t s = detail::step_of_state_file(it->path().filename().string(), "rescue");
      if (s >= 0) rescues.emplace_back(s, it->path());
    }
  std::sort(rescues.begin(), rescues.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  auto verify = [&](const std::filesystem::path& p, bool rescue) -> std::optional<StateCandidate> {
    try {
      const Checkpoint ck = load_checkpoint(p);
      return StateCandidate{p, step_of_metadata(ck.metadata), content_hash(ck), rescue};
    } catch (...) {
      ++failed;
      std::fprintf(stderr, "lockstep: skipping %s, which does not verify: %s\n", p.c_str(),
                   current_error_message().c_str());
      return std::nullopt;
    }
  };
  std::optional<StateCandidate> best;
  auto consider = [&](std::optional<StateCandidate> c) {
    if (c && (!best || c->step > best->step)) best = std::move(c);
  };
  for (const auto& [s, p] : rescues) {
    auto c = verify(p, true);
    if (c) {
      consider(std::move(c));
      break;  // the newest rescue state that verifies
    }
  }
  for (const auto& p : checkpoints) {
    if (p.empty() || !std::filesystem::exists(p, ec)) continue;
    consider(verify(p, false));
  }
  return best;
}

AgreedState agree_freshest(Backend& backend, const std::optional<StateCandidate>& mine, int failed) {
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::min() / 4;
  // Round 1: the newest step anywhere (-1 for a file without one, kNone for no file), and
  // whether any rank had a file that did not verify.
  std::int64_t a[2] = {mine ? mine->step : kNone, failed > 0 ? 1 : 0};
  backend.allreduce(TensorView{a, 2, DType::i64, Device::cpu()}, ReduceOp::max);
  AgreedState out;
  if (a[0] == kNone) {
    if (a[1] != 0)
      throw CheckpointError(
          "resume: no rank has a checkpoint or rescue state that verifies, but some rank found one that does "
          "not (see the lines above on stderr); not starting afresh over it: remove it to start afresh");
    return out;
  }
  // Round 2: among the holders of that step, the lowest rank, and their content hashes.
  const bool holds = mine && mine->step == a[0];
  std::int64_t b[3] = {holds ? -static_cast<std::int64_t>(backend.rank()) : kNone,
                       holds ? static_cast<std::int64_t>(mine->hash) : -1,
                       holds ? -static_cast<std::int64_t>(mine->hash) : kNone};
  backend.allreduce(TensorView{b, 3, DType::i64, Device::cpu()}, ReduceOp::max);
  out.holder = static_cast<int>(-b[0]);
  out.step = a[0];
  const bool i_hold = out.holder == backend.rank();
  // The holder's own hash and kind travel with its path.
  std::string msg;
  if (i_hold) {
    char head[40];
    std::snprintf(head, sizeof head, "%08x %d ", static_cast<unsigned>(mine->hash), mine->rescue ? 1 : 0);
    msg = head + mine->path.string();
  }
  msg = broadcast_string(backend, msg, out.holder);
  out.hash = static_cast<std::uint32_t>(std::strtoul(msg.substr(0, 8).c_str(), nullptr, 16));
  out.rescue = msg.size() > 9 && msg[9] == '1';
  out.path = msg.size() > 11 ? msg.substr(11) : std::string();
  if (i_hold && b[1] != -b[2])
    std::fprintf(stderr,
                 "lockstep: the ranks holding step %lld disagree on its content (hashes from crc32c:%08llx to "
                 "crc32c:%08llx); taking rank %d's copy (%s)\n",
                 static_cast<long long>(out.step), static_cast<unsigned long long>(-b[2]),
                 static_cast<unsigned long long>(b[1]), out.holder, out.path.c_str());
  return out;
}

}  // namespace detail

}  // namespace lockstep
