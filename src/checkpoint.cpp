// Checkpoint files in the safetensors format: writer, strict reader, CRC-32C, atomic writes.
#include "lockstep/checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_set>

namespace lockstep {
namespace {

// ---------------------------------------------------------------------------------------------
// CRC-32C, slice-by-8. Castagnoli rather than zlib's polynomial because it detects more error
// patterns at these lengths and is what storage systems (iSCSI, ext4, leveldb) use.

constexpr std::uint32_t kCrcPoly = 0x82F63B78u;  // reflected 0x1EDC6F41

struct CrcTables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  constexpr CrcTables() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kCrcPoly : (c >> 1);
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
  }
};
constexpr CrcTables kCrc{};

// ---------------------------------------------------------------------------------------------
// A small strict JSON parser (RFC 8259): no comments, no trailing commas, no duplicate keys, no
// lone surrogates, valid UTF-8 only, bounded nesting. Enough for a safetensors header and safe
// on any input: every read is bounds-checked.

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

[[noreturn]] void fail(const std::string& msg) { throw CheckpointError("checkpoint: " + msg); }

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

bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class JsonParser {
 public:
  explicit JsonParser(std::string_view s) : s_(s) {}

  Json parse_document() {
    skip_ws();
    Json v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) error("unexpected data after the JSON value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void error(const std::string& what) const {
    fail("malformed JSON header at byte " + std::to_string(pos_) + ": " + what);
  }
  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }
  void skip_ws() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  void expect_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) error("invalid literal");
    pos_ += lit.size();
  }

  Json parse_value(int depth) {
    if (depth > kMaxDepth) error("nested deeper than 64 levels");
    if (at_end()) error("unexpected end of header");
    Json v;
    switch (peek()) {
      case '{': parse_object(v, depth); break;
      case '[': parse_array(v, depth); break;
      case '"': v.kind = Json::Kind::string; v.text = parse_string(); break;
      case 't': expect_literal("true"); v.kind = Json::Kind::boolean; v.boolean = true; break;
      case 'f': expect_literal("false"); v.kind = Json::Kind::boolean; break;
      case 'n': expect_literal("null"); break;
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
          v.kind = Json::Kind::number;
          v.text = parse_number();
        } else {
          error("unexpected character");
        }
    }
    return v;
  }

  void parse_object(Json& v, int depth) {
    v.kind = Json::Kind::object;
    ++pos_;  // '{'
    skip_ws();
    if (peek() == '}') { ++pos_; return; }
    // Duplicate keys: a linear scan while the object is small (a tensor's three fields), a hash
    // set of key indices once it is large (the top level of a header with many tensors), so
    // that a header of n keys costs O(n), not O(n^2). Indices, not views: v.keys reallocates.
    constexpr std::size_t kScanKeys = 16;
    const auto& keys = v.keys;
    std::vector<std::size_t> hashes;  // of keys[i], computed once
    auto hash = [&hashes](std::size_t i) { return hashes[i]; };
    auto same = [&keys](std::size_t a, std::size_t b) { return keys[a] == keys[b]; };
    std::unordered_set<std::size_t, decltype(hash), decltype(same)> seen(0, hash, same);
    v.keys.reserve(4);  // a tensor's three fields in one allocation each, not three
    v.items.reserve(4);
    for (;;) {
      skip_ws();
      if (peek() != '"') error("expected a string key");
      v.keys.push_back(parse_string());
      const std::size_t k = v.keys.size() - 1;
      bool duplicate;
      if (k < kScanKeys) {
        duplicate = std::find(v.keys.begin(), v.keys.begin() + static_cast<std::ptrdiff_t>(k), v.keys[k]) !=
                    v.keys.begin() + static_cast<std::ptrdiff_t>(k);
      } else {
        if (seen.empty())
          for (std::size_t i = 0; i < k; ++i) {
            hashes.push_back(std::hash<std::string>{}(keys[i]));
            seen.insert(i);
          }
        hashes.push_back(std::hash<std::string>{}(keys[k]));
        duplicate = !seen.insert(k).second;
      }
      if (duplicate) error("duplicate key \"" + v.keys[k] + "\"");
      skip_ws();
      if (peek() != ':') error("expected ':'");
      ++pos_;
      skip_ws();
      v.items.push_back(parse_value(depth + 1));
      skip_ws();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == '}') { ++pos_; return; }
      error("expected ',' or '}'");
    }
  }

  void parse_array(Json& v, int depth) {
    v.kind = Json::Kind::array;
    ++pos_;  // '['
    skip_ws();
    if (peek() == ']') { ++pos_; return; }
    v.items.reserve(4);  // shapes and offsets are short
    for (;;) {
      skip_ws();
      v.items.push_back(parse_value(depth + 1));
      skip_ws();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == ']') { ++pos_; return; }
      error("expected ',' or ']'");
    }
  }

  std::uint32_t parse_hex4() {
    if (s_.size() - pos_ < 4) error("truncated \\u escape");
    std::uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[pos_++];
      cp <<= 4;
      if (c >= '0' && c <= '9') cp |= static_cast<std::uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') cp |= static_cast<std::uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') cp |= static_cast<std::uint32_t>(c - 'A' + 10);
      else error("invalid hex digit in \\u escape");
    }
    return cp;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (at_end()) error("unterminated string");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') { ++pos_; return out; }
      if (c < 0x20) error("control character in string");
      if (c == '\\') {
        ++pos_;
        if (at_end()) error("unterminated escape");
        const char e = s_[pos_++];
        switch (e) {
          case '"': out += '"'; break;
          case '\\': out += '\\'; break;
          case '/': out += '/'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'n': out += '\n'; break;
          case 'r': out += '\r'; break;
          case 't': out += '\t'; break;
          case 'u': {
            std::uint32_t cp = parse_hex4();
            if (cp >= 0xDC00 && cp <= 0xDFFF) error("lone low surrogate in \\u escape");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              if (s_.substr(pos_, 2) != "\\u") error("high surrogate without its low surrogate");
              pos_ += 2;
              const std::uint32_t lo = parse_hex4();
              if (lo < 0xDC00 || lo > 0xDFFF) error("high surrogate without its low surrogate");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            append_utf8(out, cp);
            break;
          }
          default: --pos_; error("invalid escape");
        }
        continue;
      }
      const std::size_t n = utf8_length(s_, pos_);
      if (n == 0) error("invalid UTF-8 in string");
      out.append(s_.substr(pos_, n));
      pos_ += n;
    }
  }

  std::string parse_number() {
    const std::size_t start = pos_;
    auto digit = [&] { return !at_end() && s_[pos_] >= '0' && s_[pos_] <= '9'; };
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else if (digit()) {
      while (digit()) ++pos_;
    } else {
      error("invalid number");
    }
    if (peek() == '.') {
      ++pos_;
      if (!digit()) error("invalid number: no digit after '.'");
      while (digit()) ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!digit()) error("invalid number: no digit in exponent");
      while (digit()) ++pos_;
    }
    return std::string(s_.substr(start, pos_ - start));
  }

  std::string_view s_;
  std::size_t pos_ = 0;
};

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
std::uint32_t full_checksum(std::span<const std::byte> data, const std::vector<HeaderItem>& items,
                            const std::map<std::string, std::string>& meta) {
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
  return crc32c(std::as_bytes(std::span<const char>(canon)), crc32c(data));
}

std::string os_error(const std::string& what, const std::filesystem::path& p) {
  return "checkpoint: " + what + " " + p.string() + ": " + std::strerror(errno);
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

/// Closes a file descriptor on scope exit (errors at close are checked explicitly where they
/// matter, before this runs).
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------

std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t n = bytes.size();
  crc = ~crc;
  while (n >= 8) {
    // Byte-wise loads keep this independent of alignment and host byte order.
    const std::uint32_t lo = crc ^ (std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 |
                                    std::uint32_t{p[2]} << 16 | std::uint32_t{p[3]} << 24);
    crc = kCrc.t[7][lo & 0xFF] ^ kCrc.t[6][(lo >> 8) & 0xFF] ^ kCrc.t[5][(lo >> 16) & 0xFF] ^
          kCrc.t[4][lo >> 24] ^ kCrc.t[3][p[4]] ^ kCrc.t[2][p[5]] ^ kCrc.t[1][p[6]] ^
          kCrc.t[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ kCrc.t[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

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

void Checkpoint::add(std::string name, Tensor t) {
  LOCKSTEP_CHECK_ARG(!name.empty(), "Checkpoint::add: a tensor name must not be empty");
  LOCKSTEP_CHECK_ARG(!name.starts_with("__"), "Checkpoint::add: name \"", name,
                     "\" starts with \"__\", which safetensors reserves");
  LOCKSTEP_CHECK_ARG(valid_utf8(name), "Checkpoint::add: name is not valid UTF-8");
  LOCKSTEP_CHECK_ARG(find(name) == nullptr, "Checkpoint::add: duplicate tensor name \"", name, "\"");
  tensors.emplace_back(std::move(name), std::move(t));
}

const Tensor* Checkpoint::find(std::string_view name) const noexcept {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}
Tensor* Checkpoint::find(std::string_view name) noexcept {
  for (auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
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

std::vector<std::byte> serialize_checkpoint(const Checkpoint& ck) {
  // Names are checked here too: a Checkpoint's fields are public, so add() may have been bypassed.
  std::unordered_set<std::string_view> seen;
  seen.reserve(ck.tensors.size());
  std::size_t data_bytes = 0;
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
    data_bytes += t.nbytes();
  }
  for (const auto& [k, v] : ck.metadata)
    LOCKSTEP_CHECK_ARG(valid_utf8(k) && valid_utf8(v), "serialize_checkpoint: metadata \"", k,
                       "\" is not valid UTF-8");

  std::vector<std::byte> data(data_bytes);
  std::size_t off = 0;
  for (const auto& [name, t] : ck.tensors) {
    copy_le(data.data() + off, static_cast<const std::byte*>(t.raw_data()), t.nbytes(),
            size_of(t.dtype()));
    off += t.nbytes();
  }

  std::map<std::string, std::string> meta = ck.metadata;
  meta.erase(std::string(kChecksumKey));
  meta[std::string(kFormatKey)] = "1";
  std::vector<HeaderItem> items;
  off = 0;
  for (const auto& [name, t] : ck.tensors) {
    items.push_back({name, t.dtype(), &t.shape(), off, off + t.nbytes()});
    off += t.nbytes();
  }
  meta[std::string(kChecksumKey)] = crc_text(full_checksum(data, items, meta));

  std::string h = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : meta) {
    if (!first) h += ',';
    first = false;
    append_json_string(h, k);
    h += ':';
    append_json_string(h, v);
  }
  h += '}';
  off = 0;
  for (const auto& [name, t] : ck.tensors) {
    h += ',';
    append_json_string(h, name);
    h += ":{\"dtype\":\"";
    h += safetensors_dtype_name(t.dtype());
    h += "\",\"shape\":[";
    for (std::size_t i = 0; i < t.shape().size(); ++i) {
      if (i) h += ',';
      h += std::to_string(t.shape()[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(off) + ',' + std::to_string(off + t.nbytes()) + "]}";
    off += t.nbytes();
  }
  h += '}';
  // Pad with spaces so the data starts 8-byte aligned, as the safetensors writer does.
  while (h.size() % 8 != 0) h += ' ';

  std::vector<std::byte> out(8 + h.size() + data.size());
  const std::uint64_t n = h.size();
  for (int k = 0; k < 8; ++k) out[k] = static_cast<std::byte>((n >> (8 * k)) & 0xFF);
  std::memcpy(out.data() + 8, h.data(), h.size());
  if (!data.empty()) std::memcpy(out.data() + 8 + h.size(), data.data(), data.size());
  return out;
}

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
}  // namespace

Checkpoint parse_checkpoint(std::span<const std::byte> bytes, const CheckpointReadOptions& opts) {
  const std::uint64_t n = checked_header_length(bytes.data(), bytes.size());
  if (n < 2) fail("header length " + std::to_string(n) + " is too small for a JSON object");
  const std::string_view header(reinterpret_cast<const char*>(bytes.data() + 8), n);
  if (header.front() != '{') fail("header does not start with '{': not a safetensors file");

  const Json root = JsonParser(header).parse_document();
  if (root.kind != Json::Kind::object) fail("header is not a JSON object");
  const std::span<const std::byte> data = bytes.subspan(8 + n);

  struct Entry {
    const std::string* name;
    DType dtype;
    Shape shape;
    std::uint64_t begin, end;
  };
  std::vector<Entry> entries;
  entries.reserve(root.keys.size());
  Checkpoint ck;
  for (std::size_t i = 0; i < root.keys.size(); ++i) {
    const std::string& key = root.keys[i];
    const Json& v = root.items[i];
    if (key == "__metadata__") {
      if (v.kind != Json::Kind::object) fail("__metadata__ must be an object, not " + std::string(kind_name(v.kind)));
      for (std::size_t j = 0; j < v.keys.size(); ++j) {
        if (v.items[j].kind != Json::Kind::string)
          fail("__metadata__ value of \"" + v.keys[j] + "\" must be a string, not " + kind_name(v.items[j].kind));
        ck.metadata[v.keys[j]] = v.items[j].text;
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
    Entry e{&key, *dt, {}, 0, 0};
    // As numel_of: a zero extent anywhere gives zero elements, whatever the other extents.
    bool zero = false;
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
    if (e.end > data.size())
      fail(what() + " ends at byte " + std::to_string(e.end) + " but the data holds only " +
           std::to_string(data.size()) + " bytes (file truncated?)");
    const std::uint64_t elem = size_of(*dt);
    // numel * elem may not fit in 64 bits (2^62 F32 elements): say so rather than print the
    // wrapped product.
    const bool fits = numel <= std::numeric_limits<std::uint64_t>::max() / elem;
    if (!fits || e.end - e.begin != numel * elem)
      fail(what() + ": shape " + to_string(e.shape) + " of " + dtype->text + " needs " +
           (fits ? std::to_string(numel * elem) : std::string("more than 2^64")) +
           " bytes but data_offsets span " + std::to_string(e.end - e.begin));
    entries.push_back(std::move(e));
  }

  // safetensors requires the tensors to tile the data exactly: sorted, no gap, no overlap.
  std::vector<const Entry*> order;
  order.reserve(entries.size());
  for (const auto& e : entries) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t expected = 0;
  for (const Entry* e : order) {
    if (e->begin < expected) fail("tensor \"" + *e->name + "\" overlaps the previous tensor's data");
    if (e->begin > expected)
      fail("gap in the data before tensor \"" + *e->name + "\" (bytes " + std::to_string(expected) +
           " to " + std::to_string(e->begin) + " belong to no tensor)");
    expected = e->end;
  }
  if (expected != data.size())
    fail("the data holds " + std::to_string(data.size()) + " bytes but the tensors cover " +
         std::to_string(expected) + " (trailing garbage or wrong header)");

  const auto fmt = ck.metadata.find(std::string(kFormatKey));
  if (fmt != ck.metadata.end() && fmt->second != "1")
    fail("unsupported lockstep.format \"" + fmt->second + "\" (this build reads format 1)");
  const auto sum = ck.metadata.find(std::string(kChecksumKey));
  if (sum == ck.metadata.end()) {
    if (opts.require_checksum) fail("no lockstep.checksum in the metadata (not written by Lockstep?)");
  } else {
    std::vector<HeaderItem> items;
    items.reserve(order.size());
    for (const Entry* e : order) items.push_back({*e->name, e->dtype, &e->shape, e->begin, e->end});
    const std::string actual = crc_text(full_checksum(data, items, ck.metadata));
    if (sum->second != actual)
      fail("checksum mismatch: the header says " + sum->second + " but the contents give " +
           actual + " (the file is corrupted)");
  }

  // File order: the order of the data, which is the order the writer added them in.
  ck.tensors.reserve(order.size());
  for (const Entry* e : order) {
    Tensor t(e->shape, e->dtype);
    copy_le(static_cast<std::byte*>(t.raw_data()), data.data() + e->begin, e->end - e->begin,
            size_of(e->dtype));
    ck.tensors.emplace_back(*e->name, std::move(t));
  }
  return ck;
}

// Temporary files. A writer killed between mkstemp and rename leaves its temporary file behind;
// the next successful save of the same path removes such leftovers. Other writers may be saving
// the same path at the same time, though (two jobs, two threads), and deleting a live writer's
// temporary file makes its rename fail. So a temporary file is named after its writer,
// ".NAME.tmp.PID.HOST.XXXXXX", and its writer holds an flock on it until the rename; a leftover is
// removed only when it is provably dead: written on this host, by a process that no longer
// exists (kill(pid, 0) fails with ESRCH), and its flock is free. Anything else (another host's,
// a live process's, a name of another form) is left alone.
namespace {

/// This host's name as it appears in temporary file names: [A-Za-z0-9-] only, at most 32
/// characters; a longer or rewritten name becomes a prefix and a hash of the full name.
const std::string& host_token() {
  static const std::string token = [] {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') std::strcpy(buf, "unknown-host");
    const std::string host = buf;
    std::string t;
    bool rewritten = false;
    for (char c : host) {
      const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
      t += ok ? c : '_';
      rewritten = rewritten || !ok;
    }
    if (!rewritten && t.size() <= 32) return t;
    char hex[24];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(detail::fnv1a(host.data(), host.size())));
    return t.substr(0, 15) + "~" + hex;
  }();
  return token;
}

/// ".NAME.tmp." for `path`: what every temporary file of that path starts with. A long NAME is
/// shortened to a prefix and a hash, so that the temporary name (about 60 characters more) stays
/// within the 255 bytes a file name may have wherever NAME itself does.
std::string temp_prefix(const std::filesystem::path& path) {
  const std::string name = path.filename().string();
  if (name.size() <= 150) return "." + name + ".tmp.";
  char hex[24];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(detail::fnv1a(name.data(), name.size())));
  return "." + name.substr(0, 100) + "~" + hex + ".tmp.";
}

/// Whether `rest` (a temporary file name after temp_prefix) is "PID.HOST.XXXXXX" of a process of
/// this host that no longer exists.
bool written_by_dead_local_process(std::string_view rest) {
  const std::size_t dot1 = rest.find('.');
  const std::size_t dot2 = rest.rfind('.');
  if (dot1 == std::string_view::npos || dot1 == dot2 || rest.size() - dot2 - 1 != 6) return false;
  const std::string_view pid_text = rest.substr(0, dot1);
  if (pid_text.empty() || pid_text.size() > 9 || pid_text.find_first_not_of("0123456789") != std::string_view::npos)
    return false;
  if (rest.substr(dot1 + 1, dot2 - dot1 - 1) != host_token()) return false;
  const pid_t pid = static_cast<pid_t>(std::stol(std::string(pid_text)));
  if (pid <= 0 || pid == ::getpid()) return false;  // this process's are other threads' live files
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

void remove_stale_temporaries(const std::filesystem::path& path) {
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  const std::string prefix = temp_prefix(path);
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    if (!written_by_dead_local_process(std::string_view(name).substr(prefix.size()))) continue;
    // Never block here (O_NONBLOCK: a FIFO of that name), never follow a link, and delete only a
    // regular file whose lock is free (its writer, even in another PID namespace, is gone).
    Fd c;
    c.fd = ::open(it->path().c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
    if (c.fd < 0) continue;
    struct stat st {};
    if (::fstat(c.fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::flock(c.fd, LOCK_EX | LOCK_NB) != 0) continue;
    ::unlink(it->path().c_str());
  }
}

}  // namespace

std::string detail::temporary_file_prefix(const std::filesystem::path& path, long pid) {
  return temp_prefix(path) + std::to_string(pid) + "." + host_token() + ".";
}

void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  std::string tmpl = (dir / (detail::temporary_file_prefix(path, ::getpid()) + "XXXXXX")).string();
  Fd f;
  f.fd = ::mkstemp(tmpl.data());
  if (f.fd < 0) throw CheckpointError(os_error("cannot create a temporary file in", dir));
  // The lock says "this writer is alive" to other writers' cleanup until the rename is done. It
  // belongs to the open file, so a duplicate descriptor keeps it while `f` is closed (and its
  // close checked) before the rename. Best effort: a file system without flock still has the
  // pid check.
  (void)::flock(f.fd, LOCK_EX | LOCK_NB);
  Fd lock;
  lock.fd = ::dup(f.fd);
  // From here on, any failure removes the temporary file so no debris is left behind.
  auto fail_with = [&](const std::string& msg) {
    ::unlink(tmpl.c_str());
    throw CheckpointError(msg);
  };
  const auto* p = reinterpret_cast<const char*>(bytes.data());
  std::size_t left = bytes.size();
  while (left > 0) {
    const ssize_t w = ::write(f.fd, p, left);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_with(os_error("cannot write", tmpl));
    }
    p += w;
    left -= static_cast<std::size_t>(w);
  }
  if (::fchmod(f.fd, 0644) != 0) fail_with(os_error("cannot chmod", tmpl));
  if (::fsync(f.fd) != 0) fail_with(os_error("cannot fsync", tmpl));
  const int fd = std::exchange(f.fd, -1);
  if (::close(fd) != 0) fail_with(os_error("cannot close", tmpl));
  if (::rename(tmpl.c_str(), path.c_str()) != 0) fail_with(os_error("cannot rename the temporary file to", path));
  if (lock.fd >= 0) ::close(std::exchange(lock.fd, -1));
  // The rename is durable only once the directory entry is on disk.
  Fd d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd < 0 || ::fsync(d.fd) != 0) throw CheckpointError(os_error("cannot fsync directory", dir));
  remove_stale_temporaries(path);
}

void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck) {
  write_file_atomically(path, serialize_checkpoint(ck));
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
  auto read_at = [&](std::byte* dst, std::size_t n, std::size_t offset) {
    std::size_t got = 0;
    while (got < n) {
      const ssize_t r = ::pread(f.fd, dst + got, n - got, static_cast<off_t>(offset + got));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw CheckpointError(os_error("cannot read", path));
      }
      if (r == 0) break;  // the file shrank while we read it; the parser reports the truncation
      got += static_cast<std::size_t>(r);
    }
    return got;
  };
  try {
    // The length prefix first: a file whose header cannot be valid is refused before the whole
    // file is read into memory.
    const auto size = static_cast<std::uint64_t>(st.st_size);
    std::byte first8[8] = {};
    const std::size_t got8 = read_at(first8, std::min<std::uint64_t>(8, size), 0);
    (void)checked_header_length(first8, got8 < 8 ? got8 : size);
    std::vector<std::byte> bytes(static_cast<std::size_t>(size));
    bytes.resize(read_at(bytes.data(), bytes.size(), 0));
    return parse_checkpoint(bytes, opts);
  } catch (const CheckpointError& e) {
    throw CheckpointError(std::string(e.what()) + " [" + path.string() + "]");
  }
}

// ---------------------------------------------------------------------------------------------
// Helpers of the structure-level templates in checkpoint.hpp.

namespace detail {

std::string join_leaf_name(std::string_view prefix, std::string_view path) {
  if (prefix.empty()) return std::string(path);
  if (path.empty()) return std::string(prefix);
  if (path.front() == '[') return std::string(prefix) + std::string(path);
  return std::string(prefix) + "." + std::string(path);
}

void check_tensor_usable(const char* what, const std::string& name, const Tensor& t) {
  const Shape& shape = t.shape();
  // numel_of: a zero extent anywhere is zero elements; a negative or overflowing shape throws.
  std::int64_t n = -1;
  bool counted = true;
  try {
    n = numel_of(shape);
  } catch (const Error&) {
    counted = false;
  }
  if (!counted || n != t.numel())
    throw InvalidArgument(std::string(what) + ": tensor \"" + name + "\" is not usable: its shape " +
                          to_string(shape) + " does not hold the " + std::to_string(t.numel()) +
                          " elements it claims (a moved-from Tensor?)");
  if (t.numel() > 0 && t.raw_data() == nullptr)
    throw InvalidArgument(std::string(what) + ": tensor \"" + name + "\" is not usable: " +
                          std::to_string(t.numel()) + " elements but no memory (a moved-from Tensor?)");
}

void throw_unstorable_scalar(const char* what, const std::string& name, const char* reason) {
  throw InvalidArgument(std::string(what) + ": leaf '" + (name.empty() ? std::string("(root)") : name) +
                        "' is " + reason);
}

void check_checkpoint_leaf(const std::string& name, DType file_dtype, const Shape& file_shape, DType dtype,
                           const Shape& shape) {
  if (file_dtype != dtype)
    throw CheckpointError("checkpoint: tensor \"" + name + "\" has dtype " +
                          safetensors_dtype_name(file_dtype) + " but the structure expects " +
                          safetensors_dtype_name(dtype) + " (checkpoint from a different model?)");
  if (file_shape != shape)
    throw CheckpointError("checkpoint: tensor \"" + name + "\" has shape " + to_string(file_shape) +
                          " but the structure expects " + to_string(shape) +
                          " (checkpoint from a different model?)");
}

void check_checkpoint_leaf(const std::string& name, const Tensor& t, DType dtype, const Shape& shape) {
  check_checkpoint_leaf(name, t.dtype(), t.shape(), dtype, shape);
}

namespace {
bool under_prefix(std::string_view name, std::string_view prefix) {
  return prefix.empty() || name == prefix ||
         (name.size() > prefix.size() && name.starts_with(prefix) &&
          (name[prefix.size()] == '.' || name[prefix.size()] == '['));
}

[[noreturn]] void throw_extra(std::string_view name) {
  throw CheckpointError("checkpoint: has tensor \"" + std::string(name) +
                        "\" that the structure being restored does not (checkpoint from a "
                        "different model?)");
}
}  // namespace

void check_no_extra_leaves(const Checkpoint& ck, std::string_view prefix,
                           const std::vector<std::string>& used) {
  const std::unordered_set<std::string_view> u(used.begin(), used.end());
  for (const auto& [name, t] : ck.tensors)
    if (under_prefix(name, prefix) && u.count(name) == 0) throw_extra(name);
}

// ---- CheckpointIndex and the table of contents -------------------------------------------

CheckpointIndex::CheckpointIndex(const Checkpoint& ck) {
  order_.reserve(ck.tensors.size());
  for (const auto& [name, t] : ck.tensors) order_.push_back({name, Entry{t.dtype(), &t.shape(), &t}});
  build();
}

void CheckpointIndex::build() {
  by_name_.reserve(order_.size());
  // The first of two equal names wins, as a linear find would (a Checkpoint's fields are public).
  for (std::size_t i = 0; i < order_.size(); ++i) by_name_.emplace(order_[i].first, i);
}

const CheckpointIndex::Entry* CheckpointIndex::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &order_[it->second].second;
}

void CheckpointIndex::check_no_extra(std::string_view prefix, const std::vector<std::string>& used) const {
  const std::unordered_set<std::string_view> u(used.begin(), used.end());
  for (const auto& [name, e] : order_)
    if (under_prefix(name, prefix) && u.count(name) == 0) throw_extra(name);
}

// Table of contents: u64 count, then per tensor u64 name length, name, u8 dtype, u64 rank,
// i64 extents; then u64 metadata count and per entry u64 length + key, u64 length + value.
// Native byte order: it only travels between the ranks of one job.
namespace {
void put_u64(std::string& out, std::uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_text(std::string& out, std::string_view t) {
  put_u64(out, t.size());
  out.append(t);
}

struct ContentsReader {
  std::string_view s;
  std::size_t pos = 0;
  [[noreturn]] static void bad() { fail("the table of contents received from the root is malformed"); }
  std::uint64_t u64() {
    if (s.size() - pos < 8) bad();
    std::uint64_t v;
    std::memcpy(&v, s.data() + pos, 8);
    pos += 8;
    return v;
  }
  std::uint8_t u8() {
    if (s.size() - pos < 1) bad();
    return static_cast<std::uint8_t>(s[pos++]);
  }
  std::string_view text() {
    const std::uint64_t n = u64();
    if (n > s.size() - pos) bad();
    const std::string_view t = s.substr(pos, n);
    pos += n;
    return t;
  }
  /// Bounds a count read from the input by the bytes left (each item takes at least `min_bytes`).
  std::uint64_t count(std::size_t min_bytes) {
    const std::uint64_t n = u64();
    if (n > (s.size() - pos) / min_bytes) bad();
    return n;
  }
};
}  // namespace

std::string pack_contents(const Checkpoint& ck) {
  std::string out;
  put_u64(out, ck.tensors.size());
  for (const auto& [name, t] : ck.tensors) {
    put_text(out, name);
    out += static_cast<char>(t.dtype());
    put_u64(out, t.shape().size());
    for (const auto e : t.shape()) put_u64(out, static_cast<std::uint64_t>(e));
  }
  put_u64(out, ck.metadata.size());
  for (const auto& [k, v] : ck.metadata) {
    put_text(out, k);
    put_text(out, v);
  }
  return out;
}

CheckpointIndex CheckpointIndex::from_contents(std::string_view contents) {
  ContentsReader r{contents};
  CheckpointIndex idx;
  const std::uint64_t n = r.count(17);
  idx.owned_names_.reserve(n);
  idx.owned_shapes_.reserve(n);
  std::vector<DType> dtypes;
  dtypes.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i) {
    idx.owned_names_.emplace_back(r.text());
    const std::uint8_t dt = r.u8();
    if (dt > static_cast<std::uint8_t>(DType::u8)) ContentsReader::bad();
    dtypes.push_back(static_cast<DType>(dt));
    const std::uint64_t rank = r.count(8);
    Shape shape(rank);
    for (auto& e : shape) e = static_cast<std::int64_t>(r.u64());
    idx.owned_shapes_.push_back(std::move(shape));
  }
  // The vectors are complete: views into them stay valid from here on.
  idx.order_.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i)
    idx.order_.push_back({idx.owned_names_[i], Entry{dtypes[i], &idx.owned_shapes_[i], nullptr}});
  idx.build();
  return idx;
}

std::map<std::string, std::string> unpack_metadata(std::string_view contents) {
  ContentsReader r{contents};
  const std::uint64_t n = r.count(17);
  for (std::uint64_t i = 0; i < n; ++i) {
    (void)r.text();
    (void)r.u8();
    const std::uint64_t rank = r.count(8);
    r.pos += 8 * rank;
  }
  std::map<std::string, std::string> meta;
  const std::uint64_t m = r.count(16);
  for (std::uint64_t i = 0; i < m; ++i) {
    std::string k(r.text());
    meta[std::move(k)] = std::string(r.text());
  }
  return meta;
}

void append_tensors(Checkpoint& ck, std::vector<std::pair<std::string, Tensor>> add) {
  std::unordered_set<std::string_view> names;
  names.reserve(ck.tensors.size() + add.size());
  for (const auto& [name, t] : ck.tensors) names.insert(name);
  for (const auto& [name, t] : add) {
    LOCKSTEP_CHECK_ARG(!name.empty(), "add_to_checkpoint: a tensor name must not be empty");
    LOCKSTEP_CHECK_ARG(!name.starts_with("__"), "add_to_checkpoint: name \"", name,
                       "\" starts with \"__\", which safetensors reserves");
    LOCKSTEP_CHECK_ARG(valid_utf8(name), "add_to_checkpoint: name \"", name, "\" is not valid UTF-8");
    LOCKSTEP_CHECK_ARG(names.insert(name).second, "add_to_checkpoint: duplicate tensor name \"", name,
                       "\" (already in the checkpoint, or two leaves with one name)");
  }
  ck.tensors.reserve(ck.tensors.size() + add.size());
  for (auto& item : add) ck.tensors.push_back(std::move(item));
}

std::string broadcast_string(Backend& backend, const std::string& s, int root) {
  std::int64_t n = static_cast<std::int64_t>(s.size());
  backend.broadcast(view_of(std::span<std::int64_t>(&n, 1)), root);
  std::string out = backend.rank() == root ? s : std::string(static_cast<std::size_t>(n), '\0');
  if (n > 0)
    backend.broadcast(TensorView{out.data(), n, DType::u8, Device::cpu()}, root);
  return out;
}

std::string broadcast_status(Backend& backend, std::string error, int root) {
  return broadcast_string(backend, error, root);
}

std::map<std::string, std::string> broadcast_metadata(Backend& backend,
                                                      const std::map<std::string, std::string>& meta,
                                                      int root) {
  // Length-prefixed key/value pairs in one string: two broadcasts whatever the size.
  std::string packed;
  if (backend.rank() == root) {
    for (const auto& [k, v] : meta) {
      packed += std::to_string(k.size()) + ':' + k + std::to_string(v.size()) + ':' + v;
    }
  }
  packed = broadcast_string(backend, packed, root);
  std::map<std::string, std::string> out;
  std::size_t pos = 0;
  auto next = [&] {
    const std::size_t colon = packed.find(':', pos);
    const std::size_t len = std::stoul(packed.substr(pos, colon - pos));
    std::string field = packed.substr(colon + 1, len);
    pos = colon + 1 + len;
    return field;
  };
  while (pos < packed.size()) {
    std::string k = next();
    out[std::move(k)] = next();
  }
  return out;
}

std::string current_error_message() {
  try {
    throw;
  } catch (const std::exception& e) {
    const std::string w = e.what();
    return w.empty() ? std::string("unknown error") : w;
  } catch (...) {
    return "unknown non-standard exception";
  }
}

Verdict current_verdict() {
  Verdict v;
  v.message = current_error_message();
  try {
    throw;
  } catch (const CheckpointError&) {
    v.kind = Verdict::Kind::checkpoint;
  } catch (const InvalidArgument&) {
    v.kind = Verdict::Kind::invalid_argument;
  } catch (const MismatchError&) {
    v.kind = Verdict::Kind::mismatch;
  } catch (...) {
    v.kind = Verdict::Kind::other;
  }
  return v;
}

namespace {
std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

[[noreturn]] void throw_of_kind(Verdict::Kind kind, const std::string& msg) {
  switch (kind) {
    case Verdict::Kind::checkpoint: throw CheckpointError(msg);
    case Verdict::Kind::invalid_argument: throw InvalidArgument(msg);
    case Verdict::Kind::mismatch: throw MismatchError(msg);
    default: throw Error(msg);
  }
}
}  // namespace

bool agree(Backend& backend, const char* what, int root, const Verdict& mine, std::uint64_t signature,
           const char* consequence) {
  // One allgather of (root, verdict kind, message length, signature) per rank: every rank then
  // sees the same table and takes the same branch.
  const int n = backend.size();
  std::int64_t me[4] = {root, static_cast<std::int64_t>(mine.kind),
                        mine.kind == Verdict::Kind::none ? 0 : static_cast<std::int64_t>(mine.message.size()),
                        static_cast<std::int64_t>(signature)};
  std::vector<std::int64_t> all(4 * static_cast<std::size_t>(n));
  backend.allgather(TensorView{me, 4, DType::i64, Device::cpu()},
                    TensorView{all.data(), 4 * static_cast<std::int64_t>(n), DType::i64, Device::cpu()});
  auto at = [&](int r, int k) { return all[4 * static_cast<std::size_t>(r) + static_cast<std::size_t>(k)]; };
  bool same_root = true;
  for (int r = 1; r < n; ++r) same_root = same_root && at(r, 0) == at(0, 0);
  if (!same_root) {
    std::string msg = std::string(what) + ": the ranks passed different roots (";
    for (int r = 0; r < n; ++r) msg += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + ": " + std::to_string(at(r, 0));
    msg += "); every rank must pass the same root; " + std::string(consequence);
    throw InvalidArgument(msg);
  }
  if (at(0, 0) < 0 || at(0, 0) >= n)
    throw InvalidArgument(std::string(what) + ": root " + std::to_string(at(0, 0)) +
                          " is not a rank of this backend (size " + std::to_string(n) + "); " + consequence);
  std::vector<int> failed;
  for (int r = 0; r < n; ++r)
    if (at(r, 1) != 0) failed.push_back(r);
  if (failed.empty()) {
    bool same = true;
    for (int r = 0; r < n; ++r) same = same && at(r, 3) == at(root, 3);
    return same;
  }
  // The lowest failing rank's error, broadcast from it, is every rank's error.
  const int k = failed.front();
  const auto len = at(k, 2);
  std::string text = backend.rank() == k ? mine.message : std::string(static_cast<std::size_t>(len), '\0');
  if (len > 0) backend.broadcast(TensorView{text.data(), len, DType::u8, Device::cpu()}, k);
  std::string msg = text + " [on " + rank_list({k}) + " of " + std::to_string(n);
  if (failed.size() > 1) msg += "; refused on " + rank_list(failed);
  msg += "; " + std::string(consequence) + "]";
  throw_of_kind(static_cast<Verdict::Kind>(at(k, 1)), msg);
}

void throw_root_error(const Backend& backend, const std::string& msg, int root) {
  if (backend.rank() == root) throw CheckpointError(msg);
  throw CheckpointError(msg + " [reported by rank " + std::to_string(root) + " to rank " +
                        std::to_string(backend.rank()) + "]");
}

}  // namespace detail

}  // namespace lockstep
