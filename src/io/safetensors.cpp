// Checkpoint files in the safetensors format, the bytes and the files: the data streamed between
// the tensors' memory and the file through the CRC, writev batches, the atomic write
// (atomic_file.cpp), and the file-level save_checkpoint / load_checkpoint. The header is
// safetensors_header.cpp's, its JSON safetensors_json.cpp's; the collective checkpoint (ranks,
// structures) is checkpoint.cpp's.
#include "io/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "io/atomic_file.hpp"

namespace lockstep {
namespace {

using detail::Fd;
using detail::fail;
using detail::os_error;
using detail::valid_utf8;
using detail::write_atomically;
using namespace detail::st;

/// Copies `n` bytes of element size `elem` converting between native and little-endian order
/// (a plain copy on little-endian machines).
void copy_le(std::byte* dst, const std::byte* src, std::size_t n, std::size_t elem) {
  if (n == 0) return;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(dst, src, n);
  } else {
    for (std::size_t i = 0; i < n; i += elem)
      for (std::size_t k = 0; k < elem; ++k) dst[i + k] = src[i + elem - 1 - k];
  }
}

const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "of an unknown type";
}

[[noreturn]] void not_regular(const std::filesystem::path& path, mode_t m) {
  throw CheckpointError("checkpoint: " + path.string() + " is not a regular file (it is " + file_kind(m) +
                        "); a checkpoint is read only from a regular file");
}


// Pieces of this size are checksummed just before they are written (or just after they are
// read), while they are still in the cache, so that the data crosses memory once.
constexpr std::size_t kPiece = 256u << 10;

/// Byte-swaps elements of `elem` bytes in place (big-endian hosts only: files are little-endian).
[[maybe_unused]] void swap_in_place(std::byte* p, std::size_t n, std::size_t elem) {
  if (elem == 1) return;
  for (std::size_t i = 0; i + elem <= n; i += elem) std::reverse(p + i, p + i + elem);
}

/// Copies n data bytes (tensor memory to file order or back) and extends `crc` over the file's
/// side of them, piece by piece.
void copy_with_crc(std::byte* dst, const std::byte* src, std::size_t n, std::size_t elem, std::uint32_t& crc,
                   bool src_is_file) {
  for (std::size_t off = 0; off < n; off += kPiece) {
    const std::size_t m = std::min(kPiece, n - off);
    if (src_is_file) crc = crc32c(std::span(src + off, m), crc);
    copy_le(dst + off, src + off, m, elem);
    if (!src_is_file) crc = crc32c(std::span<const std::byte>(dst + off, m), crc);
  }
}

/// Queues bytes for the file and hands them to the kernel in batches of up to 1 MiB with one
/// writev: a header and many small tensors cost a few system calls, not one each. Data bytes go
/// through the streaming CRC.
class FileWriter {
 public:
  FileWriter(int fd, const std::string& name) : fd_(fd), name_(name) { iov_.reserve(kMaxIov); }

  /// Bytes that are not data (the header): queued, not checksummed. They must stay alive until
  /// flush().
  void raw(const void* p, std::size_t n) {
    if (n > 0) queue(p, n);
  }

  /// The data of one tensor, from its memory, converted to little-endian order on big-endian hosts.
  void data(const std::byte* p, std::size_t n, std::size_t elem) {
    for (std::size_t off = 0; off < n; off += kPiece) {
      const std::size_t m = std::min(kPiece, n - off);
      if constexpr (std::endian::native == std::endian::little) {
        crc_ = crc32c(std::span(p + off, m), crc_);
        queue(p + off, m);
      } else {
        flush();  // the bounce buffer is reused: write what it held first
        bounce_.resize(m);
        copy_le(bounce_.data(), p + off, m, elem);
        crc_ = crc32c(std::span<const std::byte>(bounce_.data(), m), crc_);
        queue(bounce_.data(), m);
        flush();
      }
    }
  }

  void flush() {
    iovec* v = iov_.data();
    int count = static_cast<int>(iov_.size());
    while (count > 0) {
      const ssize_t w = ::writev(fd_, v, count);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw CheckpointError(os_error("cannot write", name_));
      }
      if (w == 0) {
        errno = EIO;
        throw CheckpointError(os_error("cannot write", name_));
      }
      auto left = static_cast<std::size_t>(w);
      while (count > 0 && left >= v->iov_len) {
        left -= v->iov_len;
        ++v;
        --count;
      }
      if (count > 0) {
        v->iov_base = static_cast<char*>(v->iov_base) + left;
        v->iov_len -= left;
      }
    }
    iov_.clear();
    queued_ = 0;
  }

  std::uint32_t crc() const noexcept { return crc_; }

 private:
  static constexpr std::size_t kMaxIov = 1024;  // IOV_MAX on Linux
  static constexpr std::size_t kBatch = 1u << 20;

  void queue(const void* p, std::size_t n) {
    iov_.push_back(iovec{const_cast<void*>(p), n});
    queued_ += n;
    if (queued_ >= kBatch || iov_.size() >= kMaxIov) flush();
  }

  int fd_;
  const std::string& name_;
  std::vector<iovec> iov_;
  std::size_t queued_ = 0;
  std::uint32_t crc_ = 0;
  std::vector<std::byte> bounce_;
};

void pwrite_all(int fd, const char* p, std::size_t n, std::uint64_t offset, const std::string& name) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw CheckpointError(os_error("cannot write", name));
    }
    if (w == 0) {
      errno = EIO;
      throw CheckpointError(os_error("cannot write", name));
    }
    p += w;
    n -= static_cast<std::size_t>(w);
    offset += static_cast<std::uint64_t>(w);
  }
}

const std::byte* bytes_of(const Tensor& t) { return static_cast<const std::byte*>(t.raw_data()); }

}  // namespace

std::vector<std::byte> serialize_checkpoint(const Checkpoint& ck) {
  const HeaderPlan plan = plan_header(ck);
  std::vector<std::byte> out(plan.prefix.size() + plan.data_bytes);
  std::memcpy(out.data(), plan.prefix.data(), plan.prefix.size());
  std::size_t off = plan.prefix.size();
  std::uint32_t crc = 0;
  for (const auto& [name, t] : ck.tensors) {
    copy_with_crc(out.data() + off, bytes_of(t), t.nbytes(), size_of(t.dtype()), crc, false);
    off += t.nbytes();
  }
  const auto digits = crc_digits(full_checksum(crc, plan.canon));
  std::memcpy(out.data() + plan.crc_digits, digits.data(), digits.size());
  return out;
}

Checkpoint parse_checkpoint(std::span<const std::byte> bytes, const CheckpointReadOptions& opts) {
  const std::uint64_t n = checked_header_length(bytes.data(), bytes.size());
  const std::string_view header(reinterpret_cast<const char*>(bytes.data() + 8), n);
  const std::span<const std::byte> data = bytes.subspan(8 + n);
  ParsedHeader ph = parse_header(header, data.size(), opts);
  Checkpoint ck;
  std::uint32_t crc = 0;
  ck.tensors.reserve(ph.tensors.size());
  for (TensorEntry& e : ph.tensors) {
    Tensor t(e.shape, e.dtype);
    copy_with_crc(static_cast<std::byte*>(t.raw_data()), data.data() + e.begin, e.end - e.begin,
                  size_of(e.dtype), crc, true);
    ck.tensors.emplace_back(std::move(e.name), std::move(t));
  }
  verify_checksum(ph, crc);
  ck.metadata = std::move(ph.metadata);
  return ck;
}

namespace {

/// Asks for huge pages behind a large buffer about to be filled: a page fault per 2 MiB rather
/// than per 4 KiB while read() fills it (where transparent huge pages are on "madvise", as on
/// Debian; a hint, nothing depends on it).
void advise_huge_pages(void* p, std::size_t n) {
  constexpr std::size_t kHuge = 2u << 20;
  if (n < 2 * kHuge) return;
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(p) + page - 1) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(p) + n) / page * page;
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace

void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  write_atomically(path, [&](int fd, const std::string& name) {
    FileWriter w(fd, name);
    for (std::size_t off = 0; off < bytes.size(); off += 1u << 30) {
      const std::size_t m = std::min<std::size_t>(1u << 30, bytes.size() - off);
      w.raw(bytes.data() + off, m);
      w.flush();
    }
  });
}

void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck) {
  // Everything is checked, and the header laid out, before the temporary file exists.
  const HeaderPlan plan = plan_header(ck);
  write_atomically(path, [&](int fd, const std::string& name) {
    FileWriter w(fd, name);
    w.raw(plan.prefix.data(), plan.prefix.size());
    for (const auto& [tname, t] : ck.tensors) w.data(bytes_of(t), t.nbytes(), size_of(t.dtype()));
    w.flush();
    const auto digits = crc_digits(full_checksum(w.crc(), plan.canon));
    pwrite_all(fd, digits.data(), digits.size(), plan.crc_digits, name);
  });
}

Checkpoint load_checkpoint(const std::filesystem::path& path, const CheckpointReadOptions& opts) {
  // The type first: open() of a FIFO waits for a writer forever, and of a device may block or
  // have side effects. Then open without blocking, and check again what was opened (the path
  // may have been replaced in between).
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw CheckpointError(os_error("cannot open", path));
  if (!S_ISREG(st.st_mode)) not_regular(path, st.st_mode);
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (f.fd < 0) throw CheckpointError(os_error("cannot open", path));
  if (::fstat(f.fd, &st) != 0) throw CheckpointError(os_error("cannot stat", path));
  if (!S_ISREG(st.st_mode)) not_regular(path, st.st_mode);
  const int flags = ::fcntl(f.fd, F_GETFL);
  if (flags < 0 || ::fcntl(f.fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
    throw CheckpointError(os_error("cannot clear O_NONBLOCK on", path));
  auto read_at = [&](std::byte* dst, std::size_t n, std::uint64_t offset) {
    std::size_t got = 0;
    while (got < n) {
      const ssize_t r = ::pread(f.fd, dst + got, n - got, static_cast<off_t>(offset + got));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw CheckpointError(os_error("cannot read", path));
      }
      if (r == 0) break;  // the file shrank while we read it
      got += static_cast<std::size_t>(r);
    }
    return got;
  };
  auto shrank = [](std::uint64_t at) {
    fail("file is truncated: it ended at byte " + std::to_string(at) +
         ", before the size it had when it was opened (it shrank while being read)");
  };
  try {
    // The length prefix first: a file whose header cannot be valid is refused before anything
    // else is read or allocated.
    const auto size = static_cast<std::uint64_t>(st.st_size);
    std::byte first8[8] = {};
    const std::size_t got8 = read_at(first8, std::min<std::uint64_t>(8, size), 0);
    const std::uint64_t n = checked_header_length(first8, got8 < 8 ? got8 : size);
    std::string header(static_cast<std::size_t>(n), '\0');
    const std::size_t got = read_at(reinterpret_cast<std::byte*>(header.data()), header.size(), 8);
    if (got < n) shrank(8 + got);
    ParsedHeader ph = parse_header(header, size - 8 - n, opts);
    // The data, straight into the tensors, checksummed piece by piece while in cache.
    Checkpoint ck;
    ck.tensors.reserve(ph.tensors.size());
    std::uint32_t crc = 0;
    const std::uint64_t data_start = 8 + n;
    for (TensorEntry& e : ph.tensors) {
      Tensor t(e.shape, e.dtype);
      auto* dst = static_cast<std::byte*>(t.raw_data());
      const std::uint64_t len = e.end - e.begin;
      advise_huge_pages(dst, len);
      for (std::uint64_t off = 0; off < len; off += kPiece) {
        const std::size_t m = static_cast<std::size_t>(std::min<std::uint64_t>(kPiece, len - off));
        const std::uint64_t at = data_start + e.begin + off;
        const std::size_t r = read_at(dst + off, m, at);
        if (r < m) shrank(at + r);
        crc = crc32c(std::span<const std::byte>(dst + off, m), crc);
      }
      if constexpr (std::endian::native != std::endian::little) swap_in_place(dst, len, size_of(e.dtype));
      ck.tensors.emplace_back(std::move(e.name), std::move(t));
    }
    verify_checksum(ph, crc);
    ck.metadata = std::move(ph.metadata);
    return ck;
  } catch (const CheckpointError& e) {
    throw CheckpointError(std::string(e.what()) + " [" + path.string() + "]");
  }
}

}  // namespace lockstep
