// Remote calls: run_driver and serve (DriverRun): the ranks' agreement to start a run, the
// driver's end of it (its result, or its exception's kind and message), and the serving ranks'
// loop until it comes (or the driver falls silent or leaves).
#include <cstring>
#include <iostream>
#include <utility>

#include "remote/engine.hpp"
#include "remote/polling.hpp"
#include "remote/session.hpp"

namespace lockstep::detail::remote {

struct DriverRun::Impl {
  std::shared_ptr<Engine> e;
  bool own = false, closed = false;
  bool stop_sent = false;  // the workers were told f's outcome (finish_error does not tell again)
  std::uint64_t run = 0;
  Incoming stop;

  void close(bool quiet, double wait = -1) {
    if (own && !closed) {
      closed = true;
      close_engine(e, quiet, wait);
    }
  }
};

DriverRun::DriverRun(Backend& b, bool serve_only, const std::string& result_sig) : impl_(std::make_unique<Impl>()) {
  impl_->e = find_engine(b);
  if (!impl_->e) {
    impl_->e = create_engine(b, RemoteOptions{});
    impl_->own = true;
  }
  Engine& e = *impl_->e;
  impl_->run = ++e.run_counter;
  struct Mine {
    std::uint64_t run;
    std::uint64_t sig;
    std::int32_t role;  // 1 run_driver, 2 serve
    std::int32_t pad;
  } mine{impl_->run, serve_only ? 0 : lockstep::detail::hash_bytes(result_sig.data(), result_sig.size()),
         serve_only ? 2 : 1, 0};
  std::vector<std::byte> all;
  try {
    all = agree(e.comm, e.size, &mine, sizeof mine, e.timeout, "run_driver");
  } catch (...) {
    impl_->close(true);
    throw;
  }
  std::vector<Mine> ms(e.size);
  std::memcpy(ms.data(), all.data(), all.size());
  std::string problem;
  if (ms[0].role != 1) problem = "rank 0 (the driver) called serve, not run_driver";
  for (int i = 1; i < e.size && problem.empty(); ++i) {
    if (ms[i].run != ms[0].run) problem = concat("rank ", i, " is in its run ", ms[i].run, " of run_driver, rank 0 in its run ", ms[0].run);
    else if (ms[i].role == 1 && ms[i].sig != ms[0].sig) problem = concat("rank ", i, " expects another result type of f than rank 0");
  }
  if (!problem.empty()) {
    impl_->close(true);
    throw MismatchError(concat("run_driver: ", problem));
  }
  driver_ = e.rank == 0;
  {
    std::lock_guard lk(e.mu);
    const auto now = Clock::now();
    e.last_heard[0] = now;
    // The driver watches the serving ranks from now on (they send it heartbeats while they
    // serve): when the run ends, a rank it has heard nothing from for the session's timeout is
    // not waited for again (the end of the run, the close).
    if (driver_)
      for (int r = 1; r < e.size; ++r) e.watch_since[static_cast<std::size_t>(r)] = now;
  }
  if (driver_) e.driving = true;
  else e.hb_driver = true;
}

DriverRun::~DriverRun() {
  if (impl_) {
    impl_->e->driving = false;
    impl_->e->hb_driver = false;
    if (!impl_->own) {
      // A session that goes on (an explicit RemoteSession): nobody is watched between runs.
      std::lock_guard lk(impl_->e->mu);
      for (auto& w : impl_->e->watch_since) w = Clock::time_point::max();
    }
    try {
      impl_->close(true);
    } catch (...) {
    }
  }
}

namespace {
std::vector<int> others(const Engine& e) {
  std::vector<int> v;
  for (int r = 1; r < e.size; ++r) v.push_back(r);
  return v;
}
}  // namespace

void DriverRun::finish_ok(Encoder&& result) {
  Engine& e = *impl_->e;
  e.driving = false;
  Encoder m = std::move(result);
  // The session was ended under the driver's function (it called finalize): the workers were
  // told that this rank left, and nothing can be sent on the session any more.
  if (e.ended.load())
    throw Error(concat("run_driver: the remote session was ended (finalize was called) while the driver's function "
                       "ran; the workers were told that the driver left",
                       rank_suffix()));
  impl_->stop_sent = true;
  if (e.size > 1)
    e.send(others(e), kTagReq, k_stop_ok, e.next_id.fetch_add(1), impl_->run, std::string(), m,
           deadline_or_none(e.timeout), e.timeout, "run_driver (telling the workers that f returned)", 0, nullptr,
           /*spare_silent=*/true);
  impl_->close(false);
}

void DriverRun::finish_error(std::exception_ptr ep) {
  Engine& e = *impl_->e;
  e.driving = false;
  // f's exception, as every rank is to throw it (ErrorRecord, core/errors.hpp).
  ErrorRecord r = error_record(ep);
  if (r.kind == ErrorKind::unknown) r.what = "the driver's function threw an exception that is not a std::exception";
  Encoder m;
  m.u8(static_cast<std::uint8_t>(r.kind));
  encode(m, r.what);
  encode(m, static_cast<std::int32_t>(r.rank));
  encode(m, r.function);
  encode(m, r.message);
  encode(m, static_cast<std::int32_t>(r.code));
  try {
    if (e.size > 1 && !e.ended.load() && !std::exchange(impl_->stop_sent, true))
      e.send(others(e), kTagReq, k_stop_err, e.next_id.fetch_add(1), impl_->run, std::string(), m,
             deadline_or_none(e.timeout), e.timeout, "run_driver (telling the workers that f threw)", 0, nullptr,
             /*spare_silent=*/true);
  } catch (const std::exception& x) {
    std::cerr << "lockstep remote: " << x.what() << "\n";
  }
  impl_->close(true);
}

Decoder DriverRun::serve_until_done() {
  Engine& e = *impl_->e;
  bool idle_timeout = false, driver_gone = false;
  {
    Engine::Waiting w(e);
    std::unique_lock lk(e.mu);
    auto active = Clock::now();
    while (true) {
      // The end of the run comes on the request tag, after every request the driver sent
      // before it (MPI keeps one sender's messages of one tag in order, and requests and ends of
      // runs are delivered in order per rank): those still queued or running here run first.
      if (auto it = e.stops.find(impl_->run); it != e.stops.end() && e.driver_reqs_done == e.driver_reqs_queued) {
        impl_->stop = std::move(it->second);
        e.stops.erase(it);
        break;
      }
      // Silent: nothing from the driver in a pass of the progress thread that began the
      // timeout after its last message (not merely the timeout by the clock: a rank that was
      // stopped itself, and has just resumed, has the driver's heartbeats still to read).
      const Clock::time_point looked = e.ctrl_looks.through();
      // (Not once the driver's end of run is here: it was alive then, and what is left, the
      // calls it sent before, is this rank's own work; the close after has its own bound.)
      if (e.timeout > 0 && e.stops.find(impl_->run) == e.stops.end() && looked >= e.last_heard[0] + after_seconds(e.timeout)) {
        idle_timeout = true;
        break;
      }
      // The driver left the session (it finalised with it open): nothing more comes from it.
      if (e.driver_left.load() && e.stops.find(impl_->run) == e.stops.end()) {
        driver_gone = true;
        break;
      }
      e.wait_step(lk, active, Clock::now() + std::chrono::milliseconds(50), true);
    }
  }
  if (driver_gone) {
    impl_->close(true, std::min(e.timeout > 0 ? e.timeout : 1.0, 1.0));
    throw TimeoutError(concat("rank ", e.rank, ": the driver, ", e.rank_text(0), ", left the remote session (it finalised Lockstep, "
                              "or returned from main, with the session open) while this rank served in run_driver",
                              rank_suffix()));
  }
  if (idle_timeout) {
    // The driver is not expected at the closing barrier: a short wait only, none when this run
    // closes the session (the driver is taken for silent: the rank leaves at once, and tells the
    // others, which then wait for it no more either).
    if (impl_->own) {
      std::lock_guard lk(e.mu);
      if (e.said_silent[0] < 0) e.said_silent[0] = e.rank;
    }
    impl_->close(true, std::min(e.timeout, 1.0));
    throw TimeoutError(concat("rank ", e.rank, " heard nothing from the driver, ", e.rank_text(0), ", for ", e.timeout,
                              " s while serving in run_driver", rank_suffix()));
  }
  impl_->close(false);
  auto& s = impl_->stop;
  if (!s.failed.empty()) {
    const std::string what = concat("run_driver on rank ", e.rank, ": ", s.failed, rank_suffix());
    if (s.fail_kind == Call::f_timeout) throw TimeoutError(what);
    throw Error(what);
  }
  if (s.kind == k_stop_err) {
    Decoder d(s.buf.data() + s.poff, s.plen, nullptr);
    ErrorRecord r;
    r.kind = static_cast<ErrorKind>(d.u8());
    std::int32_t rank = 0, code = 0;
    decode(d, r.what);
    decode(d, rank);
    decode(d, r.function);
    decode(d, r.message);
    decode(d, code);
    r.rank = rank;
    r.code = code;
    throw_error(r);
  }
  return Decoder(s.buf.data() + s.poff, s.plen, &s.segs);
}

}  // namespace lockstep::detail::remote

namespace lockstep {

void serve(Backend& b) {
  detail::remote::DriverRun run(b, true, std::string());
  (void)run.serve_until_done();
}

}  // namespace lockstep
