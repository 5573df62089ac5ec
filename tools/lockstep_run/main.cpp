// lockstep-run: runs a Lockstep program under mpiexec and restarts it when the run fails, on the
// hosts that are still usable, at the rank count they hold (what torchrun --max-restarts does,
// plus shrinking). See docs/multi-node.md, "Running under lockstep-run", and `lockstep-run --help`.
//
// Each attempt (attempt.cpp): mpiexec in its own session runs, as every rank, this program's
// agent (agent.cpp), which runs PROGRAM and tells lockstep-run over TCP how it ended; the
// library sends its blame reports to the same socket. lockstep-run judges the ranks by that
// alone, never by what mpiexec or the program print. After a failure it drops the hosts that
// were lost (their agents killed outright), that went silent (named silent by another host's
// rank, and sent no report themselves) or that fail a probe, and starts again on the rest.
#include "launcher.hpp"

#include <CLI/CLI.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <regex>
#include <signal.h>
#include <sstream>

namespace fs = std::filesystem;

namespace lockstep_run {

namespace {
const auto g_t0 = std::chrono::steady_clock::now();
std::string g_summary_file;

const char* kUsage = R"(Usage: lockstep-run [options] -- PROGRAM [ARGS...]

Runs PROGRAM under mpiexec; when the run fails, restarts it on the hosts still usable at the rank
count they hold, until it succeeds, --max-restarts is reached, or fewer than --min-ranks remain.
PROGRAM should resume from its newest checkpoint by itself (the train example: --resume auto).

Options:
  -H, --host LIST          hosts as host[:slots],... (slots default 1); ranks fill them in order.
                           Inside a Slurm allocation, without -H or --hostfile: the allocation's
                           nodes (SLURM_JOB_NODELIST) with SLURM_NTASKS_PER_NODE slots each (else
                           their share of SLURM_TASKS_PER_NODE)
      --hostfile FILE      hosts one a line: "host slots=N", "host:N" or "host" (# comments)
  -n, --np N               ranks to start (default: the slots of the hosts; required without hosts)
      --max-restarts R     restarts after a failure (default 3; 0: run once)
      --min-ranks M        stop instead of restarting with fewer than M ranks (default 1)
      --per-host-timeout S seconds mpiexec has, after the first sign of a failure, to end the job
                           before lockstep-run ends its process group (3 s once every rank has
                           ended, reported the stall or been named silent); also the probe's
                           limit per host (default 30)
      --term-grace S       seconds between the TERM and the KILL that end mpiexec's process group
                           (default 5)
      --mpiexec PATH       the mpiexec to run (default: mpiexec on PATH)
      --mca K V            an MCA setting for mpiexec (repeatable); OMPI_MCA_* variables pass too
  -x VAR                   export VAR to the ranks on every host (repeatable; LOCKSTEP_* are always)
      --mpiexec-arg ARG    one more argument for mpiexec, verbatim (repeatable), e.g. --oversubscribe
      --probe CMD|none     how to test a host after a failure: CMD HOST must exit 0 within the
                           timeout (default: mpiexec -H HOST:1 -n 1 true); none: drop only the
                           hosts lost or silent
      --checkpoint PATH    the program's checkpoint (stem or file, on this host): print the newest
                           one before each restart (default: PROGRAM's --checkpoint value)
      --report-dir DIR     also keep the ranks' blame reports as files, DIR/attempt-N/blame.RANK
                           on the host of each reporting rank (lockstep-run hears them over TCP)
      --log-dir DIR        keep each rank's output: DIR/attempt-N/1/rank.R/{stdout,stderr}
                           (mpiexec --output-filename), and the summary in DIR/summary.txt
      --rescue             a lost rank or host costs about one step, not a checkpoint interval:
                           mpiexec runs with --enable-recovery (Open MPI: it keeps the surviving
                           ranks running instead of ending them a second after the loss), the
                           ranks get LOCKSTEP_TIMEOUT=10 unless it is set, so their collective
                           fails, they write their rescue state and exit; the job is ended once
                           every rank has ended, vanished or been named silent (a rank that
                           reported the stall is waited for), and the restart resumes from the
                           freshest state (PROGRAM: train --rescue --resume auto);
                           --per-host-timeout defaults to LOCKSTEP_TIMEOUT + 50 s with it, room
                           for the deadline and a rescue write of up to 30 s
      --listen-address IP  the address of this host the ranks reach lockstep-run on (default:
                           this host's address on the route to the first host; 127.0.0.1 alone)
  -h, --help               this text

Set for PROGRAM: LOCKSTEP_RUN_ATTEMPT (0 first, then 1, ...), LOCKSTEP_RUN_RANKS, LOCKSTEP_RUN_ADDR
and LOCKSTEP_RUN_TOKEN (where the library sends its blame reports), LOCKSTEP_REPORT_DIR (with
--report-dir).
Exit status: PROGRAM's (0 on success; the failing status of the last attempt); 128+N when ended
by signal N (INT 130, TERM 143, HUP 129, QUIT 131: the job is ended on every host first);
64: a usage error (bad option or value); 71: lockstep-run could not work (a socket, fork).
)";

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "lockstep-run: error: %s\nRun 'lockstep-run --help' for the options.\n", msg.c_str());
  std::exit(kExitUsage);
}

bool is_count(const std::string& s) {
  return !s.empty() && s.size() <= 9 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

void add_host(std::vector<Host>& hosts, const std::string& name, const std::string& n, const std::string& where) {
  if (name.empty()) die(where + ": an empty host name");
  if (!is_count(n) || std::stoi(n) < 1)
    die(where + ": host '" + name + "' has slots '" + n + "' (need a whole number >= 1)");
  for (Host& h : hosts)
    if (h.name == name) {
      h.slots += std::stoi(n);
      return;
    }
  hosts.push_back({name, std::stoi(n)});
}

void parse_host_list(std::vector<Host>& hosts, const std::string& list) {
  if (list.empty()) die("-H: an empty host list");
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto c = item.find(':');
    if (c == std::string::npos) add_host(hosts, item, "1", "-H");
    else add_host(hosts, item.substr(0, c), item.substr(c + 1), "-H");
  }
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

void parse_hostfile(std::vector<Host>& hosts, const std::string& file) {
  std::ifstream in(file);
  if (!in) die("--hostfile: cannot read '" + file + "'");
  std::string raw;
  const std::string where = "--hostfile " + file;
  while (std::getline(in, raw)) {
    const std::string line = trim(raw.substr(0, raw.find('#')));
    std::istringstream words(line);
    std::string name, w;
    if (!(words >> name)) continue;
    const std::string bad = where + ": cannot read the line '" + line +
                            "' (expected 'host slots=N', 'host:N' or 'host')";
    std::string n = "1";
    bool seen = false, colon = false;
    if (const auto c = name.find(':'); c != std::string::npos) {
      n = name.substr(c + 1);
      name = name.substr(0, c);
      colon = true;
    }
    // Every word after the host, in any order: slots=N gives the slots, max_slots / max-slots
    // (a limit mpiexec enforces) are passed over, anything else is refused, never guessed at.
    while (words >> w) {
      if (colon) die(bad);
      if (w.rfind("slots=", 0) == 0) {
        if (seen) die(where + ": slots given twice in the line '" + line + "'");
        seen = true;
        n = w.substr(6);
      } else if (w.rfind("max_slots=", 0) != 0 && w.rfind("max-slots=", 0) != 0) {
        die(bad);
      }
    }
    add_host(hosts, name, n, where);
  }
  if (hosts.empty()) die("--hostfile: '" + file + "' names no host");
}

std::string run_capture(const std::string& cmd) {
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    ::pclose(p);
  }
  return out;
}

bool on_path(const std::string& prog) {
  if (prog.find('/') != std::string::npos) return ::access(prog.c_str(), X_OK) == 0 && fs::is_regular_file(prog);
  const char* path = std::getenv("PATH");
  std::stringstream in(path ? path : "");
  std::string dir;
  while (std::getline(in, dir, ':'))
    if (::access((dir + "/" + prog).c_str(), X_OK) == 0 && fs::is_regular_file(dir + "/" + prog)) return true;
  return false;
}

// Inside a Slurm allocation, with no hosts given: the allocation's nodes (SLURM_JOB_NODELIST,
// expanded by scontrol), each with SLURM_NTASKS_PER_NODE slots, or else its share of
// SLURM_TASKS_PER_NODE ("2(x3),1": 2 on each of the first three nodes, 1 on the fourth).
std::string slurm_hosts(std::vector<Host>& hosts) {
  const std::string list = std::getenv("SLURM_JOB_NODELIST");
  if (!on_path("scontrol"))
    die("inside a Slurm allocation (SLURM_JOB_NODELIST=" + list +
        ") but no scontrol on PATH to expand it: give the hosts (-H or --hostfile)");
  std::vector<std::string> names;
  {
    std::istringstream in(run_capture("scontrol show hostnames '" + list + "' 2>/dev/null"));
    std::string n;
    while (in >> n) names.push_back(n);
  }
  if (names.empty()) die("scontrol show hostnames '" + list + "' named no node: give the hosts (-H or --hostfile)");
  std::vector<std::string> per;
  const char* ntasks = std::getenv("SLURM_NTASKS_PER_NODE");
  if (ntasks != nullptr && *ntasks != '\0') {
    per.assign(names.size(), ntasks);
  } else {
    const char* tpn = std::getenv("SLURM_TASKS_PER_NODE");
    if (tpn == nullptr) tpn = std::getenv("SLURM_JOB_CPUS_PER_NODE");
    std::stringstream in(tpn ? tpn : "");
    std::string item;
    std::smatch m;
    static const std::regex rep(R"(^([0-9]+)\(x([0-9]+)\)$)"), one("^[0-9]+$");
    while (std::getline(in, item, ',')) {
      if (std::regex_match(item, m, rep)) per.insert(per.end(), std::stoul(m[2]), m[1]);
      else if (std::regex_match(item, one)) per.push_back(item);
    }
    if (per.size() != names.size()) {
      const char* id = std::getenv("SLURM_JOB_ID");
      die(std::string("cannot tell the tasks per node of Slurm job ") + (id ? id : "?") +
          " (SLURM_NTASKS_PER_NODE unset, SLURM_TASKS_PER_NODE='" + (tpn ? tpn : "") +
          "'): give the hosts (-H or --hostfile)");
    }
  }
  for (size_t i = 0; i < names.size(); ++i) add_host(hosts, names[i], per[i], "Slurm");
  const char* id = std::getenv("SLURM_JOB_ID");
  return id ? id : "?";
}

// A folder of earlier attempts (attempt-*) is moved aside into DIR/earlier-TIME-PID: an earlier
// run's blame reports or logs must not be taken for this run's.
void fresh_dir(const std::string& dir, const std::string& option, const std::string& what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir)) die(option + ": cannot create '" + dir + "'");
  std::vector<fs::path> old;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("attempt-", 0) == 0) old.push_back(e.path());
  if (old.empty()) return;
  char stamp[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%S", std::localtime(&t));
  const std::string earlier = dir + "/earlier-" + stamp + "-" + std::to_string(::getpid());
  fs::create_directories(earlier, ec);
  for (const auto& p : old) {
    fs::rename(p, fs::path(earlier) / p.filename(), ec);
    if (ec) die(option + ": cannot move the " + what + " of an earlier run in '" + dir + "' aside");
  }
  say("the " + what + " of an earlier run in " + dir + " were moved to " + earlier);
}

// The newest checkpoint of PATH (stem or file): what the pointer STEM.latest names
// (rotation_stem in checkpoint.hpp); "" when there is none.
std::string newest_checkpoint(const std::string& checkpoint, std::string* how) {
  if (checkpoint.empty()) return "";
  std::string stem = checkpoint;
  if (stem.back() == '/' || fs::is_directory(stem)) {
    while (!stem.empty() && stem.back() == '/') stem.pop_back();
    stem += "/ck";
  } else if (stem.size() > 12 && stem.compare(stem.size() - 12, 12, ".safetensors") == 0) {
    stem.resize(stem.size() - 12);
  }
  std::ifstream latest(stem + ".latest");
  std::string name;
  if (latest && std::getline(latest, name) && !name.empty()) {
    if (how) *how = " (named by " + stem + ".latest)";
    return fs::path(stem).parent_path().empty() ? name : (fs::path(stem).parent_path() / name).string();
  }
  if (fs::is_regular_file(checkpoint)) return checkpoint;
  return "";
}

std::string fmt_s(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1fs", s);
  return b;
}

void print_summary(const std::vector<Attempt>& attempts, int exit_status) {
  std::ostringstream out;
  out << "lockstep-run: summary: " << attempts.size() << " attempt(s), exit status " << exit_status << "\n";
  for (size_t i = 0; i < attempts.size(); ++i) {
    const Attempt& a = attempts[i];
    out << "  attempt " << i + 1 << ": " << a.np << " ranks on "
        << (a.hosts.empty() ? std::string("this host") : host_list(a.hosts)) << ", from " << fmt_s(a.t_start)
        << " to " << fmt_s(a.t_end) << ": " << a.ending << "\n";
    out << "    first failure: " << (a.first_failure.empty() ? std::string("none") : a.first_failure) << "\n";
    out << "    resumed from: " << (a.resumed_from.empty() ? std::string("the start (no checkpoint)") : a.resumed_from)
        << "\n";
  }
  std::fputs(out.str().c_str(), stderr);
  if (!g_summary_file.empty()) std::ofstream(g_summary_file) << out.str();
}

// Probes every host of `hosts` at once; true for those that answered within `limit` seconds.
std::map<std::string, bool> probe_hosts(const Options& o, const std::vector<std::string>& hosts) {
  std::map<pid_t, std::string> running;
  std::map<std::string, bool> ok;
  for (const auto& h : hosts) {
    const pid_t p = ::fork();
    if (p == 0) {
      ::setsid();
      for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) ::signal(s, SIG_DFL);
      std::freopen("/dev/null", "r", stdin);
      std::freopen("/dev/null", "w", stdout);
      std::freopen("/dev/null", "w", stderr);
      if (!o.probe.empty()) {
        ::execl("/bin/sh", "sh", "-c", (o.probe + " \"$1\"").c_str(), "probe", h.c_str(), (char*)nullptr);
      } else {
        std::vector<std::string> cmd{o.mpiexec};
        cmd.insert(cmd.end(), o.mpi_args.begin(), o.mpi_args.end());
        cmd.insert(cmd.end(), {"-H", h + ":1", "-n", "1", "true"});
        std::vector<char*> argv;
        for (auto& w : cmd) argv.push_back(w.data());
        argv.push_back(nullptr);
        ::execvp(argv[0], argv.data());
      }
      ::_exit(127);
    }
    if (p > 0) running[p] = h;
    ok[h] = false;
  }
  const double deadline = elapsed() + o.grace;
  while (!running.empty() && elapsed() < deadline && pending_signal() == 0) {
    int st = 0;
    const pid_t p = ::waitpid(-1, &st, WNOHANG);
    if (p > 0 && running.count(p)) {
      ok[running[p]] = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      running.erase(p);
    } else if (p <= 0) {
      ::usleep(50000);
    }
  }
  for (const auto& [p, h] : running) {
    ::kill(-p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
  return ok;
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (int r : v) s += (s.empty() ? "" : " ") + std::to_string(r);
  return s;
}

}  // namespace

double elapsed() { return std::chrono::duration<double>(std::chrono::steady_clock::now() - g_t0).count(); }

void say(const std::string& text) { std::fprintf(stderr, "lockstep-run: [%6.1fs] %s\n", elapsed(), text.c_str()); }

std::string host_of_rank(const std::vector<Host>& hosts, int r) {
  if (hosts.empty()) return "";
  for (const Host& h : hosts) {
    if (r >= 0 && r < h.slots) return h.name;
    r -= h.slots;
  }
  return "?";
}

std::string host_list(const std::vector<Host>& hosts) {
  std::string s;
  for (const Host& h : hosts) s += (s.empty() ? "" : ",") + h.name + ":" + std::to_string(h.slots);
  return s;
}

}  // namespace lockstep_run

using namespace lockstep_run;

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "--rank-agent") == 0) return agent_main(argc, argv);
  Options o;
  // The program's words are everything after the first "--"; lockstep-run's own come before it.
  // --mca, -x and --mpiexec-arg are taken here, in the order given (their values may start with
  // a dash, and the order of mpiexec's arguments is kept); CLI11 reads the rest.
  std::vector<std::string> own;
  bool has_program = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") {
      o.program.assign(argv + i + 1, argv + argc);
      has_program = true;
      break;
    }
    own.push_back(a == "-np" ? "--np" : a);
  }
  std::vector<std::string> rest;
  for (size_t i = 0; i < own.size(); ++i) {
    const std::string& a = own[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--mca") {
      if (i + 2 >= own.size()) die("--mca: needs a key and a value (--mca K V)");
      o.mpi_args.insert(o.mpi_args.end(), {"--mca", own[i + 1], own[i + 2]});
      i += 2;
    } else if (a == "-x" || a == "--mpiexec-arg") {
      if (i + 1 >= own.size()) die(a + ": missing its value");
      if (a == "-x") {
        if (!std::regex_match(own[i + 1], std::regex("^[A-Za-z_][A-Za-z0-9_]*(=.*)?$")))
          die("-x: '" + own[i + 1] + "' is not a variable name");
        o.exports.push_back(own[i + 1]);
      } else {
        o.mpi_args.push_back(own[i + 1]);
      }
      ++i;
    } else {
      rest.push_back(a);
    }
  }

  CLI::App app{"lockstep-run", "lockstep-run"};
  app.set_help_flag();
  app.allow_extras();
  std::vector<std::string> host_lists, hostfiles;
  std::string np_s, max_restarts = "3", min_ranks = "1", grace = "30", term_grace = "5";
  app.add_option("-H,--host", host_lists)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--hostfile", hostfiles)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("-n,--np", np_s);
  app.add_option("--max-restarts", max_restarts);
  app.add_option("--min-ranks", min_ranks);
  app.add_option("--per-host-timeout", grace);
  app.add_option("--term-grace", term_grace);
  app.add_option("--mpiexec", o.mpiexec);
  app.add_option("--probe", o.probe);
  app.add_option("--checkpoint", o.checkpoint);
  app.add_option("--report-dir", o.report_dir);
  app.add_option("--log-dir", o.log_dir);
  app.add_option("--listen-address", o.listen_address);
  app.add_flag("--rescue", o.rescue);
  // A scalar option given twice keeps its last value (scripts add to a command line).
  for (CLI::Option* opt : app.get_options()) {
    opt->allow_extra_args(false);
    if (opt->get_name() != "--host" && opt->get_name() != "--hostfile" && opt->get_name() != "-H")
      opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  std::vector<std::string> reversed(rest.rbegin(), rest.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    if (what.find("requires") != std::string::npos || what.find("xpected") != std::string::npos)
      what += " (missing its value)";
    die(what);
  }
  if (!app.remaining().empty())
    die("unknown option '" + app.remaining().front() + "' (the program comes after --)");
  if (host_lists.size() + hostfiles.size() > 1) die("give the hosts once (-H or --hostfile)");
  for (const auto& l : host_lists) parse_host_list(o.hosts, l);
  for (const auto& f : hostfiles) parse_hostfile(o.hosts, f);
  if (!has_program || o.program.empty())
    die("no program: give it after --, as in: lockstep-run -n 4 -- ./train --resume auto");
  if (!is_count(max_restarts)) die("--max-restarts: '" + max_restarts + "' is not a whole number >= 0");
  if (!is_count(min_ranks) || std::stoi(min_ranks) < 1)
    die("--min-ranks: '" + min_ranks + "' is not a whole number >= 1");
  auto seconds = [](const std::string& s, const std::string& opt) {
    if (!std::regex_match(s, std::regex(R"(^[0-9]+(\.[0-9]+)?$)")) || std::stod(s) <= 0)
      die(opt + ": '" + s + "' is not a number of seconds > 0");
    return std::stod(s);
  };
  o.grace = seconds(grace, "--per-host-timeout");
  o.term_grace = seconds(term_grace, "--term-grace");
  o.max_restarts = std::stoi(max_restarts);
  o.min_ranks = std::stoi(min_ranks);
  std::string slurm_job;
  if (host_lists.empty() && hostfiles.empty() && std::getenv("SLURM_JOB_NODELIST") != nullptr &&
      *std::getenv("SLURM_JOB_NODELIST") != '\0')
    slurm_job = slurm_hosts(o.hosts);
  int total = 0;
  for (const Host& h : o.hosts) total += h.slots;
  if (!np_s.empty()) {
    if (!is_count(np_s) || std::stoi(np_s) < 1) die("-n: '" + np_s + "' is not a whole number >= 1");
    o.np = std::stoi(np_s);
  } else if (!o.hosts.empty()) {
    o.np = total;
  } else {
    die("-n N is needed when no hosts are given (-H or --hostfile)");
  }
  if (!o.hosts.empty() && o.np > total)
    die("-n " + std::to_string(o.np) + ": the hosts have " + std::to_string(total) + " slots");
  if (o.min_ranks > o.np)
    die("--min-ranks " + std::to_string(o.min_ranks) + " is more than the " + std::to_string(o.np) +
        " ranks to start");
  if (!on_path(o.mpiexec))
    die("--mpiexec: '" + o.mpiexec + "' is " +
        (o.mpiexec.find('/') != std::string::npos ? "not an executable file" : "not on PATH"));
  if (o.checkpoint.empty())  // the program's own --checkpoint PATH, if it has one
    for (size_t i = 1; i < o.program.size(); ++i) {
      if (o.program[i] == "--checkpoint" && i + 1 < o.program.size()) o.checkpoint = o.program[i + 1];
      else if (o.program[i].rfind("--checkpoint=", 0) == 0) o.checkpoint = o.program[i].substr(13);
    }
  {
    std::error_code ec;
    o.self = fs::read_symlink("/proc/self/exe", ec).string();
    if (ec) o.self = fs::absolute(argv[0]).string();
  }
  if (!o.report_dir.empty()) fresh_dir(o.report_dir, "--report-dir", "reports");
  if (!o.log_dir.empty()) {
    fresh_dir(o.log_dir, "--log-dir", "logs");
    o.log_dir = fs::absolute(o.log_dir).string();
    g_summary_file = o.log_dir + "/summary.txt";
  }

  if (o.rescue) {
    // Open MPI's mpiexec ends every rank about a second after one dies: too soon for the
    // survivors' collective to fail and their rescue state to be written. --enable-recovery
    // keeps them; lockstep-run then ends the job itself once every rank has ended or vanished
    // (attempt.cpp), or --per-host-timeout after the failure.
    if (std::find(o.mpi_args.begin(), o.mpi_args.end(), "--enable-recovery") == o.mpi_args.end())
      o.mpi_args.push_back("--enable-recovery");
    // Without a deadline a survivor waits in its collective for ever (until the job is ended,
    // with no rescue written).
    if (std::getenv("LOCKSTEP_TIMEOUT") == nullptr || *std::getenv("LOCKSTEP_TIMEOUT") == '\0')
      ::setenv("LOCKSTEP_TIMEOUT", "10", 1);
    // The survivors need their deadline to pass and then their rescue write (train's
    // --rescue-seconds, 30 by default) before they end: unless --per-host-timeout was given,
    // mpiexec is not ended before LOCKSTEP_TIMEOUT + 30 s + 20 s of margin after the failure.
    if (app.count("--per-host-timeout") == 0) {
      const double timeout = std::strtod(std::getenv("LOCKSTEP_TIMEOUT"), nullptr);
      o.grace = std::max(o.grace, (timeout > 0 ? timeout : 10) + 50);
    }
  }

  install_signal_handlers();
  const std::string addr = start_listener(o);
  if (!slurm_job.empty())
    say("hosts from Slurm job " + slurm_job + " (SLURM_JOB_NODELIST=" + std::getenv("SLURM_JOB_NODELIST") +
        "): " + host_list(o.hosts));
  say("the ranks report to " + addr);
  if (addr.rfind("127.", 0) == 0)
    for (const Host& h : o.hosts)
      if (h.name != "localhost" && h.name.rfind("127.", 0) != 0) {
        say("note: no route to host " + h.name + " was found from here: ranks there may not reach " + addr +
            " (give --listen-address)");
        break;
      }

  std::vector<Attempt> attempts;
  std::vector<Host> hosts = o.hosts;
  int np = o.np;
  auto finish = [&](int status) {
    print_summary(attempts, status);
    std::exit(status);
  };
  for (int attempt = 0;; ++attempt) {
    if (pending_signal() != 0) finish(128 + pending_signal());  // sent between two attempts
    attempts.emplace_back();
    Attempt& a = attempts.back();
    a.np = np;
    a.hosts = hosts;
    a.resumed_from = newest_checkpoint(o.checkpoint, nullptr);
    // A rescue state is on the host of the rank that wrote it, where lockstep-run may not see it:
    // the program says which state it took.
    if (o.rescue && attempt > 0)
      a.resumed_from = "the freshest state the ranks agree on (the program says which); newest checkpoint here: " +
                       (a.resumed_from.empty() ? std::string("none") : a.resumed_from);
    say("attempt " + std::to_string(attempt + 1) + " (restart " + std::to_string(attempt) + " of at most " +
        std::to_string(o.max_restarts) + "): " + std::to_string(np) + " ranks" +
        (hosts.empty() ? "" : " on " + host_list(hosts)));
    run_attempt(o, attempt, a);
    const std::string took = fmt_s(a.t_end - a.t_start);
    if (a.got_signal != 0) {
      a.ending = std::string("ended by lockstep-run on SIG") + sigabbrev_np(a.got_signal) +
                 " (mpiexec exit status " + std::to_string(a.status) + ")";
      finish(128 + a.got_signal);
    }
    // Under --enable-recovery mpiexec may exit 0 after ranks died or failed: the ranks' own ends decide.
    const bool rank_failed = std::any_of(a.ranks.begin(), a.ranks.end(), [](const auto& kv) {
      const Rank& k = kv.second;
      return k.vanished || (k.ended && (k.code != 0 || k.sig != 0));
    });
    if (a.status == 0 && !a.killed && !rank_failed) {
      a.ending = "succeeded";
      say("attempt " + std::to_string(attempt + 1) + " succeeded after " + took + " (" + std::to_string(attempt) +
          " restart(s))");
      finish(0);
    }
    const int rc = a.status != 0 ? a.status : 1;
    a.ending = "failed: mpiexec exit status " + std::to_string(a.status) +
               (a.killed ? " (ended by lockstep-run)" : "") + (a.status == 0 ? " (but a rank failed)" : "");
    say("attempt " + std::to_string(attempt + 1) + " failed after " + took + ": mpiexec exit status " +
        std::to_string(a.status) + (a.killed ? " (killed by lockstep-run)" : "") +
        (a.status == 0 ? " (but a rank failed)" : ""));

    // Who failed, by what the agents said and the reports the library sent.
    std::set<std::string> suspect, lost, heard;
    std::map<std::string, std::string> silent;  // host -> who named it
    std::map<std::string, std::vector<int>> vanished;
    auto on = [&](int r) {
      const std::string h = host_of_rank(hosts, r);
      return h.empty() ? std::string() : " (host " + h + ")";
    };
    for (const auto& [r, k] : a.ranks) {
      const std::string h = host_of_rank(hosts, r);
      if (k.vanished) vanished[h].push_back(r);
      if (k.ended && !k.signalled && (k.sig != 0 || k.code != 0)) {
        say("rank " + std::to_string(r) + " died on " + (k.node.empty() ? h : k.node) +
            (k.sig != 0 ? " (signal " + std::to_string(k.sig) + ")" : " (exit status " + std::to_string(k.code) + ")"));
        suspect.insert(h);
      }
    }
    // A host is lost when every rank it ran vanished (a host or daemon killed takes them all);
    // one agent gone among others that spoke is a rank lost, not its host.
    for (const auto& [h, ranks] : vanished) {
      int there = 0;
      for (int r = 0; r < a.np; ++r) there += host_of_rank(hosts, r) == h;
      if (static_cast<int>(ranks.size()) < there) {
        say("rank(s) " + join(ranks) + " on " + (h.empty() ? std::string("this host") : h) +
            " vanished without a word (their agents were killed)");
        continue;
      }
      say("lost host " + (h.empty() ? std::string("(this host)") : h) + ": ranks " + join(ranks) +
          " ran there and vanished without a word (their agents were killed: the host or its daemon lost)");
      lost.insert(h);
    }
    // A host that reported is not silent towards lockstep-run: where the hosts blame each other,
    // the probe decides.
    for (const Report& rep : a.reports) heard.insert(host_of_rank(hosts, rep.rank));
    for (const Report& rep : a.reports) {
      const std::string by = "rank " + std::to_string(rep.rank) + " (on " + rep.node + ")";
      for (int r : rep.silent) {
        say(by + " reports no answer from rank " + std::to_string(r) + on(r));
        const std::string h = host_of_rank(hosts, r);
        if (!h.empty() && h != host_of_rank(hosts, rep.rank) && !heard.count(h) && !silent.count(h))
          silent[h] = by;
      }
      for (int r : rep.behind) say(by + " reports rank " + std::to_string(r) + " behind" + on(r));
    }

    if (attempt >= o.max_restarts) {
      say("giving up: " + std::to_string(attempt) + " restart(s) made, --max-restarts " +
          std::to_string(o.max_restarts) + "; exit status " + std::to_string(rc));
      finish(rc);
    }
    if (!hosts.empty()) {
      std::vector<std::string> to_probe;
      for (const Host& h : hosts)
        if (!lost.count(h.name) && !silent.count(h.name) && o.probe != "none") to_probe.push_back(h.name);
      const auto answered = probe_hosts(o, to_probe);
      if (pending_signal() != 0) finish(128 + pending_signal());
      std::vector<Host> keep;
      for (const Host& h : hosts) {
        // Named silent by another host's report comes first: such ranks went silent before
        // mpiexec's end of the job killed their agents (and made them vanish too).
        if (silent.count(h.name)) {
          say("dropping host " + h.name + ": its ranks went silent (named by " + silent[h.name] +
              ") and it sent no report; left out whatever a probe says");
        } else if (lost.count(h.name)) {
          say("dropping host " + h.name + ": its ranks vanished without a word (host or daemon lost)");
        } else if (answered.count(h.name) && !answered.at(h.name)) {
          char b[32];
          std::snprintf(b, sizeof b, "%g", o.grace);
          say("dropping host " + h.name + ": the probe failed or took over " + b + "s" +
              (suspect.count(h.name) ? " (a rank there had failed)" : ""));
        } else {
          if (suspect.count(h.name)) say("keeping host " + h.name + ": a rank there failed, but the host answers");
          keep.push_back(h);
        }
      }
      hosts = keep;
      int left = 0;
      for (const Host& h : hosts) left += h.slots;
      np = std::min(np, left);
      if (np < o.min_ranks) {
        std::string names;
        for (const Host& h : hosts) names += (names.empty() ? "" : " ") + h.name;
        say("stopping: " + std::to_string(np) + " rank(s) left on the remaining hosts (" +
            (names.empty() ? "none" : names) + "), fewer than --min-ranks " + std::to_string(o.min_ranks) +
            "; exit status " + std::to_string(rc));
        finish(rc);
      }
    }
    if (!o.checkpoint.empty()) {
      std::string how;
      const std::string ck = newest_checkpoint(o.checkpoint, &how);
      say(ck.empty() ? "no checkpoint yet at " + o.checkpoint + " (the program starts afresh)"
                     : "newest checkpoint: " + ck + how);
    }
    say("restarting on " + std::to_string(np) + " ranks" + (hosts.empty() ? "" : " on " + host_list(hosts)));
  }
}
