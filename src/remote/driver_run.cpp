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

namespace {
enum ErrCode : std::uint8_t {
  e_invalid = 1, e_mismatch, e_timeout, e_remote, e_not_compiled, e_mpi, e_error, e_std, e_other
};
}

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
    e.last_heard[0] = Clock::now();
  }
  if (driver_) e.driving = true;
}

DriverRun::~DriverRun() {
  if (impl_) {
    impl_->e->driving = false;
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
           deadline_after(e.timeout), e.timeout, "run_driver (telling the workers that f returned)");
  impl_->close(false);
}

void DriverRun::finish_error(std::exception_ptr ep) {
  Engine& e = *impl_->e;
  e.driving = false;
  Encoder m;
  std::uint8_t code = e_other;
  std::string what = "the driver's function threw an exception that is not a std::exception";
  std::int32_t rrank = -1, mpi_code = 0;
  std::string rfn, rmsg;
  try {
    std::rethrow_exception(ep);
  } catch (const RemoteError& x) {
    code = e_remote, what = x.what(), rrank = x.rank(), rfn = x.function(), rmsg = x.message();
  } catch (const InvalidArgument& x) {
    code = e_invalid, what = x.what();
  } catch (const MismatchError& x) {
    code = e_mismatch, what = x.what();
  } catch (const TimeoutError& x) {
    code = e_timeout, what = x.what();
  } catch (const NotCompiled& x) {
    code = e_not_compiled, what = x.what();
  } catch (const MpiError& x) {
    code = e_mpi, what = x.what(), mpi_code = x.code();
  } catch (const Error& x) {
    code = e_error, what = x.what();
  } catch (const std::exception& x) {
    code = e_std, what = x.what();
  } catch (...) {
  }
  m.u8(code);
  encode(m, what);
  encode(m, rrank);
  encode(m, rfn);
  encode(m, rmsg);
  encode(m, mpi_code);
  try {
    if (e.size > 1 && !e.ended.load() && !std::exchange(impl_->stop_sent, true))
      e.send(others(e), kTagReq, k_stop_err, e.next_id.fetch_add(1), impl_->run, std::string(), m,
             deadline_after(e.timeout), e.timeout, "run_driver (telling the workers that f threw)");
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
    // The driver is not expected at the closing barrier: a short wait only.
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
    const auto code = d.u8();
    std::string what, rfn, rmsg;
    std::int32_t rrank = 0, mpi_code = 0;
    decode(d, what);
    decode(d, rrank);
    decode(d, rfn);
    decode(d, rmsg);
    decode(d, mpi_code);
    switch (code) {
      case e_invalid: throw InvalidArgument(what);
      case e_mismatch: throw MismatchError(what);
      case e_timeout: throw TimeoutError(what);
      case e_remote: throw RemoteError(rrank, rfn, rmsg);
      case e_not_compiled: throw NotCompiled(what);
      case e_mpi: throw MpiError(what, mpi_code);
      default: throw Error(what);
    }
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
