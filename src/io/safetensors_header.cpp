// The safetensors header: laid out for a save (names, dtypes, shapes, offsets, metadata, the
// checksum's place), and parsed and checked on a load against the file's size, with the
// canonical text that the checksum covers besides the data.
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
namespace detail::st {

using detail::Fd;
using detail::fail;
using detail::os_error;
using detail::valid_utf8;
using detail::write_atomically;

std::string crc_text(std::uint32_t crc) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "crc32c:%08x", crc);
  return buf;
}

std::string canonical_text(const std::vector<HeaderItem>& items, const std::map<std::string, std::string>& meta) {
  std::string canon;
  for (const auto& it : items) {
    canon.append(it.name);
    canon += '\0';
    canon += safetensors_dtype_name(it.dtype);
    canon += '\0';
    for (auto d : *it.shape) canon += std::to_string(d) + ',';
    canon += '\0';
    canon += std::to_string(it.begin) + ',' + std::to_string(it.end) + '\n';
  }
  for (const auto& [k, v] : meta) {
    if (k == kChecksumKey) continue;
    canon += k;
    canon += '\0';
    canon += v;
    canon += '\n';
  }
  return canon;
}

/// The checksum of a file whose data (in file order, little-endian) has CRC `data_crc`.
std::uint32_t full_checksum(std::uint32_t data_crc, const std::string& canon) {
  return crc32c(std::as_bytes(std::span<const char>(canon)), data_crc);
}

// ---------------------------------------------------------------------------------------------
// Writing: the header first, then the tensors straight from their memory. The checksum covers
// the data, so it is known only once the data has gone by; its place in the header has a fixed
// width ("crc32c:" and 8 hex digits), so the header is written with zeros there and the digits
// are written into place at the end (before the fsync and the rename: no reader ever sees the
// placeholder).


HeaderPlan plan_header(const Checkpoint& ck) {
  // Names are checked here too: a Checkpoint's fields are public, so add() may have been bypassed.
  std::unordered_set<std::string_view> seen;
  seen.reserve(ck.tensors.size());
  HeaderPlan plan;
  for (const auto& [name, t] : ck.tensors) {
    LOCKSTEP_CHECK_ARG(!name.empty() && !name.starts_with("__") && valid_utf8(name),
                       "serialize_checkpoint: invalid tensor name \"", name, "\"");
    LOCKSTEP_CHECK_ARG(seen.insert(name).second, "serialize_checkpoint: duplicate tensor name \"", name, "\"");
    if (t.device().is_cuda())
      throw InvalidArgument("serialize_checkpoint: tensor \"" + name + "\" is on " +
                            to_string(t.device()) + "; copy it to the CPU first");
    // A tensor whose element count disagrees with its shape would be written as a header no
    // reader accepts (and its bytes read from memory it may not own): refuse it here.
    detail::check_tensor_usable("serialize_checkpoint", name, t);
    plan.data_bytes += t.nbytes();
  }
  for (const auto& [k, v] : ck.metadata)
    LOCKSTEP_CHECK_ARG(valid_utf8(k) && valid_utf8(v), "serialize_checkpoint: metadata \"", k,
                       "\" is not valid UTF-8");

  std::map<std::string, std::string> meta = ck.metadata;
  meta.erase(std::string(kChecksumKey));
  meta[std::string(kFormatKey)] = "1";
  std::vector<HeaderItem> items;
  items.reserve(ck.tensors.size());
  std::uint64_t off = 0;
  for (const auto& [name, t] : ck.tensors) {
    items.push_back({name, t.dtype(), &t.shape(), off, off + t.nbytes()});
    off += t.nbytes();
  }
  plan.canon = canonical_text(items, meta);
  meta[std::string(kChecksumKey)] = std::string(kCrcPlaceholder);

  std::string h = "{\"__metadata__\":{";
  std::size_t crc_at = 0;
  bool first = true;
  for (const auto& [k, v] : meta) {
    if (!first) h += ',';
    first = false;
    append_json_string(h, k);
    h += ':';
    if (k == kChecksumKey) crc_at = h.size() + 1 + std::string_view("crc32c:").size();  // after the quote
    append_json_string(h, v);
  }
  h += '}';
  for (const auto& it : items) {
    h += ',';
    append_json_string(h, it.name);
    h += ":{\"dtype\":\"";
    h += safetensors_dtype_name(it.dtype);
    h += "\",\"shape\":[";
    for (std::size_t i = 0; i < it.shape->size(); ++i) {
      if (i) h += ',';
      h += std::to_string((*it.shape)[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(it.begin) + ',' + std::to_string(it.end) + "]}";
  }
  h += '}';
  // Pad with spaces so the data starts 8-byte aligned, as the safetensors writer does.
  while (h.size() % 8 != 0) h += ' ';

  plan.prefix.assign(8, '\0');
  const std::uint64_t n = h.size();
  for (int k = 0; k < 8; ++k) plan.prefix[static_cast<std::size_t>(k)] = static_cast<char>((n >> (8 * k)) & 0xFF);
  plan.prefix += h;
  plan.crc_digits = 8 + crc_at;
  return plan;
}

/// The 8 hex digits of a checksum, as the header holds them.
std::array<char, 8> crc_digits(std::uint32_t crc) {
  const std::string t = crc_text(crc);  // "crc32c:" + 8 digits
  std::array<char, 8> d{};
  std::memcpy(d.data(), t.data() + 7, 8);
  return d;
}

// ---------------------------------------------------------------------------------------------
// Reading: the header is parsed and checked against the file's size first (parse_header); then
// the data goes straight into newly allocated tensors, through the streaming CRC, and the
// Checkpoint is handed out only once the checksum matches. Whatever the file holds, nothing but
// those new tensors is written before it is verified.


std::uint64_t checked_header_length(const std::byte* first8, std::uint64_t size) {
  if (size < 8)
    fail("file is truncated: " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  std::uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= std::uint64_t(std::to_integer<unsigned char>(first8[k])) << (8 * k);
  if (n > size - 8)
    fail("file is truncated or not a checkpoint: header length " + std::to_string(n) +
         " exceeds the " + std::to_string(size - 8) + " bytes after it");
  if (n > kMaxHeader) fail("header length " + std::to_string(n) + " exceeds the 100 MiB limit");
  return n;
}

ParsedHeader parse_header(std::string_view header, std::uint64_t data_size, const CheckpointReadOptions& opts) {
  const std::uint64_t n = header.size();
  if (n < 2) fail("header length " + std::to_string(n) + " is too small for a JSON object");
  if (header.front() != '{') fail("header does not start with '{': not a safetensors file");

  Json root = parse_json(header);
  if (root.kind != Json::Kind::object) fail("header is not a JSON object");

  ParsedHeader ph;
  std::vector<TensorEntry> entries;
  entries.reserve(root.keys.size());
  for (std::size_t i = 0; i < root.keys.size(); ++i) {
    std::string& key = root.keys[i];
    const Json& v = root.items[i];
    if (key == "__metadata__") {
      if (v.kind != Json::Kind::object) fail("__metadata__ must be an object, not " + std::string(kind_name(v.kind)));
      for (std::size_t j = 0; j < v.keys.size(); ++j) {
        if (v.items[j].kind != Json::Kind::string)
          fail("__metadata__ value of \"" + v.keys[j] + "\" must be a string, not " + kind_name(v.items[j].kind));
        ph.metadata[v.keys[j]] = v.items[j].text;
      }
      continue;
    }
    // The tensor's name for messages, built only for one.
    auto what = [&key] { return "tensor \"" + key + "\""; };
    if (key.empty()) fail("a tensor has an empty name");
    // The writer refuses these names (safetensors reserves "__" for __metadata__), so a file
    // holding one is refused too: whatever parses can be written back unchanged.
    if (key.starts_with("__")) fail(what() + ": names starting with \"__\" are reserved for __metadata__");
    if (v.kind != Json::Kind::object) fail(what() + " must be an object, not " + kind_name(v.kind));
    const Json* dtype = nullptr;
    const Json* shape = nullptr;
    const Json* offsets = nullptr;
    for (std::size_t j = 0; j < v.keys.size(); ++j) {
      if (v.keys[j] == "dtype") dtype = &v.items[j];
      else if (v.keys[j] == "shape") shape = &v.items[j];
      else if (v.keys[j] == "data_offsets") offsets = &v.items[j];
      else fail(what() + " has an unknown field \"" + v.keys[j] + "\"");
    }
    if (!dtype || !shape || !offsets) fail(what() + " needs dtype, shape and data_offsets");
    if (dtype->kind != Json::Kind::string) fail(what() + ": dtype must be a string");
    const auto dt = dtype_from_safetensors_name(dtype->text);
    if (!dt) fail(what() + " has unsupported dtype \"" + dtype->text + "\" (supported: F16, BF16, F32, F64, I32, I64, U8)");
    if (shape->kind != Json::Kind::array) fail(what() + ": shape must be an array");
    if (offsets->kind != Json::Kind::array || offsets->items.size() != 2)
      fail(what() + ": data_offsets must be an array [begin, end]");
    TensorEntry e{{}, *dt, {}, 0, 0};
    // As numel_of: a zero extent anywhere gives zero elements, whatever the other extents.
    bool zero = false;
    e.shape.reserve(shape->items.size());
    for (const Json& d : shape->items) {
      const std::uint64_t x = as_index(d, key, "shape extent");
      zero = zero || x == 0;
      e.shape.push_back(static_cast<std::int64_t>(x));
    }
    std::uint64_t numel = zero ? 0 : 1;
    for (std::size_t k = 0; !zero && k < e.shape.size(); ++k) {
      const auto x = static_cast<std::uint64_t>(e.shape[k]);
      if (numel > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / x)
        fail(what() + " has a shape with too many elements");
      numel *= x;
    }
    e.begin = as_index(offsets->items[0], key, "data_offsets begin");
    e.end = as_index(offsets->items[1], key, "data_offsets end");
    if (e.end < e.begin) fail(what() + " has data_offsets end < begin");
    if (e.end > data_size)
      fail(what() + " ends at byte " + std::to_string(e.end) + " but the data holds only " +
           std::to_string(data_size) + " bytes (file truncated?)");
    const std::uint64_t elem = size_of(*dt);
    // numel * elem may not fit in 64 bits (2^62 F32 elements): say so rather than print the
    // wrapped product.
    const bool fits = numel <= std::numeric_limits<std::uint64_t>::max() / elem;
    if (!fits || e.end - e.begin != numel * elem)
      fail(what() + ": shape " + to_string(e.shape) + " of " + dtype->text + " needs " +
           (fits ? std::to_string(numel * elem) : std::string("more than 2^64")) +
           " bytes but data_offsets span " + std::to_string(e.end - e.begin));
    e.name = std::move(key);
    entries.push_back(std::move(e));
  }

  // safetensors requires the tensors to tile the data exactly: sorted, no gap, no overlap.
  std::vector<std::size_t> order(entries.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const TensorEntry& x = entries[a];
    const TensorEntry& y = entries[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  std::uint64_t expected = 0;
  for (const std::size_t i : order) {
    const TensorEntry& e = entries[i];
    if (e.begin < expected) fail("tensor \"" + e.name + "\" overlaps the previous tensor's data");
    if (e.begin > expected)
      fail("gap in the data before tensor \"" + e.name + "\" (bytes " + std::to_string(expected) +
           " to " + std::to_string(e.begin) + " belong to no tensor)");
    expected = e.end;
  }
  if (expected != data_size)
    fail("the data holds " + std::to_string(data_size) + " bytes but the tensors cover " +
         std::to_string(expected) + " (trailing garbage or wrong header)");

  const auto fmt = ph.metadata.find(std::string(kFormatKey));
  if (fmt != ph.metadata.end() && fmt->second != "1")
    fail("unsupported lockstep.format \"" + fmt->second + "\" (this build reads format 1)");
  const auto sum = ph.metadata.find(std::string(kChecksumKey));
  if (sum == ph.metadata.end()) {
    if (opts.require_checksum) fail("no lockstep.checksum in the metadata (not written by Lockstep?)");
  } else {
    ph.checksum = sum->second;
  }

  // File order: the order of the data, which is the order the writer added them in.
  ph.tensors.reserve(order.size());
  for (const std::size_t i : order) ph.tensors.push_back(std::move(entries[i]));
  if (ph.checksum) {
    std::vector<HeaderItem> items;
    items.reserve(ph.tensors.size());
    for (const TensorEntry& e : ph.tensors) items.push_back({e.name, e.dtype, &e.shape, e.begin, e.end});
    ph.canon = canonical_text(items, ph.metadata);
  }
  return ph;
}

/// Throws CheckpointError if the header has a checksum and the data's CRC does not give it.
void verify_checksum(const ParsedHeader& ph, std::uint32_t data_crc) {
  if (!ph.checksum) return;
  const std::string actual = crc_text(full_checksum(data_crc, ph.canon));
  if (*ph.checksum != actual)
    fail("checksum mismatch: the header says " + *ph.checksum + " but the contents give " + actual +
         " (the file is corrupted)");
}

}  // namespace detail::st
}  // namespace lockstep
