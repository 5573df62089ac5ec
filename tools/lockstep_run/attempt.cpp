// One attempt of lockstep-run: mpiexec in a session of its own (so that its whole process group
// can be ended), the ranks' agents and the library's blame reports heard on a TCP socket, and
// the job ended once it cannot finish by itself. Nothing here reads what mpiexec or the
// program print: a rank's end is what its agent says (agent.cpp), a stall is a report the
// library sent (src/mpi/monitor.cpp, write_blame_report).
#include "launcher.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

extern char** environ;

namespace lockstep_run {
namespace {

volatile sig_atomic_t g_signal = 0, g_signals = 0;
int g_sigpipe[2] = {-1, -1};
int g_listen = -1;
std::string g_addr;  // IP:PORT the agents and the library reach lockstep-run on

void on_signal(int s) {
  if (g_signal == 0) g_signal = s;
  g_signals = g_signals + 1;
  const int saved = errno;
  const char c = 1;
  [[maybe_unused]] ssize_t n = ::write(g_sigpipe[1], &c, 1);
  errno = saved;
}

std::string random_token() {
  unsigned char b[8] = {};
  if (FILE* f = std::fopen("/dev/urandom", "rb")) {
    [[maybe_unused]] size_t n = std::fread(b, 1, sizeof b, f);
    std::fclose(f);
  }
  char out[17];
  for (int i = 0; i < 8; ++i) std::snprintf(out + 2 * i, 3, "%02x", b[i] ^ static_cast<unsigned char>(::getpid() >> i));
  return out;
}

// The address of this host that the hosts reach: the source address of a route to the first
// host that is not this one's loopback; 127.0.0.1 when every host is (or none is named).
std::string advertised_ip(const Options& o) {
  if (!o.listen_address.empty()) return o.listen_address;
  for (const Host& h : o.hosts) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_DGRAM;
    if (::getaddrinfo(h.name.c_str(), "9", &hints, &res) != 0 || res == nullptr) continue;
    const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    std::string ip;
    if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      sockaddr_in me{};
      socklen_t len = sizeof me;
      char buf[INET_ADDRSTRLEN] = {};
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0 &&
          inet_ntop(AF_INET, &me.sin_addr, buf, sizeof buf) != nullptr)
        ip = buf;
    }
    if (fd >= 0) ::close(fd);
    ::freeaddrinfo(res);
    if (!ip.empty() && ip.rfind("127.", 0) != 0) return ip;
  }
  return "127.0.0.1";
}

struct Conn {
  int fd = -1;
  std::string buf;
  enum { Unknown, Agent, Report } kind = Unknown;
  int rank = -1;
  bool ended = false;
  bool eof = false;  // closed by the other end: handled after every connection's data of the round
};

std::vector<int> ints(std::istringstream& in) {
  std::vector<int> out;
  std::string w;
  while (in >> w) out.push_back(w == "?" ? -1 : std::atoi(w.c_str()));
  return out;
}

// The report as write_blame_report sends it: "rank W\nhost H\nsilent R...\nbehind R...\nmessage T\n".
Report parse_report(const std::string& text) {
  Report r;
  r.t = elapsed();
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string key;
    in >> key;
    if (key == "rank") in >> r.rank;
    else if (key == "host") in >> r.node;
    else if (key == "silent") r.silent = ints(in);
    else if (key == "behind") r.behind = ints(in);
    else if (key == "message") r.message = line.size() > 8 ? line.substr(8) : "";
  }
  return r;
}

std::string fmt_grace(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", s);
  return b;
}

void signal_group(pid_t group, int sig) {
  if (group > 0) ::kill(-group, sig);
}

}  // namespace

int pending_signal() { return g_signal; }

void install_signal_handlers() {
  if (g_sigpipe[0] >= 0) return;
  if (::pipe2(g_sigpipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::perror("lockstep-run: pipe");
    std::exit(kExitSystem);
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) ::sigaction(s, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

// The socket the agents and the library's reports reach lockstep-run on: every address of this
// host, a port the kernel picks; the address given to the ranks is advertised_ip's.
std::string start_listener(const Options& o) {
  g_listen = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof sa;
  if (g_listen < 0 || ::bind(g_listen, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
      ::listen(g_listen, 256) != 0 || ::getsockname(g_listen, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    std::fprintf(stderr, "lockstep-run: error: cannot listen on a TCP port for the ranks' reports: %s\n",
                 std::strerror(errno));
    std::exit(kExitSystem);
  }
  g_addr = advertised_ip(o) + ":" + std::to_string(ntohs(sa.sin_port));
  return g_addr;
}

void run_attempt(const Options& o, int index, Attempt& a) {
  const std::string token = random_token();
  ::setenv("LOCKSTEP_RUN_ADDR", g_addr.c_str(), 1);
  ::setenv("LOCKSTEP_RUN_TOKEN", token.c_str(), 1);
  ::setenv("LOCKSTEP_RUN_ATTEMPT", std::to_string(index).c_str(), 1);
  ::setenv("LOCKSTEP_RUN_RANKS", std::to_string(a.np).c_str(), 1);
  if (!o.report_dir.empty()) {
    const std::string dir = o.report_dir + "/attempt-" + std::to_string(index);
    ::mkdir(dir.c_str(), 0777);
    ::setenv("LOCKSTEP_REPORT_DIR", dir.c_str(), 1);
  }
  std::vector<std::string> cmd{o.mpiexec};
  cmd.insert(cmd.end(), o.mpi_args.begin(), o.mpi_args.end());
  if (!a.hosts.empty()) cmd.insert(cmd.end(), {"-H", host_list(a.hosts), "--map-by", "slot"});
  if (!o.log_dir.empty()) cmd.insert(cmd.end(), {"--output-filename", o.log_dir + "/attempt-" + std::to_string(index)});
  cmd.insert(cmd.end(), {"-n", std::to_string(a.np)});
  // mpiexec passes the whole environment to the ranks of its own host only: LOCKSTEP_* (the
  // address and token among them) and the user's -x go to every host.
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    if (kv.rfind("LOCKSTEP_", 0) == 0) cmd.insert(cmd.end(), {"-x", kv.substr(0, kv.find('='))});
  }
  for (const auto& x : o.exports) cmd.insert(cmd.end(), {"-x", x});
  cmd.insert(cmd.end(), {o.self, "--rank-agent", "--"});
  cmd.insert(cmd.end(), o.program.begin(), o.program.end());
  std::string shown;
  for (const auto& w : cmd) shown += (shown.empty() ? "" : " ") + w;
  say("running: " + shown);

  a.t_start = elapsed();
  const pid_t pid = ::fork();
  if (pid < 0) {
    std::fprintf(stderr, "lockstep-run: error: cannot start mpiexec: %s\n", std::strerror(errno));
    std::exit(kExitSystem);
  }
  if (pid == 0) {
    ::setsid();  // its own session and process group: ended whole, and never ours
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) ::signal(s, SIG_DFL);
    std::vector<char*> argv;
    for (auto& w : cmd) argv.push_back(const_cast<char*>(w.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "lockstep-run: cannot run %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  const pid_t group = pid;

  std::vector<Conn> conns;
  bool done = false, ending = false, accounted = false, gone = false;
  double term_used = o.term_grace;
  int status = 0;
  double deadline = -1, kill_at = -1;
  double failure_at = -1;
  auto begin_ending = [&](const std::string& why) {
    say(why);
    a.killed = true;
    ending = true;
    signal_group(group, SIGTERM);  // once: a second TERM makes Open MPI's mpiexec leave its ranks
    // Every rank already ended, vanished or cut off: mpiexec has nothing to end gracefully.
    term_used = gone ? std::min(o.term_grace, 1.0) : o.term_grace;
    kill_at = elapsed() + term_used;
  };
  auto failure = [&](const std::string& what) {
    if (!a.first_failure.empty() || ending) return;
    a.first_failure = what + " at " + [] {
      char b[32];
      std::snprintf(b, sizeof b, "%.1fs", elapsed());
      return std::string(b);
    }();
    failure_at = elapsed();
    say("failure seen: " + what);
    deadline = elapsed() + o.grace;
  };
  auto where = [&](int r, const std::string& node) {
    const std::string h = host_of_rank(a.hosts, r);
    return !node.empty() ? node : (h.empty() ? std::string("this host") : h);
  };
  static const bool debug = std::getenv("LOCKSTEP_RUN_DEBUG") != nullptr;  // every word heard, on stderr
  // mpiexec ends the whole job when a rank fails, unless --enable-recovery keeps the survivors.
  const bool recovery = std::find(o.mpi_args.begin(), o.mpi_args.end(), "--enable-recovery") != o.mpi_args.end();
  std::uint64_t round = 0;                  // the poll loop's rounds, counted below
  std::map<int, std::uint64_t> died_round;  // rank -> the round its end was heard in
  auto handle_line = [&](Conn& c, const std::string& line) {
    if (debug) say("heard (rank " + std::to_string(c.rank) + "): " + line);
    std::istringstream in(line);
    std::string w;
    in >> w;
    if (c.kind == Conn::Unknown) {
      std::string tok;
      in >> tok;
      if (tok != token || (w != "agent" && w != "report")) {  // another attempt's, or a stranger
        ::close(c.fd);
        c.fd = -1;
        return;
      }
      if (w == "report") {
        c.kind = Conn::Report;
        return;
      }
      c.kind = Conn::Agent;
      std::string rank, node;
      long cpid = 0;
      in >> rank >> cpid >> node;
      c.rank = rank == "?" ? -1 : std::atoi(rank.c_str());
      Rank& r = a.ranks[c.rank];
      r.started = true;
      r.pid = cpid;
      r.node = node;
      return;
    }
    if (c.kind != Conn::Agent) return;
    Rank& r = a.ranks[c.rank];
    if (w == "signal") {
      r.signalled = true;
      int s = 0;
      in >> s;
      failure("mpiexec is ending the job (rank " + std::to_string(c.rank) + " on " + where(c.rank, r.node) +
              " was sent signal " + std::to_string(s) + ")");
    } else if (w == "end") {
      std::string how;
      in >> how;
      (how == "signal" ? r.sig : r.code) = 0;
      in >> (how == "signal" ? r.sig : r.code);
      r.ended = true;
      c.ended = true;
      r.t_end = elapsed();
      died_round.emplace(c.rank, round);
      if (r.sig != 0)
        failure("rank " + std::to_string(c.rank) + " died on " + where(c.rank, r.node) + " (signal " +
                std::to_string(r.sig) + ")");
      else if (r.code != 0)
        failure("rank " + std::to_string(c.rank) + " exited with status " + std::to_string(r.code) + " on " +
                where(c.rank, r.node));
    }
  };
  auto closed = [&](Conn& c) {
    if (debug) say("closed (rank " + std::to_string(c.rank) + ", " + (c.ended ? "ended" : "no end said") + ")");
    if (c.kind == Conn::Report) {
      Report rep = parse_report(c.buf);
      c.buf.clear();
      a.reports.push_back(rep);
      failure("a rank reported a stall (blame." + std::to_string(rep.rank) + " from " + rep.node + ")");
    } else if (c.kind == Conn::Agent && !c.ended) {
      Rank& r = a.ranks[c.rank];
      r.t_end = elapsed();
      // A rank that died of its own failure makes mpiexec end the job (unless --enable-recovery
      // keeps the survivors), and its KILL can reach an agent before the agent says a word: that
      // vanishing is the job's end, not a lost host. Counted so only when the death was heard in
      // an earlier round of this loop than the close: the death's agent spoke before it exited
      // and mpiexec ends the job only after (daemon to mpiexec to daemons, milliseconds). Heard
      // in the same round, the order is unknown (a survivor dying because a host was lost can
      // come with that host's closes), and a host whose agents all closed stays lost.
      const bool died_before = !recovery && std::any_of(a.ranks.begin(), a.ranks.end(), [&](const auto& kv) {
        const Rank& k = kv.second;
        const auto heard = died_round.find(kv.first);
        return kv.first != c.rank && k.ended && !k.signalled && (k.code != 0 || k.sig != 0) &&
               heard != died_round.end() && heard->second < round;
      });
      if (ending || r.signalled || died_before) {
        // Killed by whoever was ending the job (lockstep-run, or mpiexec: TERM, then KILL a
        // second later, or at once): no sign of anything.
        r.signalled = true;
        if (died_before && debug) say("rank " + std::to_string(c.rank) + "'s agent closed after another rank died: mpiexec ending the job");
      } else {
        r.vanished = true;
        failure("rank " + std::to_string(c.rank) + " on " + where(c.rank, r.node) +
                " vanished without a word (its agent was killed: the host or its daemon lost)");
      }
    }
    ::close(c.fd);
    c.fd = -1;
  };
  auto read_conn = [&](Conn& c) {
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        c.buf.append(buf, static_cast<size_t>(n));
        if (c.kind == Conn::Report) continue;  // read whole at the end
        size_t nl;
        while (c.fd >= 0 && c.kind != Conn::Report && (nl = c.buf.find('\n')) != std::string::npos) {
          const std::string line = c.buf.substr(0, nl);
          c.buf.erase(0, nl + 1);
          handle_line(c, line);
        }
        if (c.fd < 0) return;
        continue;
      }
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) c.eof = true;
      return;
    }
  };
  auto all_ranks = [&](auto pred) {
    for (int r = 0; r < a.np; ++r)
      if (!pred(r)) return false;
    return true;
  };
  auto accounted_for = [&](int r) {
    auto it = a.ranks.find(r);
    if (it != a.ranks.end() && (it->second.ended || it->second.vanished)) return true;
    for (const Report& rep : a.reports)
      if (rep.rank == r || std::count(rep.silent.begin(), rep.silent.end(), r) > 0) return true;
    return false;
  };

  double drain_until = -1;
  for (;; ++round) {
    std::vector<pollfd> fds{{g_sigpipe[0], POLLIN, 0}, {g_listen, POLLIN, 0}};
    for (const Conn& c : conns) fds.push_back({c.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 100);
    char drop[64];
    while (::read(g_sigpipe[0], drop, sizeof drop) > 0) {
    }
    if (g_signal != 0 && a.got_signal == 0 && !done) {
      a.got_signal = g_signal;
      begin_ending(std::string("got SIG") + sigabbrev_np(g_signal) + ": ending the job (mpiexec's process group " +
                   std::to_string(group) + ", on every host)");
      a.got_signal = g_signal;
    }
    for (;;) {
      const int fd = ::accept4(g_listen, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) break;
      conns.emplace_back(); conns.back().fd = fd;
    }
    // Every connection read, the reports and new ones before the agents': a rank sends its
    // report before it exits, so a report and its rank's end heard together count in that order.
    // An agent's close comes after every agent's words of the round: an agent killed because
    // another rank failed (mpiexec ends the job) closes after that rank's words are here, so the
    // failure is that rank's, not the killed one's.
    for (Conn& c : conns)
      if (c.fd >= 0 && c.kind != Conn::Agent) read_conn(c);
    for (Conn& c : conns)
      if (c.fd >= 0 && c.kind != Conn::Agent && c.eof) closed(c);
    for (Conn& c : conns)
      if (c.fd >= 0 && c.kind == Conn::Agent) read_conn(c);
    for (Conn& c : conns)
      if (c.fd >= 0 && c.eof) closed(c);
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const Conn& c) { return c.fd < 0; }), conns.end());
    const double now = elapsed();
    if (!done) {
      const pid_t w = ::waitpid(pid, &status, WNOHANG);
      if (w == pid) {
        done = true;
        a.t_end = now;
        // The ranks' last words may still be on their way: heard for up to a second more.
        drain_until = now + 1.0;
      }
    }
    if (done) {
      const bool open = std::any_of(conns.begin(), conns.end(), [](const Conn& c) {
        return c.kind == Conn::Report || c.kind == Conn::Unknown || !c.ended;
      });
      if (!open || now > drain_until) break;
      continue;
    }
    if (!o.rescue && !a.first_failure.empty() && !accounted && !ending && !a.reports.empty() &&
        all_ranks(accounted_for) && !all_ranks([&](int r) { return a.ranks.count(r) && a.ranks[r].ended; })) {
      accounted = true;
      say("every rank reported the stall or was named silent by one that did, or ended: ending the job in 3s if "
          "mpiexec has not");
      deadline = std::min(deadline, now + 3);
    }
    // Every rank has ended or vanished (the survivors of a lost host under --enable-recovery,
    // each after writing its rescue state), or with --rescue been named silent by another's
    // report (a cut-off host: its ranks cannot be heard): nothing of the job is left to wait
    // for, but mpiexec may wait on for the lost host's daemon. With --rescue a rank that
    // reported the stall is waited for until it ends: it may still be writing its rescue state.
    if (!a.first_failure.empty() && !gone && !ending && all_ranks([&](int r) {
          auto it = a.ranks.find(r);
          if (it != a.ranks.end() && (it->second.ended || it->second.vanished)) return true;
          if (!o.rescue) return false;
          // A rank that sent a report of its own is alive (it reports just before it writes its
          // rescue state), whatever another rank says of it: it is waited for until it ends. Two
          // sides of a partition that both reach lockstep-run name each other silent.
          for (const Report& rep : a.reports)
            if (rep.rank == r) return false;
          for (const Report& rep : a.reports)
            if (std::count(rep.silent.begin(), rep.silent.end(), r) > 0) return true;
          return false;
        })) {
      gone = true;
      say(o.rescue ? "every rank has ended, vanished or been named silent: ending the job in 1s if mpiexec has not"
                   : "every rank has ended or vanished: ending the job in 1s if mpiexec has not");
      deadline = std::min(deadline, now + 1);
    }
    if (!ending && deadline >= 0 && now > deadline) {
      char b[64];
      std::snprintf(b, sizeof b, "%gs", o.grace);
      const std::string settled = o.rescue ? ", vanished or was named silent" : " or vanished";
      begin_ending(gone        ? "mpiexec still running after every rank ended" + settled +
                                   ": killing its process group " + std::to_string(group)
                   : accounted ? "mpiexec still running after every rank reported: killing its process group " +
                                   std::to_string(group)
                             : "mpiexec still running " + std::string(b) +
                                   " after the failure: killing its process group " + std::to_string(group));
    }
    if (ending && kill_at >= 0 && g_signals > 1) {
      say("a second signal: KILL now");
      kill_at = now;
    }
    if (ending && kill_at >= 0 && now >= kill_at) {
      say("mpiexec's process group " + std::to_string(group) + " still there " + fmt_grace(term_used) +
          "s after TERM: KILL");
      signal_group(group, SIGKILL);
      kill_at = -1;
    }
  }
  if (a.killed) signal_group(group, SIGKILL);  // anything of the group left behind
  for (Conn& c : conns)
    if (c.fd >= 0) ::close(c.fd);
  a.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  (void)failure_at;
}

}  // namespace lockstep_run
