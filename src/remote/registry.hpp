// Remote calls, internal: looking a registered function up by its name (the serving side).
#pragma once

#include <optional>
#include <string>

#include "lockstep/remote/detail/registry.hpp"

namespace lockstep::detail::remote {

/// The registration under `name`, if any.
std::optional<FnInfo> find_by_name(const std::string& name);

}  // namespace lockstep::detail::remote
