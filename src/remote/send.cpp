// Remote calls: posting one message, its header and then its tensors, to other ranks.
#include "remote/engine.hpp"

#include <algorithm>
#include <cstring>
#include <iostream>
#include <thread>

#include "remote/polling.hpp"
#include "remote/test_hooks.hpp"

namespace lockstep::detail::remote {

void Engine::send(const std::vector<int>& dests, int tag, Kind kind, std::uint64_t id, std::uint64_t run,
          const std::string& name, Encoder& m, Clock::time_point deadline, double seconds, const std::string& what,
          double tensor_delay, bool* header_posted, bool spare_silent) {
  auto& bytes = m.bytes();
  auto& tensors = m.tensors();
  Head h{};
  h.magic = kMagic;
  h.kind = kind;
  h.id = id;
  h.run = run;
  h.payload_len = bytes.size() - kHead;
  h.name_len = static_cast<std::uint32_t>(name.size());
  h.nseg = static_cast<std::uint32_t>(tensors.size());
  m.put(name.data(), name.size());
  const auto table_start = bytes.size();
  for (const auto& t : tensors) {
    m.u8(static_cast<std::uint8_t>(t.dtype()));
    m.u8(static_cast<std::uint8_t>(t.ndim()));
    for (auto d : t.shape()) m.u64(static_cast<std::uint64_t>(d));
  }
  h.table_len = bytes.size() - table_start;
  if (is_reply(kind) && tensors.empty() && test_hooks().malformed_replies.load() > 0 &&
      test_hooks().malformed_replies.fetch_sub(1) > 0)
    h.payload_len += 1;  // a test hook: lengths that do not add up
  std::memcpy(bytes.data(), &h, kHead);
  const std::size_t hook_max = test_hooks().max_message_bytes.load();
  const std::size_t max_bytes = hook_max > 0 ? hook_max : static_cast<std::size_t>(INT32_MAX);
  LOCKSTEP_CHECK_ARG(bytes.size() <= max_bytes, "remote call: the non-tensor part of a message is over ",
                     hook_max > 0 ? concat(max_bytes, " bytes (a test hook)") : std::string("2 GiB"),
                     " (send large arrays as Tensors)");
  const bool reply = is_reply(kind);
  std::vector<MPI_Request> reqs;
  std::vector<std::size_t> first_req;  // per destination: the index of its first request
  // One message's header and tensors are posted together, never interleaved with another
  // message's: a receiver posts its tensor receives in the order of the headers, so that when
  // the data tags have wrapped, two messages of the same tag still match in order.
  std::unique_lock post(send_mu);
  for (int dest : dests) {
    first_req.push_back(reqs.size());
    reqs.emplace_back();
    LOCKSTEP_MPI_CHECK(MPI_Isend(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, dest, tag, comm, &reqs.back()));
    if (header_posted != nullptr) *header_posted = true;
    if (tensor_delay > 0 && !tensors.empty())
      std::this_thread::sleep_for(std::chrono::duration<double>(tensor_delay));
    for (auto& t : tensors) {
      auto* p = static_cast<char*>(t.raw_data());
      for (std::size_t off = 0; off < t.nbytes(); off += kChunk) {
        const auto n = std::min(kChunk, t.nbytes() - off);
        reqs.emplace_back();
        LOCKSTEP_MPI_CHECK(MPI_Isend(p + off, static_cast<int>(n), MPI_BYTE, dest, data_tag(id, reply), comm, &reqs.back()));
      }
    }
  }
  first_req.push_back(reqs.size());
  post.unlock();
  // Once sent, the message's tensors are let go before this thread receives anything more:
  // a received tensor of the same size then reuses their buffer (a worker that echoes a
  // tensor keeps one buffer, where it would otherwise take a second for the next request,
  // which can arrive in the very pass that sees this send complete).
  bool released = false;
  const std::function<void()> before_receive = [&] {
    if (released || tensors.empty()) return;
    int flag = 0;
    MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE);
    if (flag) {
      tensors.clear();
      released = true;
    }
  };
  // With spare_silent: the ranks known silent that have not taken the message when every other
  // rank has (then the wait ends).
  std::vector<int> silent_left;
  const auto wait_sparing_silent = [&] {
    Waiting w(*this);
    auto active = Clock::now();
    while (true) {
      bool live_left = false;
      silent_left.clear();
      for (std::size_t d = 0; d < dests.size(); ++d) {
        int flag = 0;
        LOCKSTEP_MPI_CHECK(MPI_Testall(static_cast<int>(first_req[d + 1] - first_req[d]), reqs.data() + first_req[d],
                                       &flag, MPI_STATUSES_IGNORE));
        if (flag) continue;
        bool s = false;
        {
          std::lock_guard lk(mu);
          s = silent(dests[d]);
        }
        if (s) silent_left.push_back(dests[d]);
        else live_left = true;
      }
      if (!live_left) return silent_left.empty();
      if (Clock::now() >= deadline) {
        silent_left.clear();
        return false;
      }
      if (try_pass(&before_receive) == 1) active = Clock::now();
      else backoff(active);
    }
  };
  if (!(spare_silent ? wait_sparing_silent() : wait_polling(reqs, deadline, &before_receive))) {
    std::lock_guard lk(mu);
    orphans.push_back(Orphan{std::move(reqs), std::move(m), {}, false});
    if (!silent_left.empty()) {
      throw TimeoutError(concat(what, ": ", silent_text(silent_left), ", and did not take the message", rank_suffix()));
    }
    std::string who;
    if (dests.size() > 1) {
      who = "one of";
      for (std::size_t i = 0; i < dests.size() && i < 8; ++i) who += concat(i ? ", " : " ", rank_text(dests[i]));
      if (dests.size() > 8) who += ", ...";
    } else {
      who = rank_text(dests[0]);
    }
    throw TimeoutError(concat(what, ": ", who, " did not take the message within ", seconds, " s", rank_suffix()));
  }
}

}  // namespace lockstep::detail::remote
