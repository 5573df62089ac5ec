// Rotating checkpoints (checkpoint.hpp, "Rotating checkpoints for restarts"): numbered files,
// the pointer STEM.latest to the newest complete one, the removal of older ones only after the
// pointer moved, and committed checkpoints newer than the step committed set aside, never
// destroyed in silence.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
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

constexpr std::string_view kStaged = ".staged";

/// The step STEM.latest names, or nullopt when there is no pointer or it cannot be read or
/// parsed (the callers then take every numbered file as committed: the safe side).
std::optional<std::int64_t> pointer_step(const std::filesystem::path& pointer, std::string_view stem_name) {
  std::ifstream in(pointer, std::ios::binary);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (text.find('/') != std::string::npos) return std::nullopt;
  const std::int64_t step = step_of(text, stem_name);
  return step < 0 ? std::nullopt : std::optional<std::int64_t>(step);
}

/// Whether a numbered file of `step` was committed: the pointer named it or a later step. With
/// no readable pointer every file counts as committed.
bool committed(std::int64_t step, const std::optional<std::int64_t>& pointer) { return !pointer || step <= *pointer; }

bool same_bytes(const std::filesystem::path& a, const std::filesystem::path& b) {
  std::error_code ec1, ec2;
  const auto na = std::filesystem::file_size(a, ec1), nb = std::filesystem::file_size(b, ec2);
  if (ec1 || ec2 || na != nb) return false;
  std::ifstream fa(a, std::ios::binary), fb(b, std::ios::binary);
  if (!fa || !fb) return false;
  std::vector<char> ba(1 << 20), bb(1 << 20);
  for (;;) {
    fa.read(ba.data(), static_cast<std::streamsize>(ba.size()));
    fb.read(bb.data(), static_cast<std::streamsize>(bb.size()));
    const auto ga = fa.gcount(), gb = fb.gcount();
    if (ga != gb || std::memcmp(ba.data(), bb.data(), static_cast<std::size_t>(ga)) != 0) return false;
    if (ga == 0) return true;  // the sizes are equal: both ended
  }
}

/// Keeps a second name for `file` in `dir` (a hard link; a copy where links are not possible),
/// so that replacing `file` loses nothing. Throws CheckpointError if neither works.
void keep_copy(const std::filesystem::path& file, const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::filesystem::path to = dir / file.filename();
  std::filesystem::create_hard_link(file, to, ec);
  if (!ec) return;
  std::filesystem::copy_file(file, to, std::filesystem::copy_options::overwrite_existing, ec);
  if (ec)
    throw CheckpointError("checkpoint: cannot keep " + file.string() + " in " + dir.string() +
                          " before replacing it: " + ec.message() + "; nothing was committed");
}

std::string pad_step(std::int64_t step) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%06lld", static_cast<long long>(step));
  return digits;
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

CheckpointRotation::CheckpointRotation(const std::filesystem::path& path, int keep, Newer newer)
    : stem_(rotation_stem(path)), keep_(keep), newer_(newer) {
  if (keep < 1)
    throw InvalidArgument("checkpoint rotation: keep must be at least 1 (it is " + std::to_string(keep) + ")");
}

std::filesystem::path CheckpointRotation::path_for(std::int64_t step) const {
  if (step < 0) throw InvalidArgument("checkpoint rotation: negative step " + std::to_string(step));
  return std::filesystem::path(stem_.string() + "-" + pad_step(step) + std::string(kExtension));
}

std::filesystem::path CheckpointRotation::pointer_path() const { return stem_.string() + ".latest"; }

std::filesystem::path CheckpointRotation::set_aside_dir(std::int64_t step) const {
  const std::string base = stem_.string() + ".set-aside-" + pad_step(step);
  std::error_code ec;
  std::filesystem::path dir = base;
  for (int k = 2; std::filesystem::exists(dir, ec); ++k) dir = base + "." + std::to_string(k);
  return dir;
}

std::filesystem::path CheckpointRotation::write_path(std::int64_t step) const {
  const std::filesystem::path file = path_for(step);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) return file;
  if (!committed(step, pointer_step(pointer_path(), stem_.filename().string()))) return file;  // a leftover
  return file.string() + std::string(kStaged);
}

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

void CheckpointRotation::commit(std::int64_t step) const { commit_written(step, path_for(step)); }

void CheckpointRotation::commit_written(std::int64_t step, const std::filesystem::path& written) const {
  const std::filesystem::path file = path_for(step);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(written, ec))
    throw CheckpointError("checkpoint: cannot commit " + file.string() + ": " +
                          (written == file ? std::string("it does not exist") : written.string() + " does not exist"));
  const std::string stem_name = stem_.filename().string();
  const std::optional<std::int64_t> before = pointer_step(pointer_path(), stem_name);  // read before it moves
  std::vector<std::string> moved, removed;
  std::filesystem::path aside;
  const auto aside_dir = [&] {
    if (aside.empty()) aside = set_aside_dir(step);
    return aside;
  };
  if (written != file) {
    // write_path staged the new file beside a committed one of the same step: keep the old one
    // (newer_ permitting) unless it holds the same bytes, then put the new one in its place (one
    // atomic rename, so a pointer naming this step always names a complete file).
    if (std::filesystem::is_regular_file(file, ec) && !same_bytes(file, written)) {
      if (newer_ == Newer::set_aside) keep_copy(file, aside_dir());
      (newer_ == Newer::set_aside ? moved : removed).push_back(file.filename().string());
    }
    std::filesystem::rename(written, file, ec);
    if (ec)
      throw CheckpointError("checkpoint: cannot move " + written.string() + " to " + file.string() + ": " +
                            ec.message() + "; nothing was committed");
  }
  const std::string line = file.filename().string() + "\n";
  write_file_atomically(pointer_path(), std::as_bytes(std::span<const char>(line.data(), line.size())));
  // The pointer has moved: prune. Keep the `keep_` newest at or below `step`; above it, set
  // aside (or remove, as newer_ says) what was committed, remove what never was.
  const auto all = files();
  int kept = 0;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    const auto& [s, path] = *it;
    if (s <= step) {
      if (kept < keep_) {
        ++kept;
        continue;
      }
    } else if (committed(s, before)) {
      if (newer_ == Newer::remove) {
        if (std::filesystem::remove(path, ec) && !ec) removed.push_back(path.filename().string());
        continue;
      }
      std::filesystem::create_directories(aside_dir(), ec);
      std::filesystem::rename(path, aside_dir() / path.filename(), ec);
      if (!ec) moved.push_back(path.filename().string());
      continue;  // a file that cannot be moved stays where it is
    }
    std::filesystem::remove(path, ec);  // best effort: a file left is removed next time
  }
  // Staged files of other saves were never committed (their writer was killed before it).
  for (std::filesystem::directory_iterator it(dir_of(stem_), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (ends_with(name, kStaged) && step_of(name.substr(0, name.size() - kStaged.size()), stem_name) >= 0) {
      std::error_code rec;
      std::filesystem::remove(it->path(), rec);
    }
  }
  if (moved.empty() && removed.empty()) return;
  std::sort(moved.begin(), moved.end());
  std::sort(removed.begin(), removed.end());
  const auto list = [](const std::vector<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
  };
  std::string msg = "lockstep: checkpoint rotation: committed " + file.filename().string() +
                    " below checkpoints of an earlier run (resumed from an older checkpoint?): ";
  if (!moved.empty())
    msg += "set aside, not deleted: " + list(moved) + " in " + aside.string() +
           " (CheckpointRotation::Newer::remove deletes them instead)";
  else
    msg += "deleted (CheckpointRotation::Newer::remove): " + list(removed);
  std::cerr << msg << detail::rank_suffix() << std::endl;
}

}  // namespace lockstep
