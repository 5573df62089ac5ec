// Lockstep's exception hierarchy and the check macros used throughout the library.
#pragma once

#include <cstdint>
#include <exception>
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

/// The kind of an exception, as one rank tells the others which exception to throw: the one
/// numbering of the consensus helpers (Verdict), parallelize and run_driver, with one
/// classification (error_record) and one rethrow (throw_error).
enum class ErrorKind : std::int32_t {
  none = 0,
  invalid_argument,
  mismatch,
  timeout,
  checkpoint,
  not_compiled,
  mpi,            // carries a code
  cuda,           // carries a code
  nccl,           // carries a code
  remote,         // carries the call's rank, function and message
  error,          // another lockstep::Error
  std_exception,  // a std::exception that is not a lockstep::Error (a user's own)
  unknown         // not a std::exception
};

/// An exception as it travels between ranks: its kind and what(), and what its kind carries
/// beyond the text.
struct ErrorRecord {
  ErrorKind kind = ErrorKind::none;
  std::string what;  // empty for unknown
  int code = 0;      // mpi, cuda, nccl
  int rank = -1;     // remote: the rank that ran the call, its function and that rank's text
  std::string function, message;
};

/// The record of exception `e` (kind none when `e` is null).
ErrorRecord error_record(const std::exception_ptr& e);

/// A transport that carries only a kind and a text (the consensus helpers, parallelize): the
/// kinds that carry more (mpi, cuda, nccl, remote) travel as error.
constexpr ErrorKind text_kind(ErrorKind k) noexcept {
  return k == ErrorKind::mpi || k == ErrorKind::cuda || k == ErrorKind::nccl || k == ErrorKind::remote
             ? ErrorKind::error
             : k;
}

/// Whether `k` is the kind of an exception Lockstep did not throw (std_exception, unknown).
constexpr bool foreign_kind(ErrorKind k) noexcept {
  return k == ErrorKind::std_exception || k == ErrorKind::unknown;
}

/// Throws, on this rank, the exception that `r` describes: the class of its kind with r.what
/// (and its code, or the remote call's rank, function and message); Error for error,
/// std_exception, unknown and none.
[[noreturn]] void throw_error(const ErrorRecord& r);

}  // namespace detail
}  // namespace lockstep

/// Throws lockstep::InvalidArgument naming file:line and rank when `cond` is false.
#define LOCKSTEP_CHECK_ARG(cond, ...)                                                   \
  do {                                                                                  \
    if (!(cond)) ::lockstep::detail::throw_invalid(::lockstep::detail::concat(__VA_ARGS__)); \
  } while (0)

