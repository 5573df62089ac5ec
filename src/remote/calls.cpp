// Remote calls: starting a call (counted, then posted) and waiting for its result.
#include "remote/engine.hpp"
#include "remote/polling.hpp"
#include "remote/session.hpp"

namespace lockstep::detail::remote {

std::shared_ptr<Call> start_call(Backend& b, int rank, const FnInfo& fn, Encoder&& args, const CallOptions& opts) {
  auto e = engine_of(b);
  LOCKSTEP_CHECK_ARG(rank >= 0 && rank < e->size, "remote call of '", fn.name, "' to rank ", rank,
                     ", which is outside the world of ", e->size, " ranks");
  auto c = std::make_shared<Call>();
  c->e = e;
  c->id = e->next_id.fetch_add(1);
  c->rank = rank;
  c->fn = fn.name;
  c->timeout = opts.timeout < 0 ? e->timeout : opts.timeout;
  c->deadline = deadline_or_none(c->timeout);
  {
    std::lock_guard lk(e->mu);
    LOCKSTEP_CHECK_ARG(!e->closing && (!e->close_begun || t_running_calls > 0), "remote call of '", fn.name,
                       "' on a remote session that this rank is closing (only remote functions running during "
                       "the close may still make calls)");
    if (e->gone[static_cast<std::size_t>(rank)]) throw TimeoutError(e->left_text(rank, fn.name) + rank_suffix());
    e->pending[c->id] = c;
    // Counted before it is posted, under mu: a close that has begun counts every call it let
    // start (close_rounds).
    e->reqs_sent.fetch_add(1);
  }
  bool posted = false;
  try {
    e->send({rank}, kTagReq, k_req, c->id, 0, fn.name + std::string(1, '\0') + fn.sig, args, c->deadline,
            c->timeout, concat("remote call of '", fn.name, "'"), 0, &posted);
  } catch (...) {
    std::lock_guard lk(e->mu);
    e->pending.erase(c->id);
    if (!posted) e->reqs_done.fetch_add(1);  // never sent: nobody will answer it
    throw;
  }
  return c;
}

bool call_ready(Call& c) {
  std::lock_guard lk(c.e->mu);
  return c.done;
}

Decoder call_result(Call& c) {
  Engine& e = *c.e;
  {
    Engine::Waiting w(e);
    std::unique_lock lk(e.mu);
    auto active = Clock::now();
    while (!c.done) {
      if (Clock::now() >= c.deadline) {
        c.abandoned = true;  // the late reply is received and dropped
        throw TimeoutError(concat("remote call of '", c.fn, "' on ", e.rank_text(c.rank), " did not answer within ",
                                  c.timeout, " s", rank_suffix()));
      }
      e.wait_step(lk, active, c.deadline, e.can_help());
    }
  }
  if (c.failure == Call::f_remote) throw RemoteError(c.rank, c.fn, c.failed + rank_suffix());
  if (c.failure == Call::f_timeout) throw TimeoutError(c.failed + rank_suffix());
  if (c.failure != Call::f_none) throw Error(c.failed + rank_suffix());
  if (c.kind == k_rep_err) {
    Decoder d(c.buf.data() + c.poff, c.plen, nullptr);
    std::string msg;
    d.u8();
    decode(d, msg);
    throw RemoteError(c.rank, c.fn, msg);
  }
  return Decoder(c.buf.data() + c.poff, c.plen, &c.segs);
}

}  // namespace lockstep::detail::remote
