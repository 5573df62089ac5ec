// Lockstep's exception hierarchy and the check macros used throughout the library.
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace lockstep {

/// Base of every exception Lockstep throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// An MPI call returned an error; code() is the MPI error code.
class MpiError : public Error {
 public:
  MpiError(const std::string& what, int code) : Error(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

/// A CUDA runtime or cuBLAS call failed; code() is the library's error code.
class CudaError : public Error {
 public:
  CudaError(const std::string& what, int code) : Error(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

/// An NCCL call failed; code() is the ncclResult_t value.
class NcclError : public Error {
 public:
  NcclError(const std::string& what, int code) : Error(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

/// The feature asked for was not compiled into this build (for example a CUDA tensor without
/// LOCKSTEP_WITH_CUDA).
class NotCompiled : public Error {
 public:
  using Error::Error;
};

/// The caller passed something invalid; thrown before any communication, identically on every rank.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// Ranks disagree about something they must agree on (structure, shapes, dtypes, a collective).
class MismatchError : public Error {
 public:
  using Error::Error;
};

/// A blocking collective did not complete before its deadline.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// A checkpoint file is unreadable, corrupted, truncated, or does not fit what it is loaded into
/// (io/checkpoint.hpp).
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// A remote call failed on the rank that ran it (remote.hpp): the function threw, is not
/// registered there, has another signature there, or its arguments did not decode there.
/// rank() is the rank that ran it, function() the registered name, message() that rank's text.
class RemoteError : public Error {
 public:
  RemoteError(int rank, std::string function, std::string message)
      : Error("remote call of '" + function + "' on rank " + std::to_string(rank) +
              " failed: " + message),
        rank_(rank),
        function_(std::move(function)),
        message_(std::move(message)) {}
  int rank() const noexcept { return rank_; }
  const std::string& function() const noexcept { return function_; }
  const std::string& message() const noexcept { return message_; }

 private:
  int rank_;
  std::string function_, message_;
};

namespace detail {

/// "file.cpp:88" from a source location, without the directory.
std::string where(const std::source_location& loc);

/// " [rank r/n]" when MPI is initialised, "" otherwise.
std::string rank_suffix();

/// Builds a message from streamable parts.
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

[[noreturn]] void throw_invalid(const std::string& msg,
                                const std::source_location& loc = std::source_location::current());

}  // namespace detail
}  // namespace lockstep

/// Throws lockstep::InvalidArgument naming file:line and rank when `cond` is false.
#define LOCKSTEP_CHECK_ARG(cond, ...)                                                   \
  do {                                                                                  \
    if (!(cond)) ::lockstep::detail::throw_invalid(::lockstep::detail::concat(__VA_ARGS__)); \
  } while (0)

