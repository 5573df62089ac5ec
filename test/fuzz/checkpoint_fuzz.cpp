// libFuzzer target over the checkpoint reader: parse_checkpoint must never read outside its
// input, crash, leak or hang, whatever the bytes; anything wrong is a CheckpointError.
// Built by scripts/ci-fuzz.sh (clang, -fsanitize=fuzzer,address,undefined); seed corpus in
// test/fuzz/corpus/.
#include <cstddef>
#include <cstdint>
#include <span>

#include "lockstep/io/checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  // Both modes: with the checksum required most mutations stop at the checksum, so the
  // lenient mode is what reaches the JSON parser and the tensor table with mutated input.
  for (bool require_checksum : {false, true}) {
    try {
      lockstep::CheckpointReadOptions opts;
      opts.require_checksum = require_checksum;
      lockstep::Checkpoint ck = lockstep::parse_checkpoint(bytes, opts);
      // A file that parses must be self-consistent: serialising it again must work.
      (void)lockstep::serialize_checkpoint(ck);
    } catch (const lockstep::CheckpointError&) {
      // The expected outcome for almost every mutated input.
    }
  }
  return 0;
}
