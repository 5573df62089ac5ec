// Internal (never installed): the drains of a backend's communication threads. Collectives
// queued on a communication thread (GradientReducer's) must complete before any other collective
// on the same backend starts, so that every rank issues them in the same order: the front end of
// every collective (backend.cpp) calls the drains registered for its backend, except on a
// communication thread itself.
#pragma once

#include <functional>

namespace lockstep {

class Backend;

namespace detail {
/// Registers `drain` for `backend`; `key` identifies the registration.
void register_drain(const Backend* backend, const void* key, std::function<void()> drain);
void unregister_drain(const void* key) noexcept;
/// Runs the drains registered for `backend` (nothing when there are none, or on a
/// communication thread).
void drain_pending(const Backend* backend);
/// Set on a communication thread: its collectives do not wait for themselves (backend.cpp).
extern thread_local bool t_on_comm_thread;
}  // namespace detail

}  // namespace lockstep
