// Remote calls: the table of registered functions (LOCKSTEP_REMOTE, register_remote), by name
// and by function pointer.
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "lockstep/remote/detail/registry.hpp"
#include "remote/registry.hpp"

namespace lockstep::detail::remote {

namespace {
struct Registry {
  std::mutex mu;
  std::map<std::string, FnInfo> by_name;
  std::map<const void*, std::string> by_fn;
};
Registry& registry() {
  static Registry r;
  return r;
}
}  // namespace

std::optional<FnInfo> find_by_name(const std::string& name) {
  auto& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) return std::nullopt;
  return it->second;
}

void register_fn(const std::string& name, std::string sig, const void* fn, Invoke invoke) {
  auto& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.by_name.find(name);
  if (it != r.by_name.end()) {
    if (it->second.fn == fn) return;
    throw InvalidArgument(concat("register_remote: the name '", name,
                                 "' is already registered for another function"));
  }
  r.by_name[name] = FnInfo{name, std::move(sig), fn, invoke};
  r.by_fn[fn] = name;
}

bool unregister_fn(const std::string& name) {
  auto& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) return false;
  r.by_fn.erase(it->second.fn);
  r.by_name.erase(it);
  return true;
}

std::optional<FnInfo> find_fn(const void* fn) {
  auto& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.by_fn.find(fn);
  if (it == r.by_fn.end()) return std::nullopt;
  return r.by_name.at(it->second);
}

}  // namespace lockstep::detail::remote
