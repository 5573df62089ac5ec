// The settings of reliability (settings.hpp): every LOCKSTEP_* variable the collectives read,
// parsed once by the strict parser of core/env.hpp, and the setters that override them.
#include "lockstep/reliability/settings.hpp"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cmath>
#include <mutex>
#include <string>

#include "lockstep/core/errors.hpp"
#include "core/env.hpp"
#include "reliability/settings_state.hpp"
#ifndef LOCKSTEP_FAULT_INJECTION
#error "LOCKSTEP_FAULT_INJECTION (0 or 1) must be defined: cmake/LockstepLayers.cmake sets it"
#endif
#if LOCKSTEP_FAULT_INJECTION
#include "reliability/fault.hpp"
#endif

namespace lockstep {
namespace detail {

Settings g_settings;

namespace {

void update_quiet(Settings& s) {
  std::lock_guard lock(s.quiet_mutex);
  s.quiet.store(s.level.load() == CheckLevel::off && !(s.timeout_chosen.load() && s.timeout_s.load() > 0));
}

// LOCKSTEP_STRAGGLER_WARN and _INTERVAL: "off" or "0" -> 0; "N%" (WARN only) -> -N/100, a
// fraction of the deadline; a number of seconds >= 0.
double straggler_setting(const char* var, const std::string& v, bool percent_ok) {
  if (v == "off") return 0;
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  const bool percent = percent_ok && end != nullptr && *end == '%' && end[1] == '\0';
  if (v.empty() || errno != 0 || end == v.c_str() || (!percent && *end != '\0') || !(x >= 0) || x > 1e9 ||
      (percent && x > 100) || std::isspace(static_cast<unsigned char>(v[0])))
    throw InvalidArgument(detail::concat(var, "=\"", v, "\": expected off or a number of seconds >= 0",
                                         percent_ok ? ", or a percentage of LOCKSTEP_TIMEOUT such as 25%" : ""));
  return percent ? -x / 100.0 : x;
}

void read_environment(Settings& s) {
  namespace env = detail::env;
  if (auto v = env::get("LOCKSTEP_STRAGGLER_WARN")) s.straggler_warn = straggler_setting("LOCKSTEP_STRAGGLER_WARN", *v, true);
  if (auto v = env::get("LOCKSTEP_STRAGGLER_INTERVAL"))
    s.straggler_interval = straggler_setting("LOCKSTEP_STRAGGLER_INTERVAL", *v, false);
  if (auto v = env::get("LOCKSTEP_CHECK")) {
    std::string low = *v;
    for (auto& c : low) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const std::string level = low.substr(0, low.find(':'));
    const bool has_n = low.find(':') != std::string::npos;
    if (level == "off" && !has_n) s.level = CheckLevel::off;
    else if (level == "first") s.level = CheckLevel::first;
    else if (level == "always" && !has_n) s.level = CheckLevel::always;
    else
      throw InvalidArgument(detail::concat("LOCKSTEP_CHECK=\"", *v, "\": expected off, first, first:N or always"));
    if (has_n)
      s.first_calls = static_cast<int>(env::parse_int("LOCKSTEP_CHECK (N of first:N)", low.substr(low.find(':') + 1),
                                                      1, 1000000));
  }
  if (auto t = env::get_seconds("LOCKSTEP_TIMEOUT")) {
    s.timeout_s = *t;
    s.timeout_chosen = *t > 0;
  }
  if (auto v = env::get("LOCKSTEP_TIMEOUT_ACTION")) {
    if (*v == "throw") s.action = TimeoutAction::throw_error;
    else if (*v == "abort") s.action = TimeoutAction::abort;
    else throw InvalidArgument(detail::concat("LOCKSTEP_TIMEOUT_ACTION=\"", *v, "\": expected throw or abort"));
  }
  s.shm = env::get_bool("LOCKSTEP_SHM");
  s.shm_slice = env::get_bytes("LOCKSTEP_SHM_SLICE_BYTES", 4096, std::uint64_t{64} << 20);
  if (s.shm_slice && *s.shm_slice % 64 != 0)
    throw InvalidArgument(detail::concat("LOCKSTEP_SHM_SLICE_BYTES=\"", *env::get("LOCKSTEP_SHM_SLICE_BYTES"),
                                         "\": expected a multiple of 64 bytes"));
  s.shm_min = env::get_bytes("LOCKSTEP_SHM_MIN_BYTES", 0, std::uint64_t{1} << 40);
  s.cuda_aware = env::get_bool("LOCKSTEP_CUDA_AWARE_MPI");
  s.ompi_defaults = env::get_bool("LOCKSTEP_OMPI_DEFAULTS");
  // LOCKSTEP_FAULT is read here too, so that a malformed one, or one that this build cannot
  // honour, stops every rank at initialisation (agree_on_settings) rather than one of them.
#if LOCKSTEP_FAULT_INJECTION
  (void)fault_spec();
#else
  if (auto v = env::get("LOCKSTEP_FAULT"))
    throw InvalidArgument(detail::concat("LOCKSTEP_FAULT=\"", *v,
                                         "\": this build of Lockstep has no fault injection "
                                         "(LOCKSTEP_FAULT_INJECTION=OFF); unset LOCKSTEP_FAULT"));
#endif
}

std::string canonical_settings(const Settings& s) {
  auto opt = [](const auto& o) { return o ? detail::concat(*o) : std::string("unset"); };
  return detail::concat("LOCKSTEP_CHECK=", name(s.level.load()), ":", s.first_calls.load(),
                        " LOCKSTEP_TIMEOUT=", s.timeout_s.load(), s.timeout_chosen ? "" : "(default)",
                        " LOCKSTEP_TIMEOUT_ACTION=", s.action == TimeoutAction::abort ? "abort" : "throw",
                        " LOCKSTEP_SHM=", opt(s.shm), " LOCKSTEP_SHM_SLICE_BYTES=", opt(s.shm_slice),
                        " LOCKSTEP_SHM_MIN_BYTES=", opt(s.shm_min), " LOCKSTEP_CUDA_AWARE_MPI=", opt(s.cuda_aware),
                        " LOCKSTEP_OMPI_DEFAULTS=", opt(s.ompi_defaults), " LOCKSTEP_STRAGGLER_WARN=", s.straggler_warn,
                        " LOCKSTEP_STRAGGLER_INTERVAL=", s.straggler_interval);
}

}  // namespace

// Fills g_settings from the environment, once. A malformed variable is remembered rather than
// thrown here, so that agree_on_settings() can make every rank throw it together; the accessors
// below throw it on the rank that has it.
Settings& loaded_settings() {
  Settings& s = g_settings;
  static std::once_flag once;
  std::call_once(once, [] {
    Settings& g = g_settings;
    try {
      read_environment(g);
    } catch (const InvalidArgument& e) {
      g.env_error = e.what();
    }
    g.canonical = canonical_settings(g);
    update_quiet(g);
  });
  return s;
}

Settings& settings() {
  Settings& s = loaded_settings();
  if (!s.env_error.empty()) throw InvalidArgument(s.env_error);
  return s;
}

}  // namespace detail

using detail::settings;
using detail::update_quiet;

void set_check_level(CheckLevel level, int first_calls) {
  LOCKSTEP_CHECK_ARG(static_cast<int>(level) <= static_cast<int>(CheckLevel::always),
                     "set_check_level: invalid CheckLevel value ", static_cast<int>(level));
  LOCKSTEP_CHECK_ARG(first_calls >= 1, "set_check_level: first_calls must be >= 1, got ", first_calls);
  settings().level = level;
  settings().first_calls = first_calls;
  update_quiet(settings());
}
CheckLevel check_level() { return settings().level; }
int check_first_calls() { return settings().first_calls; }

void set_timeout(double seconds) {
  LOCKSTEP_CHECK_ARG(seconds >= 0 && std::isfinite(seconds),
                     "set_timeout: seconds must be finite and >= 0 (0 disables), got ", seconds);
  settings().timeout_s = seconds;
  settings().timeout_chosen = seconds > 0;
  update_quiet(settings());
}
double timeout() { return settings().timeout_s; }
bool timeout_is_default() { return !settings().timeout_chosen && settings().timeout_s > 0; }

void set_timeout_action(TimeoutAction action) {
  LOCKSTEP_CHECK_ARG(static_cast<int>(action) <= static_cast<int>(TimeoutAction::abort),
                     "set_timeout_action: invalid TimeoutAction value ", static_cast<int>(action));
  settings().action = action;
}
TimeoutAction timeout_action() { return settings().action; }


const char* name(CheckLevel level) noexcept {
  switch (level) {
    case CheckLevel::off: return "off";
    case CheckLevel::first: return "first";
    case CheckLevel::always: return "always";
  }
  return "?";
}

}  // namespace lockstep
