// model_hash: CRC-32C over a structure's tensor bytes in path order (io/model_hash.hpp).
#include "lockstep/io/model_hash.hpp"

#include <algorithm>
#include <cstdio>

#include "lockstep/io/checkpoint.hpp"  // crc32c

namespace lockstep::detail {

std::string model_hash_of(std::vector<std::pair<std::string, const Tensor*>> tensors) {
  // Path order, not traversal order: the hash of a model must not change when its fields are
  // declared in another order, and it is what one recomputes from a checkpoint's sorted names.
  // Stable, so that equal paths (impossible from one traversal) would keep their order.
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::uint32_t crc = 0;
  for (const auto& [path, t] : tensors) {
    if (t->nbytes() == 0) continue;  // nothing to hash (and raw_data() may be null)
    if (t->device().is_cpu()) {
      crc = crc32c({static_cast<const std::byte*>(t->raw_data()), t->nbytes()}, crc);
    } else {
      const Tensor host = t->to(Device::cpu());  // NotCompiled without a DeviceRuntime
      crc = crc32c({static_cast<const std::byte*>(host.raw_data()), host.nbytes()}, crc);
    }
  }
  char text[24];
  std::snprintf(text, sizeof text, "crc32c:%08x", static_cast<unsigned>(crc));
  return text;
}

}  // namespace lockstep::detail
