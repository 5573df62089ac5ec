// Internal: atomic writes of whole files (atomic_file.cpp), for the safetensors writer.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

namespace lockstep::detail {

/// Closes a file descriptor on scope exit (errors at close are checked explicitly where they
/// matter, before this runs).
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

/// "checkpoint: WHAT PATH: strerror(errno)".
std::string os_error(const std::string& what, const std::filesystem::path& p);

/// Writes a new file at `path` atomically: `body(fd, name)` writes the contents into a temporary
/// file in the same directory, which is then fsynced and renamed over `path`, and the directory
/// is fsynced. If anything fails (body included), the temporary file is removed, the old file
/// is untouched and the error is thrown. The temporary file is named after its writer and
/// flock-ed while written, so that a later save removes it only if its writer is dead.
void write_atomically(const std::filesystem::path& path,
                      const std::function<void(int fd, const std::string& name)>& body);

}  // namespace lockstep::detail
