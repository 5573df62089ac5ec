// Internal: the one parser of Lockstep's environment variables (LOCKSTEP_*). Every variable is
// read through these functions, which accept exactly the documented forms and throw
// InvalidArgument naming the variable, the value and what was expected otherwise: nothing is
// silently ignored, clamped or half-parsed.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

namespace lockstep::detail::env {

/// The variable's value, or nullopt when it is unset or empty.
std::optional<std::string> get(const char* name);

/// 1/0, on/off, true/false, yes/no (any case).
std::optional<bool> get_bool(const char* name);

/// A byte count: digits with an optional binary suffix k/K/KiB, m/M/MiB, g/G/GiB; within
/// [lo, hi] (inclusive).
std::optional<std::uint64_t> get_bytes(const char* name, std::uint64_t lo, std::uint64_t hi);

/// A finite number of seconds >= 0.
std::optional<double> get_seconds(const char* name);

/// A non-negative integer within [lo, hi].
std::optional<std::int64_t> get_int(const char* name, std::int64_t lo, std::int64_t hi);

/// Parsers of one value (the functions above read the variable and call these); `name` is the
/// variable, for the message.
bool parse_bool(const char* name, const std::string& value);
std::uint64_t parse_bytes(const char* name, const std::string& value, std::uint64_t lo, std::uint64_t hi);
double parse_seconds(const char* name, const std::string& value);
std::int64_t parse_int(const char* name, const std::string& value, std::int64_t lo, std::int64_t hi);

/// "4 KiB", "1 MiB", "123 bytes".
std::string bytes_string(std::uint64_t b);

}  // namespace lockstep::detail::env
