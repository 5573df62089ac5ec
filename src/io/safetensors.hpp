// Internal: what the collective checkpoint (checkpoint.cpp) shares with the safetensors
// reader and writer (safetensors.cpp).
#pragma once

#include <string>
#include <string_view>

namespace lockstep::detail {

/// Throws CheckpointError("checkpoint: " + msg).
[[noreturn]] void fail(const std::string& msg);
/// Whether s is valid UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool valid_utf8(std::string_view s);

}  // namespace lockstep::detail
