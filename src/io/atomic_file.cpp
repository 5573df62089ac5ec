// Atomic file writes (atomic_file.hpp): a temporary file in the same directory, fsynced and
// renamed over the old file, and the removal of dead writers' temporary files.
#include "io/atomic_file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "lockstep/io/checkpoint.hpp"

namespace lockstep {

std::string detail::os_error(const std::string& what, const std::filesystem::path& p) {
  return "checkpoint: " + what + " " + p.string() + ": " + std::strerror(errno);
}

using detail::Fd;
using detail::os_error;

// Temporary files. A writer killed between mkstemp and rename leaves its temporary file behind;
// the next successful save of the same path removes such leftovers. Other writers may be saving
// the same path at the same time, though (two jobs, two threads), and deleting a live writer's
// temporary file makes its rename fail. So a temporary file is named after its writer,
// ".NAME.tmp.PID.HOST.XXXXXX", and its writer holds an flock on it until the rename; a leftover is
// removed only when it is provably dead: written on this host, by a process that no longer
// exists (kill(pid, 0) fails with ESRCH), and its flock is free. Anything else (another host's,
// a live process's, a name of another form) is left alone.
namespace {

/// This host's name as it appears in temporary file names: [A-Za-z0-9-] only, at most 32
/// characters; a longer or rewritten name becomes a prefix and a hash of the full name.
const std::string& host_token() {
  static const std::string token = [] {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') std::strcpy(buf, "unknown-host");
    const std::string host = buf;
    std::string t;
    bool rewritten = false;
    for (char c : host) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
      t += ok ? c : '_';
      rewritten = rewritten || !ok;
    }
    if (!rewritten && t.size() <= 32) return t;
    char hex[24];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(detail::hash_bytes(host.data(), host.size())));
    return t.substr(0, 15) + "~" + hex;
  }();
  return token;
}

/// ".NAME.tmp." for `path`: what every temporary file of that path starts with. A long NAME is
/// shortened to a prefix and a hash, so that the temporary name (about 60 characters more) stays
/// within the 255 bytes a file name may have wherever NAME itself does.
std::string temp_prefix(const std::filesystem::path& path) {
  const std::string name = path.filename().string();
  // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) about "." + name.
  std::string out(1, '.');
  if (name.size() <= 150) {
    out.append(name);
  } else {
    char hex[24];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(detail::hash_bytes(name.data(), name.size())));
    out.append(name, 0, 100).append(1, '~').append(hex);
  }
  return out.append(".tmp.");
}

/// Whether `rest` (a temporary file name after temp_prefix) is "PID.HOST.XXXXXX" of a process of
/// this host that no longer exists.
bool written_by_dead_local_process(std::string_view rest) {
  const std::size_t dot1 = rest.find('.');
  const std::size_t dot2 = rest.rfind('.');
  if (dot1 == std::string_view::npos || dot1 == dot2 || rest.size() - dot2 - 1 != 6) return false;
  const std::string_view pid_text = rest.substr(0, dot1);
  if (pid_text.empty() || pid_text.size() > 9 || pid_text.find_first_not_of("0123456789") != std::string_view::npos)
    return false;
  if (rest.substr(dot1 + 1, dot2 - dot1 - 1) != host_token()) return false;
  const pid_t pid = static_cast<pid_t>(std::stol(std::string(pid_text)));
  if (pid <= 0 || pid == ::getpid()) return false;  // this process's are other threads' live files
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

void remove_stale_temporaries(const std::filesystem::path& path) {
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  const std::string prefix = temp_prefix(path);
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    if (!written_by_dead_local_process(std::string_view(name).substr(prefix.size()))) continue;
    // Never block here (O_NONBLOCK: a FIFO of that name), never follow a link, and delete only a
    // regular file whose lock is free (its writer, even in another PID namespace, is gone).
    Fd c;
    c.fd = ::open(it->path().c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
    if (c.fd < 0) continue;
    struct stat st {};
    if (::fstat(c.fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::flock(c.fd, LOCK_EX | LOCK_NB) != 0) continue;
    ::unlink(it->path().c_str());
  }
}

}  // namespace

std::string detail::temporary_file_prefix(const std::filesystem::path& path, long pid) {
  return temp_prefix(path) + std::to_string(pid) + "." + host_token() + ".";
}


void detail::write_atomically(const std::filesystem::path& path,
                              const std::function<void(int fd, const std::string& name)>& body) {
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  std::string tmpl = (dir / (detail::temporary_file_prefix(path, ::getpid()) + "XXXXXX")).string();
  Fd f;
  f.fd = ::mkstemp(tmpl.data());
  if (f.fd < 0) throw CheckpointError(os_error("cannot create a temporary file in", dir));
  // The lock says "this writer is alive" to other writers' cleanup until the rename is done. It
  // belongs to the open file, so a duplicate descriptor keeps it while `f` is closed (and its
  // close checked) before the rename. Best effort: a file system without flock still has the
  // pid check.
  (void)::flock(f.fd, LOCK_EX | LOCK_NB);
  Fd lock;
  lock.fd = ::dup(f.fd);
  // From here on, any failure removes the temporary file so no debris is left behind.
  auto fail_with = [&](const std::string& msg) {
    ::unlink(tmpl.c_str());
    throw CheckpointError(msg);
  };
  try {
    body(f.fd, static_cast<const std::string&>(tmpl));
  } catch (...) {
    ::unlink(tmpl.c_str());
    throw;
  }
  if (::fchmod(f.fd, 0644) != 0) fail_with(os_error("cannot chmod", tmpl));
  if (::fsync(f.fd) != 0) fail_with(os_error("cannot fsync", tmpl));
  const int fd = std::exchange(f.fd, -1);
  if (::close(fd) != 0) fail_with(os_error("cannot close", tmpl));
  if (::rename(tmpl.c_str(), path.c_str()) != 0) fail_with(os_error("cannot rename the temporary file to", path));
  if (lock.fd >= 0) ::close(std::exchange(lock.fd, -1));
  // The rename is durable only once the directory entry is on disk.
  Fd d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd < 0 || ::fsync(d.fd) != 0) throw CheckpointError(os_error("cannot fsync directory", dir));
  remove_stale_temporaries(path);
}

}  // namespace lockstep
