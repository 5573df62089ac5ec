// The monitor of a communicator (monitor.hpp): collective fingerprints, stall timeouts with
// blame, over MPI. The settings it reads are the reliability layer's
// (src/reliability/settings.cpp). In a build with LOCKSTEP_FAULT_INJECTION (the tests' builds) it
// also injects the faults of LOCKSTEP_FAULT (src/reliability/fault.cpp); without it, the code
// between `#if LOCKSTEP_FAULT_INJECTION` and `#endif` below does not exist, and the fast path has
// no fault check at all.
// The design in short:
// - each monitored communicator gets two duplicates: `check_` for the fingerprint exchange (so a
//   fingerprint can never be matched against a data collective) and `ctrl_` for status queries;
// - a watchdog thread per communicator answers status queries and receives stall notices; it
//   polls with MPI_Iprobe every few milliseconds rather than blocking in MPI_Recv, because a
//   blocked receive spins a core in Open MPI;
// - with a deadline, blocking collectives run as their nonblocking form polled with MPI_Test, so
//   that a stalled rank can give up and throw instead of waiting forever.
#include "mpi/monitor_impl.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <filesystem>

namespace lockstep {
namespace detail {
namespace {

// Sends a blame report to lockstep-run at LOCKSTEP_RUN_ADDR ("IP:PORT", with LOCKSTEP_RUN_TOKEN
// naming its attempt): "report TOKEN\n" then the report, on a connection of its own. Reaches
// the launcher from every host (a report folder may exist on the launch host only). Bounded: a
// launcher that cannot be reached costs at most 2 s. Returns "" or what failed.
std::string send_report(const char* addr, const std::string& text) {
  const char* token = std::getenv("LOCKSTEP_RUN_TOKEN");
  const std::string a = addr;
  const auto colon = a.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (colon == std::string::npos || inet_pton(AF_INET, a.substr(0, colon).c_str(), &sa.sin_addr) != 1)
    return "not an IPv4 address and port";
  sa.sin_port = htons(static_cast<std::uint16_t>(std::atoi(a.c_str() + colon + 1)));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return concat("socket: ", std::strerror(errno));
  const std::string msg = concat("report ", token ? token : "", "\n", text);
  std::string failed;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 && errno != EINPROGRESS)
    failed = concat("connect: ", std::strerror(errno));
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::size_t off = 0;
  while (failed.empty() && off < msg.size()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    pollfd p{fd, POLLOUT, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) != 1) {
      failed = "no connection within 2 s";
      break;
    }
    int err = 0;
    socklen_t len = sizeof err;
    if (off == 0 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) {
      failed = concat("connect: ", std::strerror(err));
      break;
    }
    const ssize_t n = ::send(fd, msg.data() + off, msg.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) failed = concat("send: ", std::strerror(errno));
    if (n > 0) off += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return failed;
}

}  // namespace


// ---------------------------------------------------------------------------------------------
// Settings agreed across ranks
// ---------------------------------------------------------------------------------------------

std::optional<bool> settings_shm() { return settings().shm; }
std::optional<std::uint64_t> settings_shm_slice_bytes() { return settings().shm_slice; }
std::optional<std::uint64_t> settings_shm_min_bytes() { return settings().shm_min; }
std::optional<bool> settings_cuda_aware_mpi() { return settings().cuda_aware; }

void agree_on_settings(MPI_Comm comm) {
  Settings& s = loaded_settings();
  // What this rank has: its error, or its settings; both as text, with a hash to compare.
  struct Entry {
    std::int32_t ok;
    std::int32_t pad;
    std::uint64_t hash;
    char text[kTextBytes];
  };
  Entry mine{};
  mine.ok = s.env_error.empty() ? 1 : 0;
  const std::string& text = mine.ok ? s.canonical : s.env_error;
  mine.hash = hash_bytes(text.data(), text.size());
  copy_text(mine.text, text);
  int size = 1, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  std::vector<Entry> all(static_cast<std::size_t>(size));
  if (int rc = MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, comm);
      rc != MPI_SUCCESS)
    throw MpiError(concat("lockstep: MPI_Allgather of the settings failed", rank_suffix()), rc);
  std::vector<int> bad;
  for (int r = 0; r < size; ++r)
    if (!all[r].ok) bad.push_back(r);
  if (!bad.empty()) {
    std::ostringstream os;
    os << "lockstep: a LOCKSTEP_* setting is malformed on " << rank_list(bad) << ", so every rank stops here:";
    for (int r : bad) os << "\n  rank " << r << ": " << all[r].text;
    throw InvalidArgument(os.str() + rank_suffix());
  }
  bool same = true;
  for (int r = 1; r < size; ++r) same = same && all[r].hash == all[0].hash;
  if (!same) {
    std::ostringstream os;
    os << "lockstep: the ranks disagree on their LOCKSTEP_* settings (they must be the same on every rank; set "
          "them for the whole job, e.g. mpiexec -x VAR):";
    for (int r = 0; r < size; ++r) os << "\n  rank " << r << ": " << all[r].text;
    throw InvalidArgument(os.str() + rank_suffix());
  }
}

// ---------------------------------------------------------------------------------------------
// CommMonitor: construction and teardown (the other members are in monitor_*.cpp)
// ---------------------------------------------------------------------------------------------

CommMonitor::CommMonitor(MPI_Comm comm) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &size_);
  check_mpi(MPI_Comm_dup(comm, &check_), "MPI_Comm_dup(fingerprint communicator)");
  check_mpi(MPI_Comm_dup(comm, &ctrl_), "MPI_Comm_dup(status communicator)");
  MPI_Comm_set_errhandler(check_, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(ctrl_, MPI_ERRORS_RETURN);
  // An identity for this communicator's notices: a notice that no watchdog received before its
  // communicator was freed can be matched on a later communicator that MPI gives the same
  // context; the identity lets that watchdog drop it.
  if (rank_ == 0) {
    std::random_device rd;
    comm_id_ = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^
               static_cast<std::uint64_t>(Clock::now().time_since_epoch().count());
  }
  check_mpi(MPI_Bcast(&comm_id_, 1, MPI_UINT64_T, 0, ctrl_), "MPI_Bcast(monitor identity)");
  // Every rank's host name, once: a stall report names the host of each rank it blames, and
  // a host none of whose ranks answers as lost (across hosts, the thing to replace).
  {
    constexpr int kSlot = 64;
    char mine[kSlot] = {};
    char name_buf[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    if (MPI_Get_processor_name(name_buf, &len) != MPI_SUCCESS || len <= 0) std::strcpy(name_buf, "unknown");
    // At most kSlot - 1 characters, the rest of `mine` stays zero (a longer name is cut).
    std::memcpy(mine, name_buf, std::min<std::size_t>(strnlen(name_buf, sizeof name_buf), kSlot - 1));
    std::vector<char> all(static_cast<std::size_t>(kSlot) * static_cast<std::size_t>(size_));
    check_mpi(MPI_Allgather(mine, kSlot, MPI_CHAR, all.data(), kSlot, MPI_CHAR, ctrl_),
              "MPI_Allgather(host names)");
    hosts_.resize(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r)
      hosts_[static_cast<std::size_t>(r)] = std::string(all.data() + static_cast<std::size_t>(r) * kSlot,
                                                        strnlen(all.data() + static_cast<std::size_t>(r) * kSlot, kSlot));
  }
  (void)settings();  // a bad environment variable fails at creation, on every rank alike
  straggler_ = std::make_unique<StragglerWatch>(rank_, hosts_);
#if LOCKSTEP_FAULT_INJECTION
  const FaultSpec& f = fault_spec();
  fault_pending_ = f.kind != FaultKind::none && f.kind != FaultKind::no_segment &&
                   f.kind != FaultKind::rescue_delay && f.kind != FaultKind::freeze_exchange && f.rank == rank_;
  exchange_fault_ = f.kind == FaultKind::freeze_exchange && f.rank == rank_;
#endif
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  // Without MPI_THREAD_MULTIPLE there is no watchdog; a timed-out rank then names the ranks
  // that did not answer instead of what they were doing.
  if (provided == MPI_THREAD_MULTIPLE) watchdog_ = std::thread([this] { watchdog_loop(); });
}

CommMonitor::~CommMonitor() {
  stop_ = true;
  if (watchdog_.joinable()) watchdog_.join();
  int fin = 0;
  MPI_Finalized(&fin);
  // After a stall, requests abandoned on these communicators may still be progressed by MPI
  // (in MPI_Finalize too); they are leaked rather than freed under those requests.
  // Notices still in flight are not waited for (their peer may be gone): their requests are
  // freed and their text is kept for the life of the process (keep_for_process), as MPI may
  // still read it.
  for (auto& n : notices_) {
    if (fin) {
      keep_for_process(std::move(n.text));
      continue;
    }
    int done = 0;
    MPI_Testall(static_cast<int>(n.reqs.size()), n.reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (done) continue;
    for (auto& req : n.reqs)
      if (req != MPI_REQUEST_NULL) MPI_Request_free(&req);
    keep_for_process(std::move(n.text));
  }
  if (!fin && !stalled_) {
    MPI_Comm_free(&check_);
    MPI_Comm_free(&ctrl_);
  }
}

void CommMonitor::check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) throw MpiError(concat("lockstep reliability: ", what, " failed", rank_suffix()), rc);
}


CommMonitorPtr make_comm_monitor(MPI_Comm comm) { return std::make_shared<CommMonitor>(comm); }

int pending_requests(const CommMonitor& m) noexcept { return m.pending(); }
bool safe_to_free(const CommMonitor& m) noexcept { return !m.stalled_for_real() && m.pending() == 0; }
bool monitor_usable(const CommMonitor& m) noexcept { return !m.stalled(); }
bool any_stall() noexcept { return g_any_stall.load(); }
void write_blame_report(MPI_Comm comm, const std::vector<int>& silent, const std::vector<int>& behind,
                        const std::string& msg) noexcept {
  try {
    const char* dir = std::getenv("LOCKSTEP_REPORT_DIR");
    const char* addr = std::getenv("LOCKSTEP_RUN_ADDR");
    const bool to_dir = dir != nullptr && *dir != '\0', to_launcher = addr != nullptr && *addr != '\0';
    if (!to_dir && !to_launcher) return;
    MPI_Group group, world;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    auto to_world = [&](const std::vector<int>& ranks) {
      std::vector<int> out(ranks.size(), MPI_UNDEFINED);
      if (!ranks.empty())
        MPI_Group_translate_ranks(group, static_cast<int>(ranks.size()), ranks.data(), world, out.data());
      std::string line;
      for (int r : out) {
        line.push_back(' ');
        line.append(r == MPI_UNDEFINED ? std::string("?") : std::to_string(r));
      }
      return line;
    };
    const std::string silent_line = to_world(silent), behind_line = to_world(behind);
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    int me = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown");
    std::string first = msg.substr(0, msg.find('\n'));
    const std::string text = concat("rank ", me, "\nhost ", host, "\nsilent", silent_line, "\nbehind", behind_line,
                                    "\nmessage ", first, "\n");
    if (to_launcher) {
      const std::string failed = send_report(addr, text);
      static std::atomic<bool> said{false};
      if (!failed.empty() && !said.exchange(true)) {
        std::string oneline = text;
        std::replace(oneline.begin(), oneline.end(), '\n', ';');
        std::cerr << "lockstep: could not send the blame report to lockstep-run at LOCKSTEP_RUN_ADDR=" << addr << " ("
                  << failed << "); the report: " << oneline << std::endl;
      }
    }
    if (!to_dir) return;
    const std::string path = concat(dir, "/blame.", me);
    const std::string tmp = concat(path, ".tmp.", ::getpid());
    // The directory may exist on the launcher's host only (no shared /tmp on a cluster): made
    // here if missing. A report that cannot be written is said on stderr, once per process,
    // with its content (mpiexec forwards stderr to the launcher): never dropped in silence.
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const char* failed = nullptr;
    int err = 0;
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr) {
      failed = "open";
      err = errno;
    } else {
      const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
      if (!ok) err = errno;
      if (std::fclose(f) != 0 && ok) err = errno;
      if (!ok || err != 0) failed = "write";
      else if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        failed = "rename";
        err = errno;
      }
      if (failed != nullptr) std::remove(tmp.c_str());
    }
    static std::atomic<bool> said{false};
    if (failed != nullptr && !said.exchange(true)) {
      std::string oneline = text;
      std::replace(oneline.begin(), oneline.end(), '\n', ';');
      std::cerr << "lockstep: could not write the blame report " << path << " (" << failed << ": "
                << std::strerror(err) << "; LOCKSTEP_REPORT_DIR=" << dir << "); the report: " << oneline << std::endl;
    }
  } catch (const std::exception& e) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) std::cerr << "lockstep: could not write the blame report: " << e.what() << std::endl;
  }
}

void announce_leaving(CommMonitor& m) noexcept {
  try {
    m.announce_leaving();
  } catch (...) {
  }
}

void report_mpi_error(CommMonitor* m, const std::string& what, int code) noexcept {
  if (m == nullptr) return;
  try {
    m->on_local_mpi_error(what, code);
  } catch (...) {
  }
}

void wait_point(CommMonitor* monitor) {
  if (monitor != nullptr) monitor->wait_point();
}

WaitHook* as_wait_hook(CommMonitor* monitor) noexcept { return monitor; }

void exchange_point([[maybe_unused]] CommMonitor* monitor) {
#if LOCKSTEP_FAULT_INJECTION
  if (monitor != nullptr) monitor->exchange_point();
#endif
}

#if LOCKSTEP_FAULT_INJECTION
void CommMonitor::exchange_point() {
  const std::int64_t seq = started_.load(std::memory_order_relaxed) - 1;
  if (!exchange_fault_ || seq < fault_spec().after) return;
  exchange_fault_ = false;
  std::int64_t count = 0;
  inject_fault(fault_spec(), rank_, seq, "its part sent, before its wait", nullptr, count);
}
#endif

void abandon_collective(CommMonitor* m, const char* op, std::int64_t count, int dtype, int reduce_op, int root,
                        const char* message) {
  if (m == nullptr) return;
  static const std::pair<const char*, Coll> names[] = {
      {"broadcast", Coll::broadcast}, {"allreduce", Coll::allreduce},   {"reduce", Coll::reduce},
      {"allgather", Coll::allgather}, {"reduce_scatter", Coll::reduce_scatter}, {"barrier", Coll::barrier},
      {"iallreduce", Coll::iallreduce}, {"ibroadcast", Coll::ibroadcast}};
  Coll coll = Coll::allreduce;
  for (const auto& [n, c] : names)
    if (std::strcmp(n, op) == 0) coll = c;
  m->abandon(coll, count, dtype, reduce_op, root, message);
}

void check_no_pending_requests(const CommMonitor* m, const char* what) {
  // After a stall nothing can be waited for any more; the communicator is leaked instead.
  if (m == nullptr || m->pending() == 0 || m->stalled()) return;
  const int n = m->pending();
  throw InvalidArgument(concat(what, ": ", n, " nonblocking request", n == 1 ? " is" : "s are",
                               " still pending on this backend; wait() for ", n == 1 ? "it" : "them",
                               " (or let the Request objects go out of scope) first", rank_suffix()));
}

RequestWatch::RequestWatch() = default;
RequestWatch::RequestWatch(std::weak_ptr<CommMonitor> monitor, const OpRecord& op)
    : monitor_(std::move(monitor)), op_(op) {
  if (auto m = monitor_.lock()) {
    m->add_pending(1);
    counted_ = true;
    check_ = m->take_deferred();  // owns the buffer its MPI request writes to
  }
}
RequestWatch::RequestWatch(RequestWatch&& other) noexcept
    : monitor_(std::move(other.monitor_)), op_(other.op_), counted_(std::exchange(other.counted_, false)),
      check_(std::move(other.check_)) {}
RequestWatch::~RequestWatch() {
  if (check_ && check_->req != MPI_REQUEST_NULL) {
    // Completed by test() rather than wait(): finish the check here, where nothing may throw.
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) {
      MPI_Wait(&check_->req, MPI_STATUS_IGNORE);
      bool same = true;
      for (int i = 0; i < kFields; ++i) same = same && check_->buf[i] == ~check_->buf[kFields + i];
      if (!same)
        std::cerr << "lockstep: the ranks disagreed about " << detail::describe(check_->fp, check_->site)
                  << " (found after test(); wait() would have thrown MismatchError)" << rank_suffix() << std::endl;
    }
  }
  if (counted_)
    if (auto m = monitor_.lock()) m->add_pending(-1);
}
std::string RequestWatch::describe() const {
  Fingerprint fp;
  std::copy(std::begin(op_.v), std::end(op_.v), fp.v);
  return fp.v[0] < 0 ? std::string("a nonblocking collective") : detail::describe(fp, op_.site);
}
void RequestWatch::report(const std::string& what, int code) noexcept {
  if (auto m = monitor_.lock()) report_mpi_error(m.get(), what, code);
}
int RequestWatch::wait_all(std::vector<MPI_Request>& reqs) {
  auto m = monitor_.lock();
  if (!m) return MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
  if (check_) {
    m->finish_deferred(*check_);
    check_.reset();
  }
  return m->wait_request(reqs, op_);
}

// ---------------------------------------------------------------------------------------------
// CollectiveScope and the guarded calls
// ---------------------------------------------------------------------------------------------
namespace {
thread_local CommMonitor* t_monitor = nullptr;  // monitor of the collective this thread is in
}

RequestWatch watch_request(const CommMonitorPtr& monitor) {
  if (!monitor || t_monitor != monitor.get()) return {};
  return RequestWatch(monitor, monitor->current_record());
}

// The fast path of a blocking collective touches neither the thread-local t_monitor nor
// std::uncaught_exceptions(), and the rest is out of line, so that the fast path needs no saved
// registers: a few loads, stores and branches.
CollectiveScope::CollectiveScope(CommMonitor* monitor, Coll coll, TensorView* data, std::int64_t count,
                                 int op, int root)
    : monitor_(monitor), outer_(nullptr) {
  if (monitor_ == nullptr) return;
  if (coll != Coll::iallreduce && coll != Coll::ibroadcast && monitor_->fast_ok()) {
    monitor_->enter_fast(coll);
    fast_ = true;
    return;
  }
  enter_slow(coll, data, count, op, root);
}

void CollectiveScope::enter_slow(Coll coll, TensorView* data, std::int64_t count, int op, int root) {
  if (monitor_->fast_ok()) {
    // A nonblocking collective: its request needs the record and t_monitor (watch_request).
    monitor_->enter_fast(coll);
    monitor_->record_issuing(coll, data, count, op, root);
    fast_ = true;
  } else {
    uncaught_ = std::uncaught_exceptions();
#if LOCKSTEP_FAULT_INJECTION
    if (!monitor_->enter(coll, data, count, op, root)) {
      skipped_ = true;  // an injected skip fault: this rank does not take part
      monitor_ = nullptr;
      return;
    }
#else
    (void)monitor_->enter(coll, data, count, op, root);
#endif
    if (monitor_->has_deadline()) {
      deadline_ = true;
      g_deadline_scopes.fetch_add(1);
    }
  }
  outer_ = t_monitor;
  t_monitor = monitor_;
  scoped_ = true;
}

CollectiveScope::~CollectiveScope() {
  if (monitor_ == nullptr) return;
  if (fast_ && !scoped_) monitor_->leave_fast();
  else leave_slow();
}

void CollectiveScope::leave_slow() noexcept {
  t_monitor = outer_;
  if (deadline_) g_deadline_scopes.fetch_sub(1);
  if (fast_) monitor_->leave_fast();
  else monitor_->leave(std::uncaught_exceptions() == uncaught_);
}

namespace {
// What a polled request reads and writes. Invariant: a request started here never targets the
// caller's memory. A wait under a deadline may throw (the deadline, a stall or refusal found
// elsewhere) while its request is still pending, and a slow rank may deliver after that; the
// request then works on these copies, which are kept for the life of the process (a late
// delivery lands where nobody else looks), never on a buffer the caller may free or reuse.
struct Copies {
  std::vector<char> send, recv;
};

std::size_t bytes_of(std::int64_t count, MPI_Datatype dt) {
  MPI_Aint lb = 0, extent = 0;
  MPI_Type_get_extent(dt, &lb, &extent);
  return static_cast<std::size_t>(count) * static_cast<std::size_t>(extent);
}

int comm_size(MPI_Comm comm) {
  int n = 1;
  MPI_Comm_size(comm, &n);
  return n;
}

// Runs start(send', recv', &request) on copies of the caller's buffers and waits with the
// monitor's deadline: send_bytes of send (unless MPI_IN_PLACE or null), recv_bytes of room for
// recv of which the first recv_in are copied in before and the first recv_out copied back after.
template <class Start>
int polled_on_copies(CommMonitor* m, const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes,
                     std::size_t recv_in, std::size_t recv_out, Start&& start) {
  // One set per thread, reused while nobody else holds it (grown, never shrunk: no allocation
  // per call); once a failed request's set is kept for the process, the next call takes a new one.
  thread_local std::shared_ptr<Copies> cached;
  if (!cached || cached.use_count() > 1) cached = std::make_shared<Copies>();
  std::shared_ptr<Copies> copies = cached;
  const void* s = send;
  if (send != MPI_IN_PLACE && send != nullptr) {
    copies->send.assign(static_cast<const char*>(send), static_cast<const char*>(send) + send_bytes);
    s = copies->send.data();
  }
  void* r = recv;
  if (recv != nullptr) {
    copies->recv.resize(recv_bytes);
    if (recv_in > 0) std::memcpy(copies->recv.data(), recv, recv_in);
    r = copies->recv.data();
  }
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = start(s, r, &req);
  if (rc != MPI_SUCCESS) return rc;
  exchange_point(m);  // a test's freeze_exchange fault: this rank's part is out, its wait not begun
  rc = wait_keeping(&req, copies, [m](MPI_Request* q) { return m->wait(q); });
  if (rc != MPI_SUCCESS) return rc;
  if (recv != nullptr && recv_out > 0) std::memcpy(recv, copies->recv.data(), recv_out);
  return rc;
}

// The monitor that polls this thread's collective against a deadline, or null (blocking MPI).
CommMonitor* polling_monitor() {
  if (g_deadline_scopes.load(std::memory_order_relaxed) == 0) return nullptr;
  CommMonitor* m = t_monitor;
  return m != nullptr && m->has_deadline() ? m : nullptr;
}

// The polled form of guarded_allreduce, out of line (and with the same six arguments) so that
// the common case, no deadline, compiles to a check and a tail call.
[[gnu::noinline]] int polled_allreduce(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op,
                                       MPI_Comm comm) {
  CommMonitor* m = polling_monitor();
  if (m == nullptr) return MPI_Allreduce(send, recv, count, dt, op, comm);
  const std::size_t n = bytes_of(count, dt);
  return polled_on_copies(m, send, n, recv, n, send == MPI_IN_PLACE ? n : 0, n,
                          [&](const void* s, void* r, MPI_Request* req) {
                            return MPI_Iallreduce(s, r, count, dt, op, comm, req);
                          });
}
}  // namespace

int guarded_allreduce(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, MPI_Comm comm) {
  if (g_deadline_scopes.load(std::memory_order_relaxed) == 0) return MPI_Allreduce(send, recv, count, dt, op, comm);
  return polled_allreduce(send, recv, count, dt, op, comm);
}
int guarded_bcast(void* buf, int count, MPI_Datatype dt, int root, MPI_Comm comm) {
  CommMonitor* m = polling_monitor();
  if (m == nullptr) return MPI_Bcast(buf, count, dt, root, comm);
  const std::size_t n = bytes_of(count, dt);
  return polled_on_copies(m, nullptr, 0, buf, n, n, n, [&](const void*, void* r, MPI_Request* req) {
    return MPI_Ibcast(r, count, dt, root, comm, req);
  });
}
int guarded_reduce(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op, int root,
                   MPI_Comm comm) {
  CommMonitor* m = polling_monitor();
  if (m == nullptr) return MPI_Reduce(send, recv, count, dt, op, root, comm);
  const std::size_t n = bytes_of(count, dt);
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  if (rank != root) recv = nullptr;  // only the root's recv is written (and may alias send elsewhere)
  return polled_on_copies(m, send, n, recv, n, send == MPI_IN_PLACE ? n : 0, n,
                          [&](const void* s, void* r, MPI_Request* req) {
                            return MPI_Ireduce(s, r, count, dt, op, root, comm, req);
                          });
}
int guarded_allgather(const void* send, int scount, MPI_Datatype sdt, void* recv, int rcount,
                      MPI_Datatype rdt, MPI_Comm comm) {
  CommMonitor* m = polling_monitor();
  if (m == nullptr) return MPI_Allgather(send, scount, sdt, recv, rcount, rdt, comm);
  const std::size_t all = bytes_of(static_cast<std::int64_t>(rcount) * comm_size(comm), rdt);
  return polled_on_copies(m, send, bytes_of(scount, sdt), recv, all, send == MPI_IN_PLACE ? all : 0, all,
                          [&](const void* s, void* r, MPI_Request* req) {
                            return MPI_Iallgather(s, scount, sdt, r, rcount, rdt, comm, req);
                          });
}
int guarded_reduce_scatter_block(const void* send, void* recv, int count, MPI_Datatype dt, MPI_Op op,
                                 MPI_Comm comm) {
  CommMonitor* m = polling_monitor();
  if (m == nullptr) return MPI_Reduce_scatter_block(send, recv, count, dt, op, comm);
  const std::size_t n = bytes_of(count, dt), all = n * static_cast<std::size_t>(comm_size(comm));
  const bool in_place = send == MPI_IN_PLACE;  // the input is then all of recv
  return polled_on_copies(m, send, all, recv, in_place ? all : n, in_place ? all : 0, n,
                          [&](const void* s, void* r, MPI_Request* req) {
                            return MPI_Ireduce_scatter_block(s, r, count, dt, op, comm, req);
                          });
}
int guarded_barrier(MPI_Comm comm) {
  CommMonitor* m = polling_monitor();
  if (m == nullptr) return MPI_Barrier(comm);
  MPI_Request req;
  const int rc = MPI_Ibarrier(comm, &req);
  return rc != MPI_SUCCESS ? rc : m->wait(&req);  // nothing in memory to keep
}

}  // namespace detail
}  // namespace lockstep

