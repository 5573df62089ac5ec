// Checkpoint files in the safetensors format: the writer, the strict reader, and the file-level
// save_checkpoint / load_checkpoint. The header is parsed by nlohmann::json's SAX parser under a
// handler of ours that refuses what the format must not hold; the data goes straight between
// the tensors' memory and the file. The atomic write is atomic_file.cpp's; the collective
// checkpoint (ranks, structures) is checkpoint.cpp's.
#include "lockstep/io/checkpoint.hpp"

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

#include <nlohmann/json.hpp>

#include "io/atomic_file.hpp"
#include "io/safetensors.hpp"

namespace lockstep {
namespace {

using detail::Fd;
using detail::fail;
using detail::os_error;
using detail::valid_utf8;
using detail::write_atomically;

// ---------------------------------------------------------------------------------------------
// The header's JSON. nlohmann::json's lexer and SAX parser do the syntax (RFC 8259: no comments,
// no trailing commas, valid UTF-8 only, no lone surrogates; iterative, so no recursion to
// exhaust); JsonBuilder, the handler, builds a small tree of the values and refuses what the
// parser itself accepts but a header must not hold: a key twice in one object, nesting deeper
// than 64 levels. Its errors, and the parser's, become CheckpointErrors in the words the reader
// has always used ("malformed JSON header at byte N: invalid UTF-8 in string", "malformed JSON
// header: duplicate key \"w\""). A DOM of nlohmann::json is not used: it keeps the last of two
// equal keys without a word.

struct Json {
  enum class Kind { null, boolean, number, string, array, object } kind = Kind::null;
  bool boolean = false;
  std::string text;  // string contents, or the number's literal text
  std::vector<Json> items;            // array elements, or object values
  std::vector<std::string> keys;      // object keys, parallel to items
};

const char* kind_name(Json::Kind k) {
  switch (k) {
    case Json::Kind::null: return "null";
    case Json::Kind::boolean: return "a boolean";
    case Json::Kind::number: return "a number";
    case Json::Kind::string: return "a string";
    case Json::Kind::array: return "an array";
    case Json::Kind::object: return "an object";
  }
  return "?";
}


/// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not valid.
std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  std::size_t len;
  std::uint32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) { len = 2; cp = b0 & 0x1Fu; }
  else if (b0 >= 0xE0 && b0 <= 0xEF) { len = 3; cp = b0 & 0x0Fu; }
  else if (b0 >= 0xF0 && b0 <= 0xF4) { len = 4; cp = b0 & 0x07u; }
  else return 0;
  if (s.size() - i < len) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0u) != 0x80u) return 0;
    cp = (cp << 6) | (b & 0x3Fu);
  }
  // Overlong forms, UTF-16 surrogates and code points past U+10FFFF are not valid UTF-8.
  if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return len;
}

}  // namespace

void detail::fail(const std::string& msg) { throw CheckpointError("checkpoint: " + msg); }

bool detail::valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

namespace {


/// What the reader says about an error of nlohmann's parser: the phrase the reader has always
/// used for that kind of error, found from the parser's message (whose wording is stable across
/// 3.x), or the parser's own message for a kind not listed.
std::string describe_parse_error(const std::string& what) {
  const auto has = [&](const char* s) { return what.find(s) != std::string::npos; };
  // The parser read a whole value and found more (strict mode): whatever follows is extra data.
  if (has("; expected end of input")) return "unexpected data after the JSON value";
  if (has("last read:")) {  // the lexer refused a token
    if (has("control character")) return "control character in string";
    if (has("must be followed by 4 hex digits")) return "invalid hex digit in \\u escape";
    if (has("must be followed by U+DC00")) return "high surrogate without its low surrogate";
    if (has("must follow U+D800")) return "lone low surrogate in \\u escape";
    if (has("forbidden character after backslash")) return "invalid escape";
    if (has("ill-formed UTF-8")) return "invalid UTF-8 in string";
    if (has("missing closing quote")) return "unterminated string";
    if (has("expected digit after '.'")) return "invalid number: no digit after '.'";
    if (has("exponent")) return "invalid number: no digit in exponent";
    if (has("invalid number")) return "invalid number";
    if (has("invalid literal")) return "invalid literal";
  }
  if (has("unexpected end of input")) return "unexpected end of header";
  if (has("while parsing object key")) return "expected a string key";
  if (has("while parsing object separator")) return "expected ':'";
  if (has("while parsing object")) return "expected ',' or '}'";
  if (has("while parsing array")) return "expected ',' or ']'";
  if (has("while parsing value")) return "unexpected character";
  // nlohmann's own text, without its "[json.exception.parse_error.101] " tag.
  const std::size_t tag = what.find("] ");
  return tag == std::string::npos ? what : what.substr(tag + 2);
}

class JsonBuilder {
 public:
  using json = nlohmann::json;
  static constexpr std::size_t kMaxDepth = 64;

  Json take_root() { return std::move(root_); }

  bool null() { return value(Json{}); }
  bool boolean(bool b) {
    Json v;
    v.kind = Json::Kind::boolean;
    v.boolean = b;
    return value(std::move(v));
  }
  // Numbers keep their text: shapes and offsets are checked from it (as_index), so that 1.0,
  // 1e0, -0 and integers beyond 2^64 are named as they are written.
  bool number_integer(json::number_integer_t x) { return number(std::to_string(x)); }
  bool number_unsigned(json::number_unsigned_t x) { return number(std::to_string(x)); }
  bool number_float(json::number_float_t, const json::string_t& text) { return number(text); }
  bool string(json::string_t& s) {
    Json v;
    v.kind = Json::Kind::string;
    v.text = std::move(s);
    return value(std::move(v));
  }
  bool binary(json::binary_t&) { error("unexpected binary value"); }
  bool start_object(std::size_t) { return open(Json::Kind::object); }
  bool start_array(std::size_t) { return open(Json::Kind::array); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(json::string_t& k) {
    Frame& f = stack_.back();
    auto& keys = f.value.keys;
    // Duplicate keys: a linear scan while the object is small (a tensor's three fields), a hash
    // set once it is large (the top level of a header with many tensors), so that a header of n
    // keys costs O(n), not O(n^2).
    constexpr std::size_t kScanKeys = 16;
    bool duplicate;
    if (keys.size() < kScanKeys) {
      duplicate = std::find(keys.begin(), keys.end(), k) != keys.end();
    } else {
      if (!f.seen) f.seen = std::make_unique<std::unordered_set<std::string>>(keys.begin(), keys.end());
      duplicate = !f.seen->insert(k).second;
    }
    if (duplicate) error("duplicate key \"" + k + "\"");
    keys.push_back(std::move(k));
    return true;
  }

  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) {
    // position counts the bytes read, the offending one included.
    fail("malformed JSON header at byte " + std::to_string(position > 0 ? position - 1 : 0) + ": " +
         describe_parse_error(e.what()));
  }

 private:
  struct Frame {
    Json value;
    std::unique_ptr<std::unordered_set<std::string>> seen;  // keys, once the object is large
  };

  [[noreturn]] static void error(const std::string& what) { fail("malformed JSON header: " + what); }

  bool number(std::string text) {
    Json v;
    v.kind = Json::Kind::number;
    v.text = std::move(text);
    return value(std::move(v));
  }
  bool value(Json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
    } else {
      Json& parent = stack_.back().value;
      if (parent.items.empty()) parent.items.reserve(4);  // shapes, offsets, a tensor's fields
      parent.items.push_back(std::move(v));
    }
    return true;
  }
  bool open(Json::Kind kind) {
    if (stack_.size() >= kMaxDepth) error("nested deeper than 64 levels");
    stack_.emplace_back();
    stack_.back().value.kind = kind;
    return true;
  }
  bool close() {
    Json v = std::move(stack_.back().value);
    stack_.pop_back();
    return value(std::move(v));
  }

  std::vector<Frame> stack_;
  Json root_;
};

/// Parses `text` as one JSON value (nothing but whitespace after it); throws CheckpointError.
Json parse_json(std::string_view text) {
  JsonBuilder builder;
  const bool ok = nlohmann::json::sax_parse(text.data(), text.data() + text.size(), &builder,
                                            nlohmann::json::input_format_t::json, /*strict=*/true,
                                            /*ignore_comments=*/false);
  // The handler throws on every error, so a false return is not expected; refuse it anyway.
  if (!ok) fail("malformed JSON header");
  return builder.take_root();
}

/// A JSON number that must be a non-negative integer below 2^63 (shapes and offsets); `field` of
/// tensor `key` names it in the error (the text is built only then: this runs for every extent).
std::uint64_t as_index(const Json& v, const std::string& key, const char* field) {
  auto name = [&] { return "tensor \"" + key + "\" " + field; };
  if (v.kind != Json::Kind::number) fail(name() + " must be a number, not " + kind_name(v.kind));
  const std::string& t = v.text;
  if (t.empty() || t.find_first_not_of("0123456789") != std::string::npos)
    fail(name() + " must be a non-negative integer, got " + t);
  std::uint64_t x = 0;
  for (char c : t) {
    const auto d = static_cast<std::uint64_t>(c - '0');
    if (x > (static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) - d) / 10)
      fail(name() + " is too large: " + t);
    x = x * 10 + d;
  }
  return x;
}

void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  out += '"';
}

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

std::string crc_text(std::uint32_t crc) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "crc32c:%08x", crc);
  return buf;
}

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

}  // namespace


const char* safetensors_dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
  }
  return "?";
}

std::optional<DType> dtype_from_safetensors_name(std::string_view n) noexcept {
  for (DType t : {DType::f16, DType::bf16, DType::f32, DType::f64, DType::i32, DType::i64, DType::u8})
    if (n == safetensors_dtype_name(t)) return t;
  return std::nullopt;
}

namespace {
using Entries = std::vector<std::pair<std::string, Tensor>>;

void rebuild(detail::CheckpointNames& ix, const Entries& tensors);
// Indexes what was appended to `tensors` since; the first of two equal names keeps its entry.
void extend(detail::CheckpointNames& ix, const Entries& tensors) {
  if (tensors.size() < ix.covered) return rebuild(ix, tensors);
  ix.pos.reserve(tensors.size());
  for (; ix.covered < tensors.size(); ++ix.covered) ix.pos.emplace(tensors[ix.covered].first, ix.covered);
}
void rebuild(detail::CheckpointNames& ix, const Entries& tensors) {
  ix.pos.clear();
  ix.covered = 0;
  extend(ix, tensors);
}
// The indexed position of `name` if `tensors` still holds it there, else tensors.size().
std::size_t lookup(const detail::CheckpointNames& ix, const Entries& tensors, std::string_view name) {
  const auto it = ix.pos.find(name);
  if (it == ix.pos.end() || it->second >= tensors.size() || tensors[it->second].first != name) return tensors.size();
  return it->second;
}
}  // namespace

std::size_t Checkpoint::position(std::string_view name, bool scan_on_miss) const noexcept {
  const std::size_t n = tensors.size();
  auto scan = [&] {
    for (std::size_t i = 0; i < n; ++i)
      if (tensors[i].first == name) return i;
    return n;
  };
  std::lock_guard lock(index_.mutex);
  try {
    extend(index_, tensors);
    std::size_t i = lookup(index_, tensors, name);
    // A stale entry (the name moved or went) is not a miss to trust: rebuild and look again.
    if (i == n && index_.pos.find(name) != index_.pos.end()) {
      rebuild(index_, tensors);
      return lookup(index_, tensors, name);  // the index now covers `tensors` as it is
    }
    if (i < n || !scan_on_miss) return i;
    // A miss, confirmed by a scan: `tensors` may have been edited in place.
    i = scan();
    if (i < n) rebuild(index_, tensors);
    return i;
  } catch (...) {  // no memory for the index: the scan needs none
    index_.pos.clear();
    index_.covered = 0;
    return scan();
  }
}

void Checkpoint::add(std::string name, Tensor t) {
  LOCKSTEP_CHECK_ARG(!name.empty(), "Checkpoint::add: a tensor name must not be empty");
  LOCKSTEP_CHECK_ARG(!name.starts_with("__"), "Checkpoint::add: name \"", name,
                     "\" starts with \"__\", which safetensors reserves");
  LOCKSTEP_CHECK_ARG(valid_utf8(name), "Checkpoint::add: name is not valid UTF-8");
  // The index's word, without a scan: a name renamed in place in `tensors` and added again
  // gets past this check, and the writer's own duplicate check refuses the file.
  LOCKSTEP_CHECK_ARG(position(name, false) == tensors.size(), "Checkpoint::add: duplicate tensor name \"", name,
                     "\"");
  tensors.emplace_back(std::move(name), std::move(t));
}

const Tensor* Checkpoint::find(std::string_view name) const noexcept {
  const std::size_t i = position(name, true);
  return i < tensors.size() ? &tensors[i].second : nullptr;
}
Tensor* Checkpoint::find(std::string_view name) noexcept {
  const std::size_t i = position(name, true);
  return i < tensors.size() ? &tensors[i].second : nullptr;
}
const Tensor& Checkpoint::at(std::string_view name) const {
  const Tensor* t = find(name);
  if (t == nullptr) fail("no tensor named \"" + std::string(name) + "\"");
  return *t;
}
Tensor& Checkpoint::at(std::string_view name) {
  Tensor* t = find(name);
  if (t == nullptr) fail("no tensor named \"" + std::string(name) + "\"");
  return *t;
}


// ---------------------------------------------------------------------------------------------
// Writing: the header first, then the tensors straight from their memory. The checksum covers
// the data, so it is known only once the data has gone by; its place in the header has a fixed
// width ("crc32c:" and 8 hex digits), so the header is written with zeros there and the digits
// are written into place at the end (before the fsync and the rename: no reader ever sees the
// placeholder).

namespace {

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

// ---------------------------------------------------------------------------------------------
// Reading: the header is parsed and checked against the file's size first (parse_header); then
// the data goes straight into newly allocated tensors, through the streaming CRC, and the
// Checkpoint is handed out only once the checksum matches. Whatever the file holds, nothing but
// those new tensors is written before it is verified.

namespace {
constexpr std::uint64_t kMaxHeader = 100u << 20;  // as safetensors: a header is never this big

/// The length prefix of a file of `size` bytes starting with `first8`; throws CheckpointError
/// if it cannot be a header (the file is truncated, or the header is over the limit).
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

}  // namespace

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
