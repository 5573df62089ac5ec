// Remote calls: handing a received message to whoever waits for it (a reply to its call, a
// request to the queue, the end of a run to the serving ranks), or failing it there.
#include "remote/engine.hpp"

#include <algorithm>
#include <cstring>
#include <iostream>

#include "comm/rank_list.hpp"
#include "remote/polling.hpp"
#include "remote/test_hooks.hpp"

namespace lockstep::detail::remote {

void Engine::fail_incoming(Incoming&& in, Call::Failure kind, const std::string& why, bool malformed) {
  in.segs.clear();
  if (is_reply(in.kind)) {
    reqs_done.fetch_add(1);  // answered, though its tensors could not be received
    auto it = pending.find(in.id);
    if (it == pending.end()) return;
    auto c = it->second;
    pending.erase(it);
    if (c->abandoned) return;
    c->failure = malformed ? Call::f_remote : kind;
    c->failed = malformed ? concat("its reply arrived malformed on rank ", rank, " and was dropped (", why, ")")
                          : concat("remote call of '", c->fn, "' on rank ", c->rank, ": the reply's tensors ", why);
    c->done = true;
  } else if (in.kind == k_req) {
    in.failed = malformed ? concat("the call arrived malformed on rank ", rank, " and was dropped (", why, ")")
                          : "the call's tensors " + why;
    enqueue(std::move(in));
  } else if (in.kind == k_stop_ok || in.kind == k_stop_err) {
    in.failed = malformed ? concat("the driver's end of run arrived malformed on rank ", rank, " (", why, ")")
                          : "the tensors of the driver's result " + why;
    in.fail_kind = kind;
    stops[in.run] = std::move(in);
  }
  cv.notify_all();
}

void Engine::fail_or_park(Incoming&& in, Call::Failure kind, const std::string& why, bool malformed) {
  if (!may_deliver(in.source, in.kind)) {
    Arrival a;
    a.in = std::move(in);
    a.failed = why;
    a.fail_kind = kind;
    a.malformed = malformed;
    a.deadline = Clock::time_point::max();
    arriving.push_back(std::move(a));
    return;
  }
  std::lock_guard lk(mu);
  fail_incoming(std::move(in), kind, why, malformed);
}

void Engine::on_rank_left(int r) {
  {
    std::lock_guard lk(mu);
    gone[static_cast<std::size_t>(r)] = 1;
    for (auto it = pending.begin(); it != pending.end();) {
      auto c = it->second;
      if (c->rank != r) {
        ++it;
        continue;
      }
      it = pending.erase(it);  // a late reply is dropped (deliver finds no call)
      if (c->abandoned) continue;
      c->failure = Call::f_timeout;
      c->failed = left_text(r, c->fn);
      c->done = true;
    }
  }
  if (r == 0 && rank != 0) driver_left = true;
  cv.notify_all();
}

std::string Engine::rank_text(int r) const {
  const auto i = static_cast<std::size_t>(r);
  if (r < 0 || i >= hosts.size() || hosts[i].empty()) return concat("rank ", r);
  return ranks_with_hosts({r}, hosts);
}

bool Engine::silent(int r) const {
  if (r == rank || r < 0 || r >= size) return false;
  const auto i = static_cast<std::size_t>(r);
  if (said_silent[i] >= 0) return true;
  if (timeout <= 0 || watch_since[i] == Clock::time_point::max()) return false;
  return ctrl_looks.through() >= std::max(last_heard[i], watch_since[i]) + after_seconds(timeout);
}

std::vector<int> Engine::silent_ranks() const {
  std::vector<int> out;
  for (int r = 0; r < size; ++r)
    if (silent(r)) out.push_back(r);
  return out;
}

std::string Engine::silent_text(const std::vector<int>& rs) const {
  bool named = !rs.empty();
  for (int r : rs) named = named && r >= 0 && r < size && !hosts[static_cast<std::size_t>(r)].empty();
  std::string s = concat(named ? ranks_with_hosts(rs, hosts) : rank_list(rs), " sent nothing for ", timeout, " s");
  std::vector<int> by;  // the other ranks whose notices of leaving named them
  for (int r : rs) {
    const int b = r >= 0 && r < size ? said_silent[static_cast<std::size_t>(r)] : -1;
    if (b >= 0 && b != rank && std::find(by.begin(), by.end(), b) == by.end()) by.push_back(b);
  }
  if (!by.empty()) s += concat(" (found so by ", rank_list(by), ", which then left the remote session)");
  return s;
}

std::string Engine::left_text(int r, const std::string& fn) const {
  return concat("remote call of '", fn, "' on rank ", r, ": ", rank_text(r),
                " left the remote session before answering (it finalised Lockstep, or returned from main, with the "
                "session open, or closed it without waiting)");
}

void Engine::enqueue(Incoming&& in) {
  if (in.source == 0) ++driver_reqs_queued;
  queue.push_back(std::move(in));
}

void Engine::deliver(Incoming&& in) {
  if (in.kind == k_req) {
    enqueue(std::move(in));
  } else if (is_reply(in.kind)) {
    reqs_done.fetch_add(1);  // its call is answered (close_rounds)
    auto it = pending.find(in.id);
    if (it == pending.end()) return;  // not ours (cannot happen) or already closed
    auto c = it->second;
    pending.erase(it);
    if (c->abandoned) return;  // timed out or dropped: discard
    c->kind = in.kind;
    c->buf = std::move(in.buf);
    c->poff = kHead;
    c->plen = in.plen;
    c->segs = std::move(in.segs);
    c->done = true;
  } else if (in.kind == k_stop_ok || in.kind == k_stop_err) {
    stops[in.run] = std::move(in);
  }
  cv.notify_all();
}

}  // namespace lockstep::detail::remote
