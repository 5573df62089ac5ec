// Rotating checkpoints (checkpoint.hpp, "Rotating checkpoints for restarts"): numbered files,
// the pointer STEM.latest to the newest complete one, and the removal of older ones only after
// the pointer moved.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include "lockstep/io/checkpoint.hpp"

namespace lockstep {

namespace {

constexpr std::string_view kExtension = ".safetensors";

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

/// The step of a numbered file name "STEMNAME-DIGITS.safetensors", or -1.
std::int64_t step_of(std::string_view name, std::string_view stem_name) {
  if (name.size() <= stem_name.size() + 1 + kExtension.size()) return -1;
  if (name.substr(0, stem_name.size()) != stem_name || name[stem_name.size()] != '-') return -1;
  if (!ends_with(name, kExtension)) return -1;
  const std::string_view digits =
      name.substr(stem_name.size() + 1, name.size() - stem_name.size() - 1 - kExtension.size());
  if (digits.empty() || digits.size() > 18) return -1;
  std::int64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

std::filesystem::path dir_of(const std::filesystem::path& stem) {
  return stem.has_parent_path() ? stem.parent_path() : std::filesystem::path(".");
}

}  // namespace

std::filesystem::path rotation_stem(const std::filesystem::path& path) {
  if (path.empty()) throw InvalidArgument("checkpoint rotation: the checkpoint path is empty");
  const std::string s = path.string();
  std::error_code ec;
  if (s.back() == '/' || std::filesystem::is_directory(path, ec)) return path / "ck";
  if (ends_with(s, kExtension)) return std::filesystem::path(s.substr(0, s.size() - kExtension.size()));
  return path;
}

std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& path) {
  const std::filesystem::path stem = rotation_stem(path);
  const std::filesystem::path pointer = stem.string() + ".latest";
  std::ifstream in(pointer, std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!std::filesystem::exists(pointer, ec) && !ec) return std::nullopt;
    throw CheckpointError("checkpoint: cannot read the pointer " + pointer.string() + ": " + std::strerror(errno));
  }
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  const std::string stem_name = stem.filename().string();
  if (text.find('/') != std::string::npos || step_of(text, stem_name) < 0)
    throw CheckpointError("checkpoint: the pointer " + pointer.string() + " does not name a checkpoint of " +
                          stem.string() + " (it holds \"" + text.substr(0, 80) + "\")");
  const std::filesystem::path file = dir_of(stem) / text;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec))
    throw CheckpointError("checkpoint: the pointer " + pointer.string() + " names " + file.string() +
                          ", which is missing (removed by hand?); remove the pointer to start afresh");
  return file;
}

std::optional<std::filesystem::path> latest_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                       int root) {
  std::string blob;
  if (backend.rank() == root) {
    try {
      const auto p = latest_checkpoint(path);
      std::string reply(1, p ? 'P' : 'N');
      if (p) reply.append(p->native());
      blob.swap(reply);
    } catch (...) {
      blob = "E" + detail::current_error_message();
    }
  }
  blob = detail::broadcast_string(backend, blob, root);
  if (blob.empty() || blob[0] == 'E')
    detail::throw_root_error(backend, blob.empty() ? std::string("checkpoint: empty reply from the root") : blob.substr(1),
                             root);
  if (blob[0] == 'N') return std::nullopt;
  return std::filesystem::path(blob.substr(1));
}

CheckpointRotation::CheckpointRotation(const std::filesystem::path& path, int keep)
    : stem_(rotation_stem(path)), keep_(keep) {
  if (keep < 1)
    throw InvalidArgument("checkpoint rotation: keep must be at least 1 (it is " + std::to_string(keep) + ")");
}

std::filesystem::path CheckpointRotation::path_for(std::int64_t step) const {
  if (step < 0) throw InvalidArgument("checkpoint rotation: negative step " + std::to_string(step));
  char digits[32];
  std::snprintf(digits, sizeof digits, "-%06lld", static_cast<long long>(step));
  return std::filesystem::path(stem_.string() + digits + std::string(kExtension));
}

std::filesystem::path CheckpointRotation::pointer_path() const { return stem_.string() + ".latest"; }

std::vector<std::pair<std::int64_t, std::filesystem::path>> CheckpointRotation::files() const {
  std::vector<std::pair<std::int64_t, std::filesystem::path>> out;
  const std::string stem_name = stem_.filename().string();
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir_of(stem_), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::int64_t step = step_of(name, stem_name);
    if (step >= 0) out.emplace_back(step, it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool CheckpointRotation::create_directory() const noexcept {
  std::error_code ec;
  std::filesystem::create_directories(dir_of(stem_), ec);
  return !ec;
}

void CheckpointRotation::commit(std::int64_t step) const {
  const std::filesystem::path file = path_for(step);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec))
    throw CheckpointError("checkpoint: cannot commit " + file.string() + ": it does not exist");
  const std::string line = file.filename().string() + "\n";
  write_file_atomically(pointer_path(), std::as_bytes(std::span<const char>(line.data(), line.size())));
  // The pointer has moved: prune. Keep the `keep_` newest at or below `step`.
  const auto all = files();
  int kept = 0;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->first <= step && kept < keep_) {
      ++kept;
      continue;
    }
    std::filesystem::remove(it->second, ec);  // best effort: a file left is removed next time
  }
}

}  // namespace lockstep
