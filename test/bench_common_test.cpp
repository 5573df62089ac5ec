// The benchmarks' shared helpers that need no timing (bench/bench_common.hpp): the JSON document
// (escaping, numbers, key order) and the common flags (--quick defaults, a bad value refused).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"

TEST_CASE("bench::Json escapes control characters, quotes and backslashes") {
  const std::string nasty = std::string("tab\there, newline\n, bell\a, nul") + '\0' + "\x1f" + " \"q\" \\ end";
  const std::string s = bench::Json::object().set("mpi", nasty).str();
  // No raw control character may remain in the text: each is written as an escape.
  for (char c : s) CHECK(static_cast<unsigned char>(c) >= 0x20);
  CHECK(s.find("\\t") != std::string::npos);
  CHECK(s.find("\\n") != std::string::npos);
  CHECK(s.find("\\u0007") != std::string::npos);
  CHECK(s.find("\\u0000") != std::string::npos);
  CHECK(s.find("\\u001f") != std::string::npos);
  // And it reads back as the same string.
  CHECK(nlohmann::json::parse(s).at("mpi").get<std::string>() == nasty);
}

TEST_CASE("bench::Json keeps key order, writes non-finite numbers as null, nests") {
  auto rows = bench::Json::array();
  rows.push(bench::Json::object().set("bytes", std::int64_t{1} << 40).set("ok", true));
  rows.push(std::numeric_limits<double>::quiet_NaN());
  rows.push(0.1);
  const std::string s = bench::Json::object().set("z", 1).set("a", "x").set("rows", rows).str();
  CHECK(s == R"({"z":1,"a":"x","rows":[{"bytes":1099511627776,"ok":true},null,0.1]})");
}

TEST_CASE("bench::Json survives bytes that are not UTF-8") {
  const std::string s = bench::Json::object().set("mpi", std::string("Open MPI \xff\xfe")).str();
  CHECK(nlohmann::json::parse(s).at("mpi").get<std::string>() == "Open MPI \xEF\xBF\xBD\xEF\xBF\xBD");
}

namespace {
// Parses `args` (after the program name) with the common flags plus one of a benchmark's own.
struct Parsed {
  std::optional<int> rc;
  std::size_t max_bytes = 1024;
  int reps = 0;
};
Parsed parse(std::vector<std::string> args) {
  bench::Options opt("bench_test", "test");
  Parsed p;
  auto* flag = opt.app.add_option("--max-bytes", p.max_bytes, "largest message")->check(lockstep_cli::at_least(8));
  std::vector<char*> argv = {const_cast<char*>("bench_test")};
  for (auto& a : args) argv.push_back(a.data());
  p.rc = opt.parse(static_cast<int>(argv.size()), argv.data());
  opt.quick_default(p.max_bytes, flag, 16);
  p.reps = opt.quick_reps();
  return p;
}
}  // namespace

TEST_CASE("bench::Options: --quick changes only the defaults of flags not given") {
  auto p = parse({"--quick"});
  CHECK(!p.rc);
  CHECK(p.max_bytes == 16);
  CHECK(p.reps == 3);
  p = parse({"--quick", "--max-bytes", "64", "--reps", "2"});
  CHECK(!p.rc);
  CHECK(p.max_bytes == 64);
  CHECK(p.reps == 2);
  p = parse({"--reps", "9"});
  CHECK(p.max_bytes == 1024);
  CHECK(p.reps == 9);
}

TEST_CASE("bench::Options: a bad or unknown flag ends with status 2, --help with 0") {
  CHECK(parse({"--max-bytes", "4"}).rc == 2);
  CHECK(parse({"--reps", "x"}).rc == 2);
  CHECK(parse({"--no-such-flag", "1"}).rc == 2);
  CHECK(parse({"--help"}).rc == 0);
}

TEST_CASE("lockstep_cli::parse: a check across flags that throws refuses the command line") {
  int a = 0, b = 0;
  auto parse_ab = [&](std::vector<std::string> args) {
    lockstep_cli::App app("cli_test", "test");
    app.add_option("--a", a, "a");
    app.add_option("--b", b, "b");
    app.callback([&] {
      if (a > b) throw lockstep_cli::refused("--a", "must not exceed --b");
      if (a < 0) throw std::runtime_error("a plain exception from a program's own check");
    });
    std::vector<char*> argv = {const_cast<char*>("cli_test")};
    for (auto& s : args) argv.push_back(s.data());
    return lockstep_cli::parse(app, static_cast<int>(argv.size()), argv.data());
  };
  CHECK(!parse_ab({"--a", "1", "--b", "2"}));
  CHECK(a == 1);
  CHECK(b == 2);
  CHECK(parse_ab({"--a", "3", "--b", "2"}) == 2);
  CHECK(parse_ab({"--a", "-1", "--b", "2"}) == 2);
  // A flag given twice keeps its last value, as the hand-written parsers did.
  CHECK(!parse_ab({"--a", "5", "--a", "1", "--b", "2"}));
  CHECK(a == 1);
}
