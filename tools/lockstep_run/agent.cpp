// The per-rank agent: mpiexec starts `lockstep-run --rank-agent -- PROGRAM ARGS` as each rank, on
// every host. It connects to the launcher (LOCKSTEP_RUN_ADDR, a TCP address on the launch host,
// with LOCKSTEP_RUN_TOKEN naming the attempt), says which rank it is, runs PROGRAM as its child,
// forwards the signals it is sent, and says how PROGRAM ended (exit status or signal) before
// ending the same way itself, so that mpiexec sees the status PROGRAM had. A connection that
// closes without that last word means the agent was killed outright (its host, or its daemon,
// lost): the launcher tells the two apart. Without a launcher to reach, PROGRAM still runs.
#include "launcher.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace lockstep_run {
namespace {

// A TCP connection to "IP:PORT", given up after timeout_ms; -1 on failure.
int connect_to(const std::string& addr, int timeout_ms) {
  const auto colon = addr.rfind(':');
  if (colon == std::string::npos) return -1;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::atoi(addr.c_str() + colon + 1)));
  if (inet_pton(AF_INET, addr.substr(0, colon).c_str(), &sa.sin_addr) != 1) return -1;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    if (errno != EINPROGRESS) {
      ::close(fd);
      return -1;
    }
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    if (::poll(&p, 1, timeout_ms) != 1 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      ::close(fd);
      return -1;
    }
  }
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // A send to a launcher that stopped reading must not hold the agent (and so the rank) up.
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return fd;
}

void send_line(int& fd, const std::string& line) {
  if (fd < 0) return;
  const std::string s = line + "\n";
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      fd = -1;
      return;
    }
    off += static_cast<size_t>(n);
  }
}

const char* rank_from_env() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* r = std::getenv(v); r != nullptr && *r != '\0') return r;
  return "?";
}

}  // namespace

int agent_main(int argc, char** argv) {
  // argv: lockstep-run --rank-agent -- PROGRAM ARGS...
  int first = 2;
  if (first < argc && std::strcmp(argv[first], "--") == 0) ++first;
  if (first >= argc) {
    std::fprintf(stderr, "lockstep-run --rank-agent: no program\n");
    return kExitUsage;
  }
  const char* addr = std::getenv("LOCKSTEP_RUN_ADDR");
  const char* token = std::getenv("LOCKSTEP_RUN_TOKEN");
  int fd = -1;
  if (addr != nullptr && *addr != '\0') {
    fd = connect_to(addr, 5000);
    if (fd < 0)
      std::fprintf(stderr,
                   "lockstep-run: rank %s cannot reach lockstep-run at LOCKSTEP_RUN_ADDR=%s (%s): it runs, but "
                   "lockstep-run will not hear how it ends\n",
                   rank_from_env(), addr, std::strerror(errno));
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown");

  sigset_t set, old;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCHLD}) sigaddset(&set, s);
  sigprocmask(SIG_BLOCK, &set, &old);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) {
    std::fprintf(stderr, "lockstep-run: rank %s: fork failed: %s\n", rank_from_env(), std::strerror(errno));
    return kExitSystem;
  }
  if (child == 0) {
    // The program ends with its agent: an agent killed outright leaves no rank behind.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(137);
    if (fd >= 0) ::close(fd);
    ::signal(SIGPIPE, SIG_DFL);
    sigprocmask(SIG_SETMASK, &old, nullptr);
    ::execvp(argv[first], argv + first);
    std::fprintf(stderr, "lockstep-run: rank %s cannot run '%s': %s\n", rank_from_env(), argv[first],
                 std::strerror(errno));
    ::_exit(127);
  }
  send_line(fd, std::string("agent ") + (token ? token : "") + " " + rank_from_env() + " " +
                    std::to_string(child) + " " + host);
  int status = 0;
  // Its parent (mpiexec's daemon, or mpiexec) gone, the agent is an orphan no one will end:
  // it ends the program itself, TERM then KILL 3 s later.
  const pid_t daemon = ::getppid();
  int orphan_ticks = -1;
  for (;;) {
    siginfo_t info{};
    const timespec tick{0, 500000000};
    const int s = sigtimedwait(&set, &info, &tick);
    if (s < 0) {
      if (orphan_ticks < 0 && ::getppid() != daemon) {
        orphan_ticks = 0;
        send_line(fd, "signal " + std::to_string(SIGTERM));
        ::kill(child, SIGTERM);
      } else if (orphan_ticks >= 0 && ++orphan_ticks == 6) {
        ::kill(child, SIGKILL);
      }
      continue;
    }
    if (s == SIGCHLD) {
      const pid_t w = ::waitpid(child, &status, WNOHANG);
      if (w == child && (WIFEXITED(status) || WIFSIGNALED(status))) break;
      continue;
    }
    // Said before it is passed on: a rank whose agent was sent a signal was being ended (by
    // mpiexec or lockstep-run), it did not fail by itself.
    send_line(fd, "signal " + std::to_string(s));
    ::kill(child, s);
  }
  if (WIFEXITED(status)) {
    send_line(fd, "end exit " + std::to_string(WEXITSTATUS(status)));
    if (fd >= 0) ::close(fd);
    return WEXITSTATUS(status);
  }
  const int sig = WTERMSIG(status);
  send_line(fd, "end signal " + std::to_string(sig));
  if (fd >= 0) ::close(fd);
  // End as the program did, without a core file of the agent's own.
  rlimit none{0, 0};
  ::setrlimit(RLIMIT_CORE, &none);
  ::signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  sigprocmask(SIG_UNBLOCK, &one, nullptr);
  ::raise(sig);
  return 128 + sig;
}

}  // namespace lockstep_run
