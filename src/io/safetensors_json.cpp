// The safetensors header's JSON. nlohmann::json's SAX parser does the syntax under a handler of
// ours (JsonBuilder) that refuses what a header must not hold; writing escapes strings.
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

#include <nlohmann/json.hpp>

#include "io/atomic_file.hpp"

namespace lockstep {
namespace detail::st {

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

}  // namespace detail::st

void detail::fail(const std::string& msg) { throw CheckpointError("checkpoint: " + msg); }

bool detail::valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = st::utf8_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

namespace detail::st {

using detail::Fd;
using detail::fail;
using detail::os_error;
using detail::valid_utf8;
using detail::write_atomically;

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

}  // namespace detail::st
}  // namespace lockstep
