// Shared helpers of the benchmark programs: command-line options, timing across ranks,
// statistics, shape lists, a plain-text table and a JSON document (nlohmann::json).
//
// Timing rule used everywhere: every rank enters a barrier, runs the measured block, and the
// block's time is the slowest rank's (MPI_Allreduce MAX outside the timed region), since a
// collective is only as fast as its slowest participant. Competing variants run interleaved in
// the same loop, in alternating order, so that the noise of this shared machine hits them alike.
#pragma once

#include <mpi.h>
#include <nlohmann/json.hpp>

#include "lockstep_cli.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace bench {

/// Seconds since an arbitrary origin (steady clock).
inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Rank and size of MPI_COMM_WORLD (0 and 1 without MPI).
inline int world_rank() {
  int init = 0, r = 0;
  MPI_Initialized(&init);
  if (init) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int init = 0, n = 1;
  MPI_Initialized(&init);
  if (init) MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// The slowest rank's value.
inline double max_over_ranks(double v, MPI_Comm comm = MPI_COMM_WORLD) {
  double out = v;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, comm);
  return out;
}
/// True on every rank iff `ok` on every rank (never a REQUIRE between collectives).
inline bool all_ranks(bool ok, MPI_Comm comm = MPI_COMM_WORLD) {
  int v = ok ? 1 : 0, out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_INT, MPI_MIN, comm);
  return out == 1;
}

/// Seconds per call of f (iters calls, after a barrier), the slowest rank's.
inline double time_collective(const std::function<void()>& f, int iters, MPI_Comm comm = MPI_COMM_WORLD) {
  MPI_Barrier(comm);
  const double t0 = now();
  for (int i = 0; i < iters; ++i) f();
  const double dt = (now() - t0) / iters;
  return max_over_ranks(dt, comm);
}

/// Median and minimum of a sample.
struct Stats {
  double median = 0, min = 0, max = 0;
  int n = 0;
};
inline Stats stats_of(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.n = static_cast<int>(v.size());
  s.min = v.front();
  s.max = v.back();
  s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  return s;
}

/// One named variant in an interleaved comparison: setup runs before each timed block (not
/// timed), body is timed, check runs after the block (not timed) and returns false on a wrong
/// result.
struct Variant {
  std::string name;
  std::function<void()> body;
  std::function<void()> setup = [] {};
  std::function<bool()> check = [] { return true; };
};

/// Result of one variant in an interleaved comparison.
struct Measured {
  std::string name;
  Stats s;       // seconds per call
  bool correct = true;
};

/// Runs every variant `reps` times, interleaved (the order rotates each repetition), each time
/// timing `iters` back-to-back calls after setup; returns the per-call statistics. Correctness
/// is combined across ranks.
inline std::vector<Measured> interleave(std::vector<Variant>& vs, int reps, int iters,
                                        MPI_Comm comm = MPI_COMM_WORLD) {
  std::vector<std::vector<double>> t(vs.size());
  std::vector<bool> ok(vs.size(), true);
  // One untimed warm-up call of each, so first-touch page faults and lazy MPI setup are not timed.
  for (auto& v : vs) {
    v.setup();
    v.body();
  }
  for (int r = 0; r < reps; ++r) {
    for (std::size_t k = 0; k < vs.size(); ++k) {
      const std::size_t j = (k + static_cast<std::size_t>(r)) % vs.size();
      vs[j].setup();
      t[j].push_back(time_collective(vs[j].body, iters, comm));
      ok[j] = ok[j] && vs[j].check();
    }
  }
  std::vector<Measured> out;
  for (std::size_t j = 0; j < vs.size(); ++j)
    out.push_back({vs[j].name, stats_of(t[j]), all_ranks(ok[j], comm)});
  return out;
}

/// The command line of a benchmark: the flags every one of them takes (--json PATH, --reps N,
/// --quick, --shapes-dir DIR) on a lockstep_cli::App, to which each benchmark adds its own
/// before parse(). CLI11 writes --help and names a bad or unknown flag (lockstep_cli.hpp).
struct Options {
  lockstep_cli::App app;
  std::string json;
  int reps = 7;
  bool quick = false;
  std::string shapes;
  CLI::Option* reps_flag = nullptr;

  /// default_reps: --reps when not given (7 for most; at most 3 with --quick, see quick_reps()).
  Options(std::string name, std::string description, int default_reps = 7)
      : app(std::move(name), std::move(description)), reps(default_reps) {
    app.add_option("--json", json, "write the results there as JSON (rank 0)")->type_name("PATH");
    reps_flag = app.add_option("--reps", reps, "timed repetitions of each variant (fewer with --quick)")
                    ->type_name("N")->check(lockstep_cli::at_least(1));
    app.add_flag("--quick", quick, "smaller sizes and fewer repetitions");
    app.add_option("--shapes-dir", shapes, "directory of the shape lists (sets LOCKSTEP_SHAPES_DIR)")
        ->type_name("DIR");
  }

  /// Parses argv (lockstep_cli::parse: the ranks agree when MPI is running). Returns nothing to
  /// go on, else the exit status to end with: 0 after --help, 2 after a bad flag.
  std::optional<int> parse(int argc, char** argv) {
    if (auto rc = lockstep_cli::parse(app, argc, argv)) return rc;
    if (!shapes.empty()) setenv("LOCKSTEP_SHAPES_DIR", shapes.c_str(), 1);
    return std::nullopt;
  }

  /// --reps, at most 3 with --quick.
  int quick_reps() const { return quick ? std::min(reps, 3) : reps; }

  /// With --quick, `value` becomes quick_value unless its flag was given.
  template <class T, class U>
  void quick_default(T& value, const CLI::Option* flag, U quick_value) const {
    if (quick && flag->count() == 0) value = static_cast<T>(quick_value);
  }
};

/// One parameter tensor of a shape list: name and element count.
struct Param {
  std::string name;
  std::int64_t numel;
};

/// Reads a shape list (one "name numel" a line). Throws with the path on a missing file.
inline std::vector<Param> read_shapes(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open shape list " + path);
  std::vector<Param> out;
  std::string name;
  std::int64_t n = 0;
  while (in >> name >> n) out.push_back({name, n});
  if (out.empty()) throw std::runtime_error("shape list " + path + " is empty");
  return out;
}

/// Directory of the shape lists: $LOCKSTEP_SHAPES_DIR, else the compiled-in default.
inline std::string shapes_dir() {
  if (const char* e = std::getenv("LOCKSTEP_SHAPES_DIR")) return e;
#ifdef LOCKSTEP_BENCH_SHAPES_DIR
  return LOCKSTEP_BENCH_SHAPES_DIR;
#else
  return "bench/shapes";
#endif
}

/// "8 B", "2 KiB", "128 MiB".
inline std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024 && u < 3) {
    b /= 1024;
    ++u;
  }
  std::ostringstream s;
  if (b == std::floor(b)) s << static_cast<long long>(b) << " " << units[u];
  else s << std::fixed << std::setprecision(1) << b << " " << units[u];
  return s.str();
}

/// Fixed-precision number formatting.
inline std::string fmt(double v, int prec = 2) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(prec) << v;
  return s.str();
}

/// A Markdown table printed by rank 0 (readable on a terminal, pasted into the docs as is).
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string str() const {
    std::vector<std::size_t> w(header_.size(), 3);
    for (std::size_t c = 0; c < header_.size(); ++c) w[c] = std::max(w[c], header_[c].size());
    for (auto& r : rows_)
      for (std::size_t c = 0; c < r.size() && c < w.size(); ++c) w[c] = std::max(w[c], r[c].size());
    std::ostringstream s;
    auto line = [&](const std::vector<std::string>& r) {
      s << "|";
      for (std::size_t c = 0; c < w.size(); ++c) {
        const std::string cell = c < r.size() ? r[c] : "";
        // Text left, numbers right, as a reader scans them.
        const bool num = !cell.empty() && (std::isdigit(static_cast<unsigned char>(cell[0])) ||
                                           cell[0] == '-' || cell[0] == '+');
        s << " " << (num ? std::right : std::left) << std::setw(static_cast<int>(w[c])) << cell << " |";
      }
      s << "\n";
    };
    line(header_);
    s << "|";
    for (auto x : w) s << std::string(x + 2, '-') << "|";
    s << "\n";
    for (auto& r : rows_) line(r);
    return s.str();
  }
  void print() const {
    if (world_rank() == 0) std::printf("%s\n", str().c_str());
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

/// A JSON document under construction (nlohmann::json, keys in insertion order): objects and
/// arrays of numbers, strings and booleans, built by chained set() / push(). Non-finite numbers
/// are written as null; strings are escaped by the library (control characters included).
class Json {
 public:
  static Json object() { return Json(nlohmann::ordered_json::object()); }
  static Json array() { return Json(nlohmann::ordered_json::array()); }

  template <class T>
  Json& set(const std::string& k, const T& v) {
    doc_[k] = v;
    return *this;
  }
  Json& set(const std::string& k, const Json& v) {
    doc_[k] = v.doc_;
    return *this;
  }
  Json& push(const Json& v) {
    doc_.push_back(v.doc_);
    return *this;
  }
  Json& push(double v) {
    doc_.push_back(v);
    return *this;
  }

  /// One line of JSON; bytes that are not UTF-8 (in a library's version string, say) are
  /// written as U+FFFD rather than failing the run.
  std::string str() const { return doc_.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace); }

  /// Writes the document (rank 0 only) if path is non-empty.
  void write(const std::string& path) const {
    if (path.empty() || world_rank() != 0) return;
    std::ofstream out(path);
    if (!out) throw std::runtime_error("cannot write " + path);
    out << str() << "\n";
  }

 private:
  explicit Json(nlohmann::ordered_json doc) : doc_(std::move(doc)) {}
  nlohmann::ordered_json doc_;
};

/// Machine and run description shared by every JSON file.
inline Json run_info(const std::string& bench_name) {
  Json j = Json::object();
  j.set("bench", bench_name).set("ranks", world_size());
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string v(version, static_cast<std::size_t>(len));
  if (auto nl = v.find('\n'); nl != std::string::npos) v.resize(nl);
  while (!v.empty() && (v.back() == '\0' || v.back() == ',' || v.back() == ' ')) v.pop_back();
  j.set("mpi", v);
  if (const char* c = std::getenv("LOCKSTEP_CHECK")) j.set("LOCKSTEP_CHECK", c);
  return j;
}

/// Picks an iteration count so one timed block lasts about `target_s` given one call's cost.
inline int iters_for(double one_call_s, double target_s) {
  if (one_call_s <= 0) return 1000;
  return std::clamp(static_cast<int>(target_s / one_call_s), 1, 100000);
}

}  // namespace bench
