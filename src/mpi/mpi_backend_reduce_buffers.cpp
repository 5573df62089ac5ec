// MPIBackend::allocate_reduce_buffer: buffers every rank of this machine maps, which the
// shared-memory allreduce reduces in place (ShmCollectives::Region).
#include <sys/mman.h>

#include <iostream>
#include <vector>

#include "mpi/mpi_backend_impl.hpp"
#if LOCKSTEP_FAULT_INJECTION
#include "reliability/fault.hpp"
#endif

namespace lockstep {

std::shared_ptr<void> MPIBackend::do_allocate_reduce_buffer(std::size_t bytes) {
  detail::ShmCollectives* shm = impl_->shm.get();
  if (shm == nullptr) return Backend::do_allocate_reduce_buffer(bytes);
  using detail::ShmCollectives;
  constexpr std::size_t kName = ShmCollectives::kSegmentNameBytes;
  // Each rank makes its segment, the ranks exchange the names (an empty one: this rank could
  // not), each maps every other rank's, and they agree on the outcome before the names are
  // removed: nothing is left in /dev/shm whatever happened, and either every rank registers the
  // region or none does (then every rank hands out ordinary memory).
  char name[kName];
  char* own = ShmCollectives::create_segment(bytes, name);
#if LOCKSTEP_FAULT_INJECTION
  if (own != nullptr && detail::fault_no_segment(impl_->rank)) {  // as if /dev/shm were full here
    std::cerr << "lockstep: injecting fault kind=no_segment on rank " << impl_->rank << " (allocate_reduce_buffer)"
              << std::endl;
    munmap(own, bytes);
    shm_unlink(name);
    own = nullptr;
    name[0] = '\0';
  }
#endif
  std::vector<char> names(kName * static_cast<std::size_t>(impl_->size));
  std::shared_ptr<ShmCollectives::Region> region;
  std::int32_t ok = 0;
  try {
    allgather(TensorView{name, static_cast<std::int64_t>(kName), DType::u8, Device::cpu()},
              TensorView{names.data(), static_cast<std::int64_t>(names.size()), DType::u8, Device::cpu()});
    region = shm->map_region(own, bytes, names.data());
    own = nullptr;  // the region owns it now (and unmapped it if it failed)
    ok = region ? 1 : 0;
    allreduce(TensorView{&ok, 1, DType::i32, Device::cpu()}, ReduceOp::min);
  } catch (...) {
    if (name[0] != '\0') shm_unlink(name);
    if (own != nullptr) munmap(own, bytes);
    throw;
  }
  if (name[0] != '\0') shm_unlink(name);
  if (ok == 0) return Backend::do_allocate_reduce_buffer(bytes);
  shm->add_region(region);
  return std::shared_ptr<void>(region, region->base[impl_->rank]);
}

}  // namespace lockstep
