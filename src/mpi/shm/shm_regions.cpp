// Buffers every rank of this machine maps (MPIBackend::allocate_reduce_buffer): the segments,
// mapping the peers' ones, and the registry an in-place allreduce looks a buffer up in.
#include "mpi/shm/shm_collectives.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>

namespace lockstep::detail {

ShmCollectives::Region::~Region() {
  for (int p = 0; p < size; ++p)
    if (base[p] != nullptr) munmap(base[p], bytes);
}

char* ShmCollectives::create_segment(std::size_t bytes, char* name) {
  std::memset(name, 0, kSegmentNameBytes);
  if (bytes == 0) return nullptr;
  static std::atomic<unsigned> counter{0};
  char n[kSegmentNameBytes] = {};
  std::snprintf(n, sizeof n, "/lockstep-buf-%ld-%u-%lx", static_cast<long>(getpid()), counter.fetch_add(1),
                static_cast<unsigned long>(std::random_device{}()));
  const int fd = shm_open(n, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return nullptr;
  // posix_fallocate, not ftruncate alone: a full /dev/shm (containers often give it 64 MiB) is
  // an error here, not a SIGBUS at the first write into the buffer.
  void* map = MAP_FAILED;
  if (posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0)
    map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    shm_unlink(n);
    return nullptr;
  }
  std::memcpy(name, n, kSegmentNameBytes);
  return static_cast<char*>(map);
}

std::shared_ptr<ShmCollectives::Region> ShmCollectives::map_region(char* own, std::size_t bytes, const char* names) {
  auto r = std::make_shared<Region>();
  r->id = next_region_++;  // counted on every rank alike, whatever the outcome
  r->bytes = bytes;
  r->size = size_;
  r->base[rank_] = own;
  bool ok = own != nullptr;
  for (int p = 0; ok && p < size_; ++p) {
    if (p == rank_) continue;
    char n[kSegmentNameBytes];
    std::memcpy(n, names + static_cast<std::size_t>(p) * kSegmentNameBytes, kSegmentNameBytes);
    n[kSegmentNameBytes - 1] = '\0';
    const int fd = n[0] == '/' ? shm_open(n, O_RDWR, 0600) : -1;
    void* map = MAP_FAILED;
    if (fd >= 0) {
      map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
    }
    if (map == MAP_FAILED) ok = false;
    else r->base[p] = static_cast<char*>(map);
  }
  if (!ok) return nullptr;  // ~Region unmaps what was mapped, own included
  return r;
}

void ShmCollectives::add_region(const std::shared_ptr<Region>& region) {
  std::lock_guard lock(regions_mutex_);
  // Forget the regions whose buffers are gone.
  std::erase_if(regions_, [](const std::weak_ptr<Region>& w) { return w.expired(); });
  regions_.push_back(region);
  any_region_.store(true, std::memory_order_release);
}

std::shared_ptr<ShmCollectives::Region> ShmCollectives::find_region(const void* p, std::size_t bytes,
                                                                    std::size_t* offset) {
  if (!any_region_.load(std::memory_order_acquire)) return nullptr;
  const auto* c = static_cast<const char*>(p);
  std::lock_guard lock(regions_mutex_);
  for (const auto& w : regions_) {
    auto r = w.lock();
    if (!r) continue;
    const char* b = r->base[rank_];
    if (c >= b && c < b + r->bytes && bytes <= static_cast<std::size_t>(b + r->bytes - c)) {
      *offset = static_cast<std::size_t>(c - b);
      return r;
    }
  }
  return nullptr;
}

}  // namespace lockstep::detail
