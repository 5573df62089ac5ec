// Internal: what the files of the safetensors reader and writer share (safetensors_json.cpp,
// safetensors_header.cpp, checkpoint_container.cpp, safetensors.cpp) and what the collective
// checkpoint (checkpoint.cpp) uses of them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/io/checkpoint.hpp"

namespace lockstep::detail {

/// Throws CheckpointError("checkpoint: " + msg).
[[noreturn]] void fail(const std::string& msg);
/// Whether s is valid UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool valid_utf8(std::string_view s);

namespace st {

// ---- safetensors_json.cpp: the header's JSON ----
struct Json {
  enum class Kind { null, boolean, number, string, array, object } kind = Kind::null;
  bool boolean = false;
  std::string text;  // string contents, or the number's literal text
  std::vector<Json> items;            // array elements, or object values
  std::vector<std::string> keys;      // object keys, parallel to items
};
const char* kind_name(Json::Kind k);
/// Parses `text` as one JSON value (nothing but whitespace after it); throws CheckpointError.
Json parse_json(std::string_view text);
/// A JSON number that must be a non-negative integer below 2^63 (shapes and offsets); `field` of
/// tensor `key` names it in the error (the text is built only then: this runs for every extent).
std::uint64_t as_index(const Json& v, const std::string& key, const char* field);
/// Appends s to out as a JSON string (quoted, escaped).
void append_json_string(std::string& out, std::string_view s);

// ---- safetensors_header.cpp: laying out a header, and parsing and checking one ----
/// "crc32c:" and the 8 hex digits of crc.
std::string crc_text(std::uint32_t crc);
/// The checksum covers the data and, through this canonical text, every meaningful part of the
/// header (names, dtypes, shapes, offsets, metadata other than the checksum itself), so a
/// corrupted epoch counter in the metadata is caught as surely as a flipped bit in a weight.
struct HeaderItem {
  std::string_view name;
  DType dtype;
  const Shape* shape;
  std::uint64_t begin, end;
};
/// The header's part of the checksum, written in a canonical form (the JSON may be written
/// differently by other tools: spacing, key order, escapes).
std::string canonical_text(const std::vector<HeaderItem>& items, const std::map<std::string, std::string>& meta);
/// The checksum of a file whose data (in file order, little-endian) has CRC `data_crc`.
std::uint32_t full_checksum(std::uint32_t data_crc, const std::string& canon);
/// The bytes before the data (the 8-byte length and the padded JSON header, holding the
/// checksum placeholder at crc_digits) and the canonical text the checksum covers after the data.
struct HeaderPlan {
  std::string prefix;
  std::size_t crc_digits = 0;
  std::string canon;
  std::uint64_t data_bytes = 0;
};

constexpr std::string_view kCrcPlaceholder = "crc32c:00000000";

/// Checks ck (names, devices, usable tensors, UTF-8 metadata) and lays out its header; throws
/// InvalidArgument naming the problem, before anything is written anywhere.
HeaderPlan plan_header(const Checkpoint& ck);
/// The 8 hex digits of a checksum, as the header holds them.
std::array<char, 8> crc_digits(std::uint32_t crc);
constexpr std::uint64_t kMaxHeader = 100u << 20;  // as safetensors: a header is never this big

/// The length prefix of a file of `size` bytes starting with `first8`; throws CheckpointError
/// if it cannot be a header (the file is truncated, or the header is over the limit).
std::uint64_t checked_header_length(const std::byte* first8, std::uint64_t size);
/// One tensor of a parsed header.
struct TensorEntry {
  std::string name;
  DType dtype;
  Shape shape;
  std::uint64_t begin, end;
};

/// A header, checked: every tensor (in data order) tiles the data exactly; the format is one
/// this build reads; the checksum is present unless the options allow its absence.
struct ParsedHeader {
  std::map<std::string, std::string> metadata;
  std::vector<TensorEntry> tensors;
  std::optional<std::string> checksum;    // the header's, when it has one
  std::string canon;                      // what the checksum covers besides the data
};
/// Parses and checks a header of a file with `data_size` bytes of data after it.
ParsedHeader parse_header(std::string_view header, std::uint64_t data_size, const CheckpointReadOptions& opts);
/// Throws CheckpointError if the header has a checksum and the data's CRC does not give it.
void verify_checksum(const ParsedHeader& ph, std::uint32_t data_crc);

}  // namespace st
}  // namespace lockstep::detail
