// Remote calls: running a received call (decode, invoke, reply, or the error reply) and the
// background executor thread of RemoteOptions::background.
#include "remote/engine.hpp"

#include <algorithm>
#include <cstring>
#include <iostream>
#include "remote/registry.hpp"

#include "remote/polling.hpp"
#include "remote/test_hooks.hpp"

namespace lockstep::detail::remote {

thread_local int t_running_calls = 0;

void Engine::execute(Incoming& in) {
  Encoder out;
  Kind k = k_rep_ok;
  auto fail = [&](std::uint8_t code, const std::string& msg) {
    out = Encoder();
    out.u8(code);
    encode(out, msg);
    k = k_rep_err;
  };
  auto info = find_by_name(in.name);
  t_reply_tensor_delay = 0;
  if (!in.failed.empty()) {
    fail(5, in.failed);
  } else if (!info) {
    fail(2, concat("'", in.name, "' is not registered on rank ", rank,
                   " (that rank runs other code, or did not register it)"));
  } else if (info->sig != in.sig) {
    fail(3, concat("'", in.name, "' is registered on rank ", rank, " with another signature (",
                   info->sig, " there, ", in.sig, " at the caller)"));
  } else {
    try {
      Decoder d(in.buf.data() + in.poff, in.plen, &in.segs);
      struct Running {
        Running() { ++t_running_calls; }
        ~Running() { --t_running_calls; }
      } running;
      info->invoke(info->fn, d, out);
    } catch (const DecodeError& x) {
      fail(4, concat("the arguments do not decode on rank ", rank, ": ", x.what()));
    } catch (const std::exception& x) {
      fail(1, x.what());
    } catch (...) {
      fail(1, "an exception that is not a std::exception");
    }
  }
  in.segs.clear();  // what the function did not take is let go before the reply is sent
  const double delay = t_reply_tensor_delay;
  t_reply_tensor_delay = 0;
  bool posted = false;
  try {
    send({in.source}, kTagRep, k, in.id, 0, std::string(), out, deadline_or_none(timeout), timeout,
         concat("the reply to rank ", in.source), delay, &posted);
  } catch (const std::exception& x) {
    std::cerr << "lockstep remote: the reply to rank " << in.source << " was not sent: " << x.what() << "\n";
    if (!posted) {
      // The caller gets the reason instead of waiting for its deadline.
      Encoder err;
      err.u8(1);
      encode(err, concat("the reply could not be sent from rank ", rank, ": ", x.what()));
      try {
        send({in.source}, kTagRep, k_rep_err, in.id, 0, std::string(), err, deadline_or_none(timeout), timeout,
             concat("the error reply to rank ", in.source), 0, &posted);
      } catch (const std::exception&) {
      }
    }
  }
  if (in.kind == k_req) {
    // A reply posted is counted as answered where it is received; one that could not be
    // posted is counted here (no reply will come).
    if (!posted) reqs_done.fetch_add(1);
    if (in.source == 0) {
      std::lock_guard lk(mu);
      ++driver_reqs_done;
    }
  }
}

void Engine::executor_loop() {
  std::unique_lock lk(mu);
  executor_id = std::this_thread::get_id();  // read under mu (can_help)
  while (true) {
    cv.wait_for(lk, std::chrono::milliseconds(100), [&] { return closing || !queue.empty(); });
    if (closing) break;
    if (queue.empty()) continue;
    Incoming in = std::move(queue.front());
    queue.pop_front();
    lk.unlock();
    execute(in);
    lk.lock();
  }
}

}  // namespace lockstep::detail::remote
