// The program the package test builds against lockstep::cuda, and lockstep::nccl when it is
// built (find_package(lockstep COMPONENTS cuda nccl)): the GPU headers compile in a project that
// never enabled CUDA, and the targets bring every library they need. It runs without a GPU: it
// only counts the devices (0 without one) and names NCCLBackend so that the linker resolves it.
#include <lockstep/cuda.hpp>
#include <lockstep/lockstep.hpp>
#if LOCKSTEP_HAS_NCCL
#include <lockstep/nccl.hpp>
#endif

#include <cstdio>

int main(int argc, char**) {
  std::printf("cuda devices: %d\n", lockstep::cuda::device_count());
#if LOCKSTEP_HAS_NCCL
  if (argc > 1000) {  // never true: only the link matters
    lockstep::NCCLBackend nccl;
    std::printf("%d\n", nccl.size());
  }
#endif
  std::printf("gpu package test: ok\n");
  return 0;
}
