// lockstep-run: what its parts share. main.cpp reads the command line and runs the attempts,
// attempt.cpp runs one attempt (mpiexec, the socket the ranks' agents and reports reach it on)
// and judges it, agent.cpp is the per-rank agent mpiexec starts on every host.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

namespace lockstep_run {

// Exit codes of lockstep-run itself (a program's own status passes through unchanged).
inline constexpr int kExitUsage = 64;   // a usage error: bad option, value, host list (sysexits EX_USAGE)
inline constexpr int kExitSystem = 71;  // lockstep-run could not do its own work: a socket, fork (EX_OSERR)

struct Host {
  std::string name;
  int slots = 1;
};

struct Options {
  std::vector<Host> hosts;
  int np = 0;
  int max_restarts = 3;
  int min_ranks = 1;
  double grace = 30;       // --per-host-timeout
  double term_grace = 5;   // TERM, then KILL this many seconds later
  std::string mpiexec = "mpiexec";
  std::vector<std::string> mpi_args;  // --mca K V and --mpiexec-arg, in the order given
  std::vector<std::string> exports;   // -x VAR...
  std::string probe;                  // "" (mpiexec per host), "none" or a command
  std::string checkpoint;
  std::string report_dir;
  std::string log_dir;
  std::string listen_address;
  bool rescue = false;      // --rescue: survivors kept running (mpiexec --enable-recovery) to write rescue state
  std::vector<std::string> program;
  std::string self;  // this program's absolute path (the agent mpiexec starts)
};

// What one rank's agent said.
struct Rank {
  bool started = false;   // its agent said hello
  bool ended = false;     // its agent said how the program ended
  bool signalled = false; // its agent was sent a signal (the job was being ended)
  bool vanished = false;  // its agent's connection closed without saying how the program ended
  int code = 0, sig = 0;  // the end: exit code, or the signal that ended it
  double t_end = 0;       // seconds since lockstep-run started
  std::string node;       // the host name it reported
  long pid = 0;
};

// A blame report the library sent (src/mpi/monitor.cpp, write_blame_report).
struct Report {
  int rank = -1;
  std::string node;
  std::vector<int> silent, behind;
  std::string message;
  double t = 0;
};

struct Attempt {
  int np = 0;
  std::vector<Host> hosts;
  double t_start = 0, t_end = 0;
  int status = 0;          // mpiexec's exit status (128+N for a signal)
  bool killed = false;     // ended by lockstep-run (a stall, a hang, or a signal)
  int got_signal = 0;      // lockstep-run was sent this signal meanwhile
  std::string first_failure;  // the first sign, with where
  std::string resumed_from;   // the checkpoint the program would resume from at its start
  std::map<int, Rank> ranks;
  std::vector<Report> reports;
  std::string ending;      // how it ended, for the summary
};

// Seconds since lockstep-run started.
double elapsed();
// "lockstep-run: [  12.3s] TEXT" on stderr.
void say(const std::string& text);
// The host of world rank r (ranks fill the hosts' slots in order: --map-by slot); "" without hosts.
std::string host_of_rank(const std::vector<Host>& hosts, int r);
std::string host_list(const std::vector<Host>& hosts);

// Listens for the agents and reports; returns the IP:PORT given to the ranks. attempt.cpp.
std::string start_listener(const Options& o);
// Runs one attempt to its end (or until a signal ends it). attempt.cpp.
void run_attempt(const Options& o, int index, Attempt& a);
// The signal lockstep-run was sent (0: none); installs the handlers on first use.
int pending_signal();
void install_signal_handlers();

// The agent: `lockstep-run --rank-agent -- PROGRAM ARGS`. agent.cpp.
int agent_main(int argc, char** argv);

}  // namespace lockstep_run
