// Consensus helpers for collective operations made of several steps (checkpoints, the
// reducer's setup, the LibTorch adapter): every rank states its verdict on its own inputs, and
// either every rank goes on or every rank throws the same error; the root's strings reach every
// rank. All of them are collectives over any Backend.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep::detail {

/// Message of the exception being handled, for broadcasting (never empty).
std::string current_error_message();
/// One rank's verdict on a collective's inputs: the error it would throw (kind none: fine), of a
/// kind that travels with its text alone (text_kind, core/errors.hpp).
struct Verdict {
  using Kind = ErrorKind;
  Kind kind = Kind::none;
  std::string message;
};
/// The Verdict of the exception being handled.
Verdict current_verdict();
/// Runs f() and returns its failure as a Verdict (kind none if it returned).
template <class F>
Verdict verdict_of(F&& f) {
  try {
    f();
    return {};
  } catch (...) {
    return current_verdict();
  }
}

/// Collective (one allgather; one broadcast more when a rank failed). Every rank passes the root
/// it was given, its verdict and a signature (0 if unused). Throws on every rank the same error
/// if the ranks passed different roots or an invalid root (InvalidArgument), or if any rank's
/// verdict failed (the lowest failing rank's error, of its kind, naming the ranks that failed;
/// `consequence` says what was left undone). Otherwise returns whether every rank passed root's
/// signature.
bool agree(Backend& backend, const char* what, int root, const Verdict& mine, std::uint64_t signature,
           const char* consequence);

/// Root broadcasts `error` (empty: success) to every rank; returns it on every rank.
std::string broadcast_status(Backend& backend, std::string error, int root);

/// Root broadcasts `s` to every rank (length first); returns it on every rank.
std::string broadcast_string(Backend& backend, const std::string& s, int root);

}  // namespace lockstep::detail
