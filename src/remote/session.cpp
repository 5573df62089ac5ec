// Remote calls: creating a session (the duplicated communicator, the ranks' agreement on its
// settings and thread level, its threads), the table of sessions per backend, the sessions
// still open at finalize, and RemoteSession.
#include "remote/session.hpp"

#include <algorithm>
#include <cstring>
#include <iostream>
#include <map>
#include <thread>
#include <mutex>

#include "lockstep/mpi/mpi_backend.hpp"
#include "mpi/finalize_hooks.hpp"
#include "remote/engine.hpp"
#include "remote/polling.hpp"
#include "remote/test_hooks.hpp"

namespace lockstep::detail::remote {

namespace {
std::mutex g_mu;
std::map<const Backend*, std::shared_ptr<Engine>> g_engines;

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "an unknown thread level";
  }
}

/// finalize<MPIBackend>() with sessions still open (on the backend that goes, or on any backend
/// when MPI ends with it): each is left as a rank that took another for silent leaves it, that
/// is, the others are told (k_left: their calls to this rank, and a serving rank's wait for its
/// driver, end in a TimeoutError at once), the first closing round is waited for at most a
/// second, the progress and background threads stop, and this rank's calls still pending fail.
/// Before, the session's progress thread went on calling MPI through MPI_Finalize, heartbeats
/// kept the others from ever taking this rank for silent, and the process ended in
/// std::terminate (a joinable thread in the static table of sessions) and MPI_Abort.
void end_sessions_at_finalize(const Backend* going, bool mpi_ends) {
  std::vector<std::shared_ptr<Engine>> open;
  {
    std::lock_guard lk(g_mu);
    for (auto& [b, e] : g_engines)
      if (mpi_ends || b == going) open.push_back(e);
  }
  for (auto& e : open) {
    std::cerr << "lockstep remote: finalize with a remote session still open: this rank leaves it (the other ranks' "
                 "calls to it end in a TimeoutError)"
              << rank_suffix() << "\n";
    try {
      close_engine(e, /*quiet=*/true, e->timeout > 0 ? std::min(e->timeout, 1.0) : 1.0);
    } catch (const std::exception& x) {
      std::cerr << "lockstep remote: leaving the session at finalize: " << x.what() << "\n";
    }
  }
}
}  // namespace

std::shared_ptr<Engine> find_engine(const Backend& b) {
  std::lock_guard lk(g_mu);
  auto it = g_engines.find(&b);
  return it == g_engines.end() ? nullptr : it->second;
}

std::shared_ptr<Engine> engine_of(const Backend& b) {
  auto e = find_engine(b);
  LOCKSTEP_CHECK_ARG(e != nullptr,
                     "remote call without a remote session on this backend: call it inside "
                     "ls::run_driver (or ls::serve), or create an ls::RemoteSession");
  return e;
}

void forget_engine(const std::shared_ptr<Engine>& e) {
  std::lock_guard lk(g_mu);
  auto it = g_engines.find(e->backend);
  if (it != g_engines.end() && it->second == e) g_engines.erase(it);
}

std::shared_ptr<Engine> create_engine(Backend& b, const RemoteOptions& o) {
  lockstep::detail::at_finalize(&g_engines, end_sessions_at_finalize);
  int init = 0;
  MPI_Initialized(&init);
  if (!init) throw Error("remote calls need MPI: call lockstep::initialize<MPIBackend>() first");
  // The thread level is checked after the ranks have agreed on it (below), so that a rank whose
  // MPI was started with another level than the others' cannot leave them waiting: until the
  // progress thread starts, this thread alone calls MPI, which every level allows.
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  LOCKSTEP_CHECK_ARG(find_engine(b) == nullptr, "this backend already has a remote session");
  MPI_Comm base = MPI_COMM_WORLD;
  if (auto* m = dynamic_cast<MPIBackend*>(&b)) {
    base = m->comm();
  } else {
    int wr = 0, ws = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    MPI_Comm_size(MPI_COMM_WORLD, &ws);
    LOCKSTEP_CHECK_ARG(wr == b.rank() && ws == b.size(),
                       "remote calls over a backend that is not an MPIBackend need its ranks to be "
                       "those of MPI_COMM_WORLD");
  }
  auto e = std::make_shared<Engine>();
  e->backend = &b;
  e->opts = o;
  e->timeout = resolve_timeout(o.timeout);
  MPI_Request r;
  LOCKSTEP_MPI_CHECK(MPI_Comm_idup(base, &e->comm, &r));
  std::vector<MPI_Request> reqs{r};
  if (!wait_requests(reqs, deadline_or_none(e->timeout))) {
    keep_for_process(e);  // MPI may still write the new communicator into it
    throw TimeoutError(concat("RemoteSession: not every rank created the session within ", e->timeout, " s", rank_suffix()));
  }
  MPI_Comm_set_errhandler(e->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(e->comm, &e->rank);
  MPI_Comm_size(e->comm, &e->size);
  void* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(e->comm, MPI_TAG_UB, &ub, &flag);
  if (flag && ub != nullptr) e->tag_span = *static_cast<int*>(ub) - kDataBase;
  if (const int hook = test_hooks().tag_span.load(); hook > 0) e->tag_span = std::min(e->tag_span, std::max(hook, 2));
  const double dt_hook = test_hooks().data_timeout.load();
  e->data_timeout = dt_hook >= 0 ? dt_hook : e->timeout;
  // The settings must agree (and the data tags: every rank computes the tags of the others).
  struct Mine {
    double timeout;
    std::int32_t background;
    std::int32_t level;
    std::int32_t tag_span;
    std::int32_t pad;
    char host[64];  // MPI_Get_processor_name, cut to 63 bytes: for the errors that name a rank
  } mine{e->timeout, o.background ? 1 : 0, level, e->tag_span, 0, {}};
  {
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS)
      std::memcpy(mine.host, name, std::min<std::size_t>(static_cast<std::size_t>(std::max(len, 0)), sizeof mine.host - 1));
  }
  std::vector<std::byte> all;
  try {
    all = agree(e->comm, e->size, &mine, sizeof mine, e->timeout, "RemoteSession");
  } catch (...) {
    MPI_Comm_free(&e->comm);
    throw;
  }
  std::vector<Mine> ms(static_cast<std::size_t>(e->size));
  std::memcpy(ms.data(), all.data(), all.size());
  // Every rank needs MPI_THREAD_MULTIPLE: the progress thread receives while the rank's own
  // threads run (and, with background serving, while its own code is inside MPI). The same
  // error on every rank, naming the ranks that lack it.
  std::map<int, std::vector<int>> short_of;  // level -> ranks
  for (int i = 0; i < e->size; ++i)
    if (ms[i].level != MPI_THREAD_MULTIPLE) short_of[ms[i].level].push_back(i);
  if (!short_of.empty()) {
    std::string where;
    for (const auto& [lv, ranks] : short_of) {
      where += concat(where.empty() ? "" : ", ", thread_level_name(lv), " on rank", ranks.size() > 1 ? "s" : "");
      for (std::size_t i = 0; i < ranks.size() && i < 8; ++i) where += concat(i ? ", " : " ", ranks[i]);
      if (ranks.size() > 8) where += concat(", ... (", ranks.size(), " ranks)");
    }
    MPI_Comm_free(&e->comm);
    throw Error(concat(
        o.background ? "background serving (RemoteOptions::background: calls run on a thread of their own while this "
                       "rank's code, collectives included, goes on)"
                     : "remote calls (a RemoteSession, run_driver, serve)",
        o.background ? " needs" : " need", " MPI_THREAD_MULTIPLE on every rank, and MPI was started with ", where,
        ": no remote-call mode works without it (a session's progress thread calls MPI beside the rank's own "
        "threads). Let lockstep::initialize<MPIBackend>() start MPI, or start it with "
        "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)",
        rank_suffix()));
  }
  const Mine& first = ms[0];
  std::string diff;
  bool same = true;
  for (int i = 0; i < e->size; ++i) {
    const Mine& m = ms[static_cast<std::size_t>(i)];
    diff += concat(i ? ", " : "", "rank ", i, ": timeout ", m.timeout, " s, background ", m.background ? "on" : "off");
    if (m.tag_span != first.tag_span) diff += concat(", ", m.tag_span, " data tags");
    if (m.timeout != first.timeout || m.background != first.background || m.tag_span != first.tag_span) {
      same = false;
      diff += " (differs)";
    }
  }
  if (!same) {
    MPI_Comm_free(&e->comm);
    throw MismatchError(concat("RemoteSession: the ranks' options differ (", diff, ")"));
  }
  e->cache = std::make_shared<RecvCache>(o.receive_cache_bytes);
  e->last_heard.assign(static_cast<std::size_t>(e->size), Clock::now());
  e->closing_ranks.assign(static_cast<std::size_t>(e->size), 0);
  e->left_ranks.assign(static_cast<std::size_t>(e->size), 0);
  e->gone.assign(static_cast<std::size_t>(e->size), 0);
  e->hb_reqs.assign(static_cast<std::size_t>(e->size), MPI_REQUEST_NULL);
  e->watch_since.assign(static_cast<std::size_t>(e->size), Clock::time_point::max());
  e->said_silent.assign(static_cast<std::size_t>(e->size), -1);
  e->hosts.resize(static_cast<std::size_t>(e->size));
  for (int i = 0; i < e->size; ++i) {
    const Mine& m = ms[static_cast<std::size_t>(i)];
    e->hosts[static_cast<std::size_t>(i)] = std::string(m.host, strnlen(m.host, sizeof m.host));
  }
  // Found to the backend before its threads start: a call from a rank whose session was ready
  // first can reach this rank at once, and a remote function run by the executor that calls
  // again (a nested call) looks the session up by its backend. Registered after the threads, it
  // sometimes found none ("remote call without a remote session") and failed.
  {
    std::lock_guard lk(g_mu);
    g_engines[&b] = e;
  }
  try {
    e->progress = std::thread([p = e.get()] { p->progress_loop(); });
    if (o.background) e->executor = std::thread([p = e.get()] { p->executor_loop(); });
  } catch (...) {
    forget_engine(e);
    e->stop_progress = true;
    if (e->progress.joinable()) e->progress.join();
    keep_for_process(e);  // its communicator is left to MPI
    throw;
  }
  return e;
}

ReceiveCacheStats receive_cache_stats(const Backend& b) { return engine_of(b)->cache->stats(); }

std::vector<int> session_agree_failed(Backend& b, bool failed, const char* what) {
  auto e = engine_of(b);
  const std::int32_t mine = failed ? 1 : 0;
  Engine::Waiting w(*e);  // this thread takes the passes while it waits
  const auto all = agree(e->comm, e->size, &mine, sizeof mine, e->timeout, what, [&] { return e->try_pass() == 1; });
  std::vector<int> out;
  for (int i = 0; i < e->size; ++i) {
    std::int32_t f = 0;
    std::memcpy(&f, all.data() + sizeof f * static_cast<std::size_t>(i), sizeof f);
    if (f != 0) out.push_back(i);
  }
  return out;
}

}  // namespace lockstep::detail::remote

namespace lockstep {

RemoteSession::RemoteSession(Backend& b, RemoteOptions options) : backend_(&b) {
  detail::remote::create_engine(b, options);
}

RemoteSession::~RemoteSession() {
  try {
    if (backend_ != nullptr) {
      if (auto e = detail::remote::find_engine(*backend_)) detail::remote::close_engine(e, true);
    }
  } catch (...) {
  }
}

void RemoteSession::close() {
  if (backend_ == nullptr) return;
  auto e = detail::remote::find_engine(*backend_);
  backend_ = nullptr;
  if (e) detail::remote::close_engine(e, false);
}

}  // namespace lockstep
