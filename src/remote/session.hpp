// Remote calls, internal: the table of sessions (one per backend), and creating and closing one.
#pragma once

#include <memory>

#include "lockstep/comm/backend.hpp"
#include "lockstep/remote/remote.hpp"

namespace lockstep::detail::remote {

struct Engine;

/// The session of b, or nullptr.
std::shared_ptr<Engine> find_engine(const Backend& b);
/// The session of b; InvalidArgument naming how to make one when b has none.
std::shared_ptr<Engine> engine_of(const Backend& b);
/// Collective: a new session on b (session.cpp).
std::shared_ptr<Engine> create_engine(Backend& b, const RemoteOptions& o);
/// Takes e out of the table of sessions (when it is still the session of its backend).
void forget_engine(const std::shared_ptr<Engine>& e);
/// Collective: ends the session of e (close.cpp).
void close_engine(const std::shared_ptr<Engine>& e, bool quiet, double wait = -1);

}  // namespace lockstep::detail::remote
