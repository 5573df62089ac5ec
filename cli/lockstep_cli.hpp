// Command lines of Lockstep's examples and benchmarks. CLI11 parses them and writes --help; this
// header adds what a program started by mpiexec needs around that. Every rank parses its own
// argv, then the ranks agree on the outcome (go on, --help, or an error), so a bad flag ends every
// rank with the error and no rank is left waiting in a collective for one that stopped. It also
// has validators whose messages read like the rest of Lockstep's ("--epochs: must be >= 1").
//
// Only the programs use it (target lockstep_cli); the library never depends on CLI11.
#pragma once

#include <CLI/CLI.hpp>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lockstep_cli {

/// A CLI::App set up as every Lockstep program wants it: a flag given twice keeps its last
/// value (as the earlier hand-written parsers did), and --help shows each option's default.
/// The name is the program's, used in --help and in error messages.
class App : public CLI::App {
 public:
  App(std::string name, std::string description) : CLI::App(std::move(description), std::move(name)) {
    option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)->always_capture_default();
  }
};

/// True while MPI is initialised and not yet finalised (the ranks can then agree).
inline bool mpi_running() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init != 0 && fin == 0;
}

/// "NAME [rank r/n]" while MPI runs, else "NAME": who speaks in an error message.
inline std::string speaker(const CLI::App& app) {
  if (!mpi_running()) return app.get_name();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return app.get_name() + " [rank " + std::to_string(rank) + "/" + std::to_string(size) + "]";
}

/// Parses argv. Returns nothing when the program should go on, else the exit status it should
/// end with: 0 after --help (printed by rank 0), 2 after a bad command line. On an error every
/// rank prints "NAME [rank r/n]: error: MESSAGE" to stderr and rank 0 says where the flags are
/// listed. With MPI running the ranks of MPI_COMM_WORLD agree first (one allreduce, and one
/// broadcast of the message when a rank failed), so that they all stop when any of them does:
/// a rank whose own command line was fine reports the lowest failing rank's message. Without
/// MPI (a program that parses before initialising) each process decides alone, which is the
/// same decision on every rank of an mpiexec job, since every rank gets the same argv.
inline std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  enum : int { go = 0, help = 1, error = 2 };
  int outcome = go;
  std::string message;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    outcome = help;
  } catch (const CLI::CallForAllHelp&) {
    outcome = help;
  } catch (const CLI::ParseError& e) {
    outcome = error;
    message = e.what();
  } catch (const std::exception& e) {  // from a program's own check: refused all the same
    outcome = error;
    message = e.what();
  }
  const bool failed_here = outcome == error;
  int rank = 0, size = 1;
  const bool mpi = mpi_running();
  if (mpi) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    // The worst outcome of any rank, and the lowest rank that failed (as size - rank, so that
    // MPI_MAX finds it in the same call).
    int mine[2] = {outcome, failed_here ? size - rank : 0};
    int all[2] = {0, 0};
    MPI_Allreduce(mine, all, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    outcome = all[0];
    if (outcome == error) {
      const int source = size - all[1];
      std::string theirs = message;
      int len = static_cast<int>(theirs.size());
      MPI_Bcast(&len, 1, MPI_INT, source, MPI_COMM_WORLD);
      theirs.resize(static_cast<std::size_t>(len));
      MPI_Bcast(theirs.data(), len, MPI_CHAR, source, MPI_COMM_WORLD);
      if (!failed_here) message = theirs + " (the command line of rank " + std::to_string(source) + ")";
    }
  }
  if (outcome == go) return std::nullopt;
  if (outcome == help) {
    if (rank == 0) {
      std::fputs(app.help().c_str(), stdout);
      std::fflush(stdout);
    }
    return 0;
  }
  std::fprintf(stderr, "%s: error: %s\n", speaker(app).c_str(), message.c_str());
  if (rank == 0) std::fprintf(stderr, "Run '%s --help' for the list of flags.\n", app.get_name().c_str());
  return 2;
}

/// The whole main() of an example: parses argv (parse() above), then returns what `body`
/// returns; an exception escaping `body` is printed as "NAME [rank r/n]: error: WHAT" and ends
/// the program with status 1.
template <class F>
int run_main(CLI::App& app, int argc, char** argv, F&& body) {
  if (const auto rc = parse(app, argc, argv)) return *rc;
  try {
    return body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", speaker(app).c_str(), e.what());
    return 1;
  }
}

namespace detail {
/// The whole of s as a number (strtod's syntax), or nothing.
inline std::optional<double> number(const std::string& s) {
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return v;
}
inline std::string text(double v) {
  char buf[32];
  if (v == std::floor(v) && std::fabs(v) < 1e15) std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
  else std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace detail

/// A number >= lo; refuses anything else with "must be >= lo" (or "expects a number, got ...").
/// Also what keeps "-1" out of an unsigned option, which CLI11 would otherwise wrap around.
inline CLI::Validator at_least(double lo) {
  return CLI::Validator(
      [lo](std::string& s) -> std::string {
        const auto v = detail::number(s);
        if (!v) return "expects a number, got \"" + s + "\"";
        if (!std::isfinite(*v)) return "must be a finite number";
        return *v >= lo ? std::string() : "must be >= " + detail::text(lo);
      },
      "", "at_least");
}

/// A finite number > 0; refuses anything else with "must be a positive number".
inline CLI::Validator positive() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const auto v = detail::number(s);
        if (!v) return "expects a number, got \"" + s + "\"";
        return std::isfinite(*v) && *v > 0 ? std::string() : "must be a positive number";
      },
      "", "positive");
}

/// One of `names`; refuses anything else with "VALUE not in {a,b}". Shown in --help only through
/// the option's type name (e.g. "mpi|nccl"), which says the same.
inline CLI::Validator one_of(std::vector<std::string> names) {
  return CLI::IsMember(std::move(names)).description("");
}

/// Thrown from a check across flags (an App::callback), reported like any other bad flag.
inline CLI::ValidationError refused(const std::string& flag, const std::string& why) {
  return CLI::ValidationError(flag, why);
}

}  // namespace lockstep_cli
