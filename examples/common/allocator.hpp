// The examples' allocator setting for LibTorch on CPU. Header-only, for the examples (not part of
// the library).
//
// A LibTorch step allocates and frees the same large temporaries (activations, their gradients,
// attention matrices) every step. glibc's malloc serves blocks above its mmap threshold with
// mmap and unmaps them when freed, and gives the top of its heap back to the system past its trim
// threshold, so each step faults the same pages in again: for examples/torch/gpt's model at
// -n 1 the step was about 1.35x slower than with the memory kept (docs/torch.md, "Speed on CPU:
// the allocator"). Keeping freed memory in the process (up to these thresholds) costs at most
// the peak of one step's temporaries, which the process had mapped anyway.
#pragma once

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace examples {

/// Makes glibc keep freed blocks of up to 256 MiB and the top of its heap (up to 512 MiB free)
/// instead of returning them to the system at every free; nothing elsewhere. Call it first in
/// main, before any tensor is made. The same as running with MALLOC_MMAP_THRESHOLD_=268435456
/// MALLOC_TRIM_THRESHOLD_=536870912.
inline void keep_freed_memory() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
#endif
}

}  // namespace examples
