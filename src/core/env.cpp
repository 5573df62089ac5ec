// The one parser of LOCKSTEP_* environment variables (env.hpp).
#include "core/env.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "lockstep/core/errors.hpp"

namespace lockstep::detail::env {

namespace {
std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
[[noreturn]] void bad(const char* name, const std::string& value, const std::string& expected) {
  throw InvalidArgument(concat(name, "=\"", value, "\": expected ", expected));
}
}  // namespace

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

bool parse_bool(const char* name, const std::string& value) {
  const std::string v = lower(value);
  if (v == "1" || v == "on" || v == "true" || v == "yes") return true;
  if (v == "0" || v == "off" || v == "false" || v == "no") return false;
  bad(name, value, "1, 0, on, off, true, false, yes or no");
}

std::uint64_t parse_bytes(const char* name, const std::string& value, std::uint64_t lo, std::uint64_t hi) {
  const std::string expected = concat("a byte count from ", bytes_string(lo), " to ", bytes_string(hi),
                                      " (digits, optionally followed by k, m or g for KiB, MiB, GiB)");
  std::size_t i = 0;
  while (i < value.size() && std::isdigit(static_cast<unsigned char>(value[i]))) ++i;
  if (i == 0 || i > 19) bad(name, value, expected);
  errno = 0;
  const unsigned long long digits = std::strtoull(value.substr(0, i).c_str(), nullptr, 10);
  if (errno == ERANGE) bad(name, value, expected);
  const std::string suffix = lower(value.substr(i));
  int shift = 0;
  if (suffix.empty() || suffix == "b") shift = 0;
  else if (suffix == "k" || suffix == "kib" || suffix == "kb") shift = 10;
  else if (suffix == "m" || suffix == "mib" || suffix == "mb") shift = 20;
  else if (suffix == "g" || suffix == "gib" || suffix == "gb") shift = 30;
  else bad(name, value, expected);
  if (digits > (std::numeric_limits<std::uint64_t>::max() >> shift)) bad(name, value, expected);
  const std::uint64_t bytes = static_cast<std::uint64_t>(digits) << shift;
  if (bytes < lo || bytes > hi) bad(name, value, expected);
  return bytes;
}

double parse_seconds(const char* name, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const double t = std::strtod(value.c_str(), &end);
  if (end == value.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(t) || t < 0)
    bad(name, value, "a number of seconds >= 0 (0 turns it off)");
  return t;
}

std::int64_t parse_int(const char* name, const std::string& value, std::int64_t lo, std::int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (end == value.c_str() || *end != '\0' || errno == ERANGE || v < lo || v > hi)
    bad(name, value, concat("an integer from ", lo, " to ", hi));
  return v;
}

std::optional<bool> get_bool(const char* name) {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_bool(name, *v);
}

std::optional<std::uint64_t> get_bytes(const char* name, std::uint64_t lo, std::uint64_t hi) {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_bytes(name, *v, lo, hi);
}

std::optional<double> get_seconds(const char* name) {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_seconds(name, *v);
}

std::optional<std::int64_t> get_int(const char* name, std::int64_t lo, std::int64_t hi) {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_int(name, *v, lo, hi);
}

std::string bytes_string(std::uint64_t b) {
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) return concat(b >> 30, " GiB");
  if (b >= (1ull << 20) && b % (1ull << 20) == 0) return concat(b >> 20, " MiB");
  if (b >= (1ull << 10) && b % (1ull << 10) == 0) return concat(b >> 10, " KiB");
  return concat(b, " bytes");
}

}  // namespace lockstep::detail::env
