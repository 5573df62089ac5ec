// Remote calls, internal: the messages on a session's communicator (tags, kinds, the fixed
// head of every header message). Never installed.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mpi/deadline.hpp"  // Clock

namespace lockstep::detail::remote {

constexpr int kTagReq = 1, kTagRep = 2, kTagCtrl = 3, kDataBase = 16;
constexpr std::uint32_t kMagic = 0x4C535243;  // "LSRC"
constexpr std::size_t kChunk = std::size_t{1} << 30;

// k_closing: the sender is closing the session and serves until every rank has closed it (the
// receiver sends it heartbeats meanwhile); k_left: the sender closed it without waiting for the
// calls still owed (after it took another rank for silent; its payload, [u32 n][i32 rank] x n,
// names the ranks it found silent, n = 0 when it left for another reason).
enum Kind : std::uint8_t { k_req = 1, k_rep_ok, k_rep_err, k_stop_ok, k_stop_err, k_heartbeat, k_closing, k_left };

constexpr bool is_reply(Kind k) { return k == k_rep_ok || k == k_rep_err; }

struct Head {
  std::uint32_t magic;
  std::uint8_t kind;
  std::uint8_t pad[3];
  std::uint64_t id;
  std::uint64_t run;
  std::uint64_t payload_len;
  std::uint32_t name_len;
  std::uint32_t nseg;
  std::uint64_t table_len;
};
constexpr std::size_t kHead = sizeof(Head);

/// The heartbeat message: static, so that a send of it still pending when its session ends
/// reads valid memory.
inline const Head& heartbeat_head() {
  static const Head h = [] {
    Head x{};
    x.magic = kMagic;
    x.kind = k_heartbeat;
    return x;
  }();
  return h;
}

}  // namespace lockstep::detail::remote
