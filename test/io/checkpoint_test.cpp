// Checkpoint reader and writer: round trips of every dtype, and every kind of corruption the
// reader must refuse (truncation at every length, every byte flipped, hand-made bad headers).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "lockstep/io/checkpoint.hpp"
#include "../../src/io/crc32c.hpp"

namespace ls = lockstep;
namespace fs = std::filesystem;

namespace {

std::span<const std::byte> as_span(const std::string& s) {
  return std::as_bytes(std::span<const char>(s));
}

/// A file with an explicit header (length prefix added) and data, for hand-made corruptions.
std::string make_file(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  const std::uint64_t n = header.size();
  for (int k = 0; k < 8; ++k) out[k] = static_cast<char>((n >> (8 * k)) & 0xFF);
  return out + header + data;
}

/// The message of the CheckpointError that parsing `bytes` throws ("" if it parses).
std::string parse_error(std::span<const std::byte> bytes, bool require_checksum = false) {
  try {
    (void)ls::parse_checkpoint(bytes, {.require_checksum = require_checksum});
  } catch (const ls::CheckpointError& e) {
    return e.what();
  }
  return "";
}

ls::Checkpoint sample_checkpoint() {
  ls::Checkpoint ck;
  ck.add("w", ls::Tensor::from(std::vector<float>{1.5f, -2.f, 3.25f, 0.f, 1e-30f, -0.f}, {2, 3}));
  ck.add("d", ls::Tensor::from(std::vector<double>{3.141592653589793, -1e300}, {2}));
  ck.add("i", ls::Tensor::from(std::vector<std::int32_t>{-7, 2147483647}, {2, 1}));
  ck.add("l", ls::Tensor::from(std::vector<std::int64_t>{-(1ll << 62), 42}, {1, 2}));
  ck.add("u", ls::Tensor::from(std::vector<std::uint8_t>{0, 255, 7}, {3}));
  ck.add("h", ls::Tensor::from(std::vector<ls::half>{ls::to_half(1.5f), ls::to_half(-2.f)}, {2}));
  ck.add("b", ls::Tensor::from(std::vector<ls::bfloat16>{ls::to_bfloat16(0.5f)}, {1}));
  ck.add("scalar", ls::Tensor::from(std::vector<std::int64_t>{12}, ls::Shape{}));
  ck.add("empty", ls::Tensor::zeros({0, 4}));
  ck.add("layer.0/weight \"q\" \xc3\xa9", ls::Tensor::from(std::vector<float>{9.f}, {1}));
  ck.metadata["epoch"] = "12";
  ck.metadata["note"] = "tab\there \"quoted\" \\ newline\n \xe2\x82\xac";
  return ck;
}

bool same(const ls::Checkpoint& a, const ls::Checkpoint& b) {
  if (a.tensors.size() != b.tensors.size()) return false;
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].first != b.tensors[i].first) return false;
    if (a.tensors[i].second.shape() != b.tensors[i].second.shape()) return false;
    if (!ls::bitwise_equal(a.tensors[i].second, b.tensors[i].second)) return false;
  }
  return a.metadata == b.metadata;
}

}  // namespace

TEST_CASE("crc32c matches the standard check value", "[checkpoint]") {
  const std::string s = "123456789";
  CHECK(ls::crc32c(as_span(s)) == 0xE3069283u);
  // Incremental use gives the same as one pass, over the slice-by-8 boundary.
  const std::string long_s(1000, 'x');
  const auto all = ls::crc32c(as_span(long_s));
  CHECK(ls::crc32c(as_span(long_s).subspan(13), ls::crc32c(as_span(long_s).first(13))) == all);
}

TEST_CASE("both CRC-32C paths give the known values, over every length and alignment", "[checkpoint]") {
  // The table path always exists; the SSE4.2 path where the CPU has the instruction (checked
  // against the table path, which is itself checked against the published values).
  using Fn = std::uint32_t (*)(const std::byte*, std::size_t, std::uint32_t) noexcept;
  std::vector<std::pair<const char*, Fn>> paths = {{"table", &ls::detail::crc32c_table}};
  if (ls::detail::crc32c_hardware_available())
    paths.emplace_back("sse4.2", &ls::detail::crc32c_hardware);
  else
    WARN("this CPU has no SSE4.2: only the table path is tested");
  CHECK(std::string(ls::detail::crc32c_implementation()) ==
        (ls::detail::crc32c_hardware_available() ? "sse4.2" : "table"));
#if defined(__x86_64__)
  // Every x86-64 CPU of the last fifteen years has it; a build that never takes it is a bug.
  CHECK(ls::detail::crc32c_hardware_available() == static_cast<bool>(__builtin_cpu_supports("sse4.2")));
#endif
  // The check value of the CRC catalogue and the iSCSI test vectors (RFC 3720, B.4).
  std::vector<std::pair<std::vector<std::uint8_t>, std::uint32_t>> known;
  known.push_back({{'1', '2', '3', '4', '5', '6', '7', '8', '9'}, 0xE3069283u});
  known.push_back({std::vector<std::uint8_t>(32, 0x00), 0x8A9136AAu});
  known.push_back({std::vector<std::uint8_t>(32, 0xFF), 0x62A8AB43u});
  std::vector<std::uint8_t> up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);
    down[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(31 - i);
  }
  known.push_back({up, 0x46DD794Eu});
  known.push_back({down, 0x113FDB5Cu});
  known.push_back({{}, 0u});
  for (const auto& [name, fn] : paths) {
    INFO("path " << name);
    for (const auto& [bytes, value] : known)
      CHECK(fn(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size(), 0) == value);
  }
  // Long inputs (the SSE4.2 path runs three blocks of 8 KiB side by side above 24 KiB), at every
  // alignment, in one pass and in two pieces, through both paths and the public function.
  std::mt19937_64 rng(7);
  std::vector<std::byte> buf(3 * 8192 * 3 + 1000);
  for (auto& b : buf) b = static_cast<std::byte>(rng());
  for (std::size_t len : {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{63}, std::size_t{24575},
                          std::size_t{24576}, std::size_t{24577}, std::size_t{3 * 8192 * 2 + 17}, std::size_t{3 * 8192 * 3}}) {
    for (std::size_t align = 0; align < 8; ++align) {
      const std::byte* p = buf.data() + align;
      const std::uint32_t want = ls::detail::crc32c_table(p, len, 0);
      CHECK(ls::crc32c(std::span(p, len)) == want);
      for (const auto& [name, fn] : paths) {
        INFO("path " << name << ", length " << len << ", alignment " << align);
        CHECK(fn(p, len, 0) == want);
        const std::size_t cut = len / 3;
        CHECK(fn(p + cut, len - cut, fn(p, cut, 0)) == want);
      }
    }
  }
  // A single flipped bit anywhere in a long input changes the result on every path.
  for (const auto& [name, fn] : paths) {
    INFO("path " << name);
    const std::uint32_t ref = fn(buf.data(), buf.size(), 0);
    for (std::size_t i : {std::size_t{0}, std::size_t{8191}, std::size_t{8192}, std::size_t{20000}, buf.size() - 1}) {
      buf[i] ^= std::byte{0x04};
      CHECK(fn(buf.data(), buf.size(), 0) != ref);
      buf[i] ^= std::byte{0x04};
    }
  }
}

TEST_CASE("Checkpoint::find and add through the name index, after direct edits of tensors", "[checkpoint]") {
  ls::Checkpoint ck;
  for (int i = 0; i < 1000; ++i) ck.add("t" + std::to_string(i), ls::Tensor::full({1}, float(i)));
  REQUIRE(ck.find("t999") != nullptr);
  CHECK(ck.find("t999")->data<float>()[0] == 999.0f);
  CHECK(ck.find("t1000") == nullptr);
  CHECK_THROWS_WITH(ck.add("t5", ls::Tensor::full({1}, 0.0f)), Catch::Contains("duplicate tensor name \"t5\""));
  // Appended directly, renamed in place, removed, reordered: every lookup sees the vector as it is.
  ck.tensors.emplace_back("direct", ls::Tensor::full({1}, -1.0f));
  REQUIRE(ck.find("direct") != nullptr);
  CHECK(ck.find("direct")->data<float>()[0] == -1.0f);
  ck.tensors[3].first = "renamed";
  CHECK(ck.find("t3") == nullptr);
  REQUIRE(ck.find("renamed") != nullptr);
  CHECK(ck.find("renamed")->data<float>()[0] == 3.0f);
  ck.tensors.erase(ck.tensors.begin());
  CHECK(ck.find("t0") == nullptr);
  REQUIRE(ck.find("t1") != nullptr);
  CHECK(ck.find("t1")->data<float>()[0] == 1.0f);
  std::swap(ck.tensors[0], ck.tensors[500]);
  CHECK(ck.find("t1")->data<float>()[0] == 1.0f);
  CHECK(ck.find("t501")->data<float>()[0] == 501.0f);
  ck.add("t0", ls::Tensor::full({1}, 7.0f));  // free again after the erase
  CHECK(ck.at("t0").data<float>()[0] == 7.0f);
  CHECK_THROWS_AS(ck.at("nothing"), ls::CheckpointError);
  // The index moves with the tensors; a moved-from checkpoint is empty and usable.
  ls::Checkpoint moved = std::move(ck);
  CHECK(moved.find("t501")->data<float>()[0] == 501.0f);
  CHECK(ck.find("t501") == nullptr);
  ck.add("t501", ls::Tensor::full({1}, 1.0f));
  CHECK(ck.tensors.size() == 1);
  // Two equal names given directly: the first is found, as by a scan.
  ck.tensors.emplace_back("t501", ls::Tensor::full({1}, 2.0f));
  CHECK(ck.find("t501")->data<float>()[0] == 1.0f);
}

TEST_CASE("round trip of every dtype, scalars, empty tensors, odd names", "[checkpoint]") {
  const ls::Checkpoint ck = sample_checkpoint();
  const auto bytes = ls::serialize_checkpoint(ck);
  // The data starts 8-byte aligned, as safetensors writes it.
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
  ls::Checkpoint back = ls::parse_checkpoint(bytes);
  CHECK(back.metadata.count(std::string(ls::kChecksumKey)) == 1);
  CHECK(back.metadata.at(std::string(ls::kFormatKey)) == "1");
  back.metadata.erase(std::string(ls::kChecksumKey));
  back.metadata.erase(std::string(ls::kFormatKey));
  CHECK(same(ck, back));
  CHECK(back.at("scalar").ndim() == 0);
  CHECK(back.at("empty").shape() == ls::Shape{0, 4});
  // Writing what was read gives the same bytes: the format is canonical.
  CHECK(ls::serialize_checkpoint(ls::parse_checkpoint(bytes)) == bytes);
}

TEST_CASE("an empty checkpoint round trips", "[checkpoint]") {
  ls::Checkpoint ck;
  const auto back = ls::parse_checkpoint(ls::serialize_checkpoint(ck));
  CHECK(back.tensors.empty());
}

TEST_CASE("save and load through a file, atomically", "[checkpoint]") {
  const fs::path dir = fs::temp_directory_path() / ("lockstep-ck-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path p = dir / "ck.safetensors";
  ls::save_checkpoint(p, sample_checkpoint());
  ls::Checkpoint a = ls::load_checkpoint(p);
  CHECK(a.metadata.at("epoch") == "12");
  // Overwriting replaces the file; no temporary file is left behind.
  ls::Checkpoint ck2 = sample_checkpoint();
  ck2.metadata["epoch"] = "13";
  ls::save_checkpoint(p, ck2);
  CHECK(ls::load_checkpoint(p).metadata.at("epoch") == "13");
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file() ? 1 : 0;
  CHECK(files == 1);
  // A directory that does not exist: a clear error, and the old file is untouched.
  CHECK_THROWS_WITH(ls::save_checkpoint(dir / "nope" / "ck.safetensors", ck2),
                    Catch::Contains("cannot create a temporary file"));
  CHECK_THROWS_WITH(ls::load_checkpoint(dir / "missing"), Catch::Contains("cannot open"));
  CHECK_THROWS_WITH(ls::load_checkpoint(dir), Catch::Contains("not a regular file"));
  fs::remove_all(dir);
}

TEST_CASE("the API refuses bad names", "[checkpoint]") {
  ls::Checkpoint ck;
  ck.add("a", ls::Tensor::zeros({1}));
  CHECK_THROWS_AS(ck.add("a", ls::Tensor::zeros({1})), ls::InvalidArgument);
  CHECK_THROWS_AS(ck.add("", ls::Tensor::zeros({1})), ls::InvalidArgument);
  CHECK_THROWS_AS(ck.add("__metadata__", ls::Tensor::zeros({1})), ls::InvalidArgument);
  CHECK_THROWS_AS(ck.add("\xff", ls::Tensor::zeros({1})), ls::InvalidArgument);
  CHECK_THROWS_AS(ck.at("b"), ls::CheckpointError);
}

TEST_CASE("every truncation is refused", "[checkpoint]") {
  const auto bytes = ls::serialize_checkpoint(sample_checkpoint());
  int refused = 0;
  for (std::size_t len = 0; len < bytes.size(); ++len) {
    try {
      (void)ls::parse_checkpoint(std::span(bytes).first(len));
    } catch (const ls::CheckpointError&) {
      ++refused;
    }
  }
  CHECK(refused == static_cast<int>(bytes.size()));
  CHECK_THAT(parse_error(std::span(bytes).first(bytes.size() - 1)), Catch::Contains("truncated"));
  CHECK_THAT(parse_error(std::span(bytes).first(5)), Catch::Contains("truncated"));
}

TEST_CASE("every flipped byte is refused or harmless", "[checkpoint]") {
  const ls::Checkpoint ck = sample_checkpoint();
  const auto bytes = ls::serialize_checkpoint(ck);
  const ls::Checkpoint ref = ls::parse_checkpoint(bytes);
  int refused = 0, harmless = 0, silent = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    for (unsigned char mask : {0x01, 0x80, 0xFF}) {
      auto b = bytes;
      b[i] ^= static_cast<std::byte>(mask);
      try {
        const ls::Checkpoint got = ls::parse_checkpoint(b);
        // Only changes that do not alter the contents may pass (say, padding space to tab).
        if (same(got, ref)) ++harmless; else ++silent;
      } catch (const ls::CheckpointError&) {
        ++refused;
      }
    }
  }
  CHECK(silent == 0);
  CHECK(refused > 0);
  INFO("refused " << refused << ", harmless " << harmless);
  // A flip in the data region is a checksum mismatch, named as such.
  auto b = bytes;
  b[b.size() - 3] ^= std::byte{0x10};
  CHECK_THAT(parse_error(b, true), Catch::Contains("checksum mismatch"));
}

TEST_CASE("random garbage never crashes the reader", "[checkpoint]") {
  std::mt19937_64 rng(1234);
  const auto good = ls::serialize_checkpoint(sample_checkpoint());
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<std::byte> b;
    if (iter % 2 == 0) {
      b.resize(rng() % 200);
      for (auto& x : b) x = static_cast<std::byte>(rng());
      if (b.size() >= 8 && iter % 4 == 0) {  // plausible length prefix
        const std::uint64_t n = rng() % (b.size() - 7);
        for (int k = 0; k < 8; ++k) b[k] = static_cast<std::byte>((n >> (8 * k)) & 0xFF);
      }
    } else {  // the good file with a few random bytes overwritten
      b = good;
      for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k)
        b[rng() % b.size()] = static_cast<std::byte>(rng());
    }
    try {
      (void)ls::parse_checkpoint(b, {.require_checksum = (iter % 3 != 0)});
    } catch (const ls::CheckpointError&) {
    }
  }
  SUCCEED("no crash, only CheckpointError");
}

TEST_CASE("hand-made bad headers get a message naming the problem", "[checkpoint]") {
  const std::string f4(4, '\0');  // four data bytes: one f32
  auto err = [&](const std::string& header, const std::string& data = std::string(4, '\0')) {
    return parse_error(as_span(make_file(header, data)));
  };
  // A good minimal file, written by hand the way Python's safetensors would (no checksum).
  CHECK(err(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})") == "");
  CHECK(parse_error(as_span(make_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f4)),
                    true)
            .find("no lockstep.checksum") != std::string::npos);

  struct Case {
    std::string header, expect;
  };
  const std::vector<Case> cases = {
      {R"({"x":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", "unsupported dtype"},
      {R"({"x":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}})", "unsupported dtype"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "needs 8 bytes"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "end < begin"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", "truncated"},
      {R"({"x":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"y":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
       "overlaps"},
      {R"({"y":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", "gap"},
      {R"({"y":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "trailing"},
      {R"({"x":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "non-negative integer"},
      {R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "non-negative integer"},
      {R"({"x":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}})", "non-negative integer"},
      {R"({"x":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,4]}})", "too large"},
      {R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", "too many elements"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "data_offsets"},
      {R"({"x":{"dtype":"F32","shape":[1]}})", "needs dtype, shape and data_offsets"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", "unknown field"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "duplicate key"},
      {R"({"x":[1]})", "must be an object"},
      {R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "empty name"},
      {R"({"__t.step":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "reserved for __metadata__"},
      {R"({"__metadata__":{"a":1},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "must be a string"},
      {R"({"__metadata__":[],"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "must be an object"},
      {R"({"__metadata__":{"lockstep.format":"2"},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "unsupported lockstep.format"},
      {R"({"__metadata__":{"lockstep.checksum":"crc32c:00000000"},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "checksum mismatch"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},})", "expected a string key"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x)", "after the JSON value"},
      {R"({"x":{"dtype":"F32" "shape":[1]}})", "expected ','"},
      {R"({"x\u00":1})", "invalid hex digit"},
      {R"({"x\ud800":1})", "surrogate"},
      {R"({"x\udc00":1})", "lone low surrogate"},
      {R"({"x\q":1})", "invalid escape"},
      {"{\"x\x01\":1}", "control character"},
      {"{\"x\xc0\xaf\":1}", "invalid UTF-8"},
      {"{\"x\xed\xa0\x80\":1}", "invalid UTF-8"},
      {R"({"x":tru})", "invalid literal"},
      {R"({"x":01})", "expected ','"},
      {R"({"x":-})", "invalid number"},
      {R"({"x":1.})", "no digit after '.'"},
      {R"({"x":1e})", "no digit in exponent"},
      {R"({"x":"abc)", "unterminated"},
      {"[1]", "does not start with '{'"},
      {R"({"x":)", "unexpected end"},
      {[] {
         std::string s;
         for (int i = 0; i < 100; ++i) s += R"({"a":)";
         return s;
       }(),
       "nested deeper"},
      {R"({"x":{"a":[[[[{"b":null,"c":true,"d":false}]]]]}})", "unknown field"},
  };
  for (const auto& c : cases) {
    INFO("header: " << c.header);
    CHECK_THAT(err(c.header), Catch::Contains(c.expect));
  }
  // Header length beyond the file, and absurd lengths.
  std::string bad = make_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f4);
  bad[0] = static_cast<char>(0xFF);
  CHECK_THAT(parse_error(as_span(bad)), Catch::Contains("exceeds"));
  bad[7] = static_cast<char>(0xFF);
  CHECK_THAT(parse_error(as_span(bad)), Catch::Contains("exceeds"));
  CHECK_THAT(parse_error(as_span(make_file("{"))), Catch::Contains("too small"));
}

// ---- Defects found by adversarial testing (docs/reliability.md, checkpoint catalogue) ---------

namespace {

/// A scratch directory of this process, removed at scope exit.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(const std::string& tag)
      : path(fs::temp_directory_path() / ("lockstep-ck-" + tag + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// Runs f (which may block in open() on a FIFO) with a rescue: if it has not returned after
/// `seconds`, the FIFO is opened for writing and closed, which ends a blocked open() (the reader
/// then sees an empty file). Returns f's CheckpointError message, "" if it returned, and sets
/// `blocked` if the rescue was needed.
template <class F>
std::string without_blocking(const fs::path& fifo, F&& f, bool& blocked, int seconds = 5) {
  std::promise<std::string> done;
  auto result = done.get_future();
  std::thread t([&] {
    try {
      f();
      done.set_value("");
    } catch (const std::exception& e) {
      done.set_value(e.what());
    }
  });
  blocked = result.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready;
  if (blocked) {
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (w >= 0) ::close(w);
  }
  std::string msg = result.get();
  t.join();
  return msg;
}

ls::Checkpoint filled_checkpoint(float value, std::int64_t n) {
  ls::Checkpoint ck;
  ck.add("w", ls::Tensor::full({n}, value));
  ck.add("b", ls::Tensor::full({3}, value));
  ck.metadata["value"] = std::to_string(value);
  return ck;
}

}  // namespace

TEST_CASE("a FIFO, a device or a directory is refused at once, naming the path", "[checkpoint]") {
  ScratchDir dir("fifo");
  const fs::path fifo = dir.path / "ck.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  const fs::path link = dir.path / "link-to-fifo";
  fs::create_symlink(fifo, link);
  for (const fs::path& p : {fifo, link}) {
    INFO("path " << p);
    bool blocked = false;
    const std::string msg = without_blocking(p, [&] { (void)ls::load_checkpoint(p); }, blocked);
    CHECK_FALSE(blocked);  // before the fix, open() waited for a writer forever
    CHECK_THAT(msg, Catch::Contains("is not a regular file") && Catch::Contains("FIFO") &&
                        Catch::Contains(p.string()));
  }
  CHECK_THROWS_WITH(ls::load_checkpoint("/dev/null"),
                    Catch::Contains("/dev/null is not a regular file") && Catch::Contains("character device"));
  CHECK_THROWS_WITH(ls::load_checkpoint(dir.path), Catch::Contains("not a regular file") &&
                                                      Catch::Contains("a directory"));
}

TEST_CASE("a header length beyond the limit is refused before the file is read", "[checkpoint]") {
  ScratchDir dir("bighdr");
  const fs::path p = dir.path / "big.safetensors";
  {
    // 300 MiB, sparse: a length prefix of 200 MiB and nothing else.
    std::ofstream out(p, std::ios::binary);
    const std::uint64_t n = 200ull << 20;
    char prefix[8];
    for (int k = 0; k < 8; ++k) prefix[k] = static_cast<char>((n >> (8 * k)) & 0xFF);
    out.write(prefix, 8);
  }
  fs::resize_file(p, 300ull << 20);
  CHECK_THROWS_WITH(ls::load_checkpoint(p), Catch::Contains("exceeds the 100 MiB limit") && Catch::Contains(p.string()));
}

TEST_CASE("two threads saving the same path at once both succeed, and the file is one of theirs",
          "[checkpoint]") {
  ScratchDir dir("threads");
  const fs::path p = dir.path / "ck.safetensors";
  const ls::Checkpoint a = filled_checkpoint(1.f, 1 << 14), b = filled_checkpoint(2.f, 1 << 14);
  std::atomic<int> failures{0};
  std::string first_error;
  std::mutex m;
  auto writer = [&](const ls::Checkpoint& ck) {
    for (int i = 0; i < 40; ++i) {
      try {
        ls::save_checkpoint(p, ck);
      } catch (const std::exception& e) {
        ++failures;
        std::lock_guard<std::mutex> g(m);
        if (first_error.empty()) first_error = e.what();
      }
    }
  };
  std::thread t1(writer, std::cref(a)), t2(writer, std::cref(b));
  t1.join();
  t2.join();
  INFO("first failure: " << first_error);
  CHECK(failures == 0);
  const ls::Checkpoint got = ls::load_checkpoint(p);
  const std::string v = got.metadata.at("value");
  CHECK((v == a.metadata.at("value") || v == b.metadata.at("value")));
  const ls::Checkpoint& want = v == a.metadata.at("value") ? a : b;
  CHECK(ls::bitwise_equal(got.at("w"), want.at("w")));
  CHECK(ls::bitwise_equal(got.at("b"), want.at("b")));
  int others = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) others += e.path() != p ? 1 : 0;
  CHECK(others == 0);  // each writer's temporary file became the checkpoint
}

TEST_CASE("a file name as long as the file system allows still saves", "[checkpoint]") {
  ScratchDir dir("longname");
  const fs::path p = dir.path / (std::string(250, 'n') + ".ckpt");  // 255 bytes, the limit
  ls::save_checkpoint(p, filled_checkpoint(3.f, 4));
  ls::save_checkpoint(p, filled_checkpoint(4.f, 4));
  CHECK(ls::load_checkpoint(p).metadata.at("value") == std::to_string(4.f));
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) files += e.is_regular_file() ? 1 : 0;
  CHECK(files == 1);
}

TEST_CASE("a leftover temporary file is removed only when its writer is dead", "[checkpoint]") {
  ScratchDir dir("leftover");
  const fs::path p = dir.path / "ck.safetensors";
  // A process of this host that has exited (and been reaped): its file goes.
  const pid_t child = ::fork();
  if (child == 0) std::_Exit(0);
  REQUIRE(child > 0);
  ::waitpid(child, nullptr, 0);
  const std::string dead = ls::detail::temporary_file_prefix(p, child) + "AbC123";
  // A live process (this one's parent), another host, and an older form without a writer: all
  // left alone.
  const std::string prefix = ".ck.safetensors.tmp.";
  const std::vector<std::string> kept = {
      ls::detail::temporary_file_prefix(p, ::getppid()) + "AbC123",
      prefix + "12345.some-other-host.AbC123",
      prefix + "Zz9Yy8",
  };
  for (const auto& n : kept) std::ofstream(dir.path / n) << "partial";
  std::ofstream(dir.path / dead) << "partial";
  ls::save_checkpoint(p, filled_checkpoint(5.f, 4));
  CHECK_FALSE(fs::exists(dir.path / dead));
  for (const auto& n : kept) {
    INFO(n);
    CHECK(fs::exists(dir.path / n));
  }
}

// Under AddressSanitizer every allocation records a full stack (fast_unwind_on_malloc=0), which
// makes the 250k-tensor case take minutes: there a tenth of the size still exercises the same
// code (the hash sets take over from 16 keys).
#if defined(__SANITIZE_ADDRESS__)
constexpr int kSizeDivisor = 10;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr int kSizeDivisor = 10;
#else
constexpr int kSizeDivisor = 1;
#endif
#else
constexpr int kSizeDivisor = 1;
#endif

TEST_CASE("a header with 250k tensors is parsed, refused or restored in linear time", "[checkpoint]") {
  constexpr int kKeys = 250000 / kSizeDivisor;
  std::string header = "{";
  for (int i = 0; i < kKeys; ++i) {
    if (i) header += ',';
    header += "\"t" + std::to_string(i) + "\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}";
  }
  const std::string good = make_file(header + "}");
  const ls::Checkpoint ck = ls::parse_checkpoint(as_span(good), {.require_checksum = false});
  CHECK(ck.tensors.size() == static_cast<std::size_t>(kKeys));
  // The same with the first name repeated at the end: refused, naming it.
  const std::string dup = make_file(header + ",\"t0\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}");
  CHECK_THAT(parse_error(as_span(dup)), Catch::Contains("duplicate key \"t0\""));
  // A structure of 50k leaves through add_to_checkpoint, the bytes and restore_from_checkpoint
  // (each of them was quadratic in the number of tensors too).
  constexpr int kLeaves = 50000 / kSizeDivisor;
  std::vector<ls::Tensor> many(kLeaves);
  ls::Checkpoint out;
  ls::add_to_checkpoint(out, many, "m");
  const auto bytes = ls::serialize_checkpoint(out);
  const ls::Checkpoint back = ls::parse_checkpoint(bytes);
  std::vector<ls::Tensor> restored(kLeaves);
  ls::restore_from_checkpoint(back, restored, "m");
  CHECK(back.tensors.size() == static_cast<std::size_t>(kLeaves));
  std::vector<ls::Tensor> one_more(kLeaves + 1);
  CHECK_THROWS_WITH(ls::restore_from_checkpoint(back, one_more, "m"), Catch::Contains("has no tensor \"m[" + std::to_string(kLeaves) + "]\""));
}

namespace cku {
struct Mixed {
  ls::Tensor w;
  long double ld = 0;
};
LOCKSTEP_FIELDS(Mixed, w, ld)
struct Wide {
  ls::Tensor w;
  __int128 big = 0;
};
LOCKSTEP_FIELDS(Wide, w, big)
struct Pair {
  ls::Tensor a, m;
};
LOCKSTEP_FIELDS(Pair, a, m)
}  // namespace cku

TEST_CASE("long double and 128-bit leaves are refused by name, and nothing is added", "[checkpoint]") {
  cku::Mixed x{ls::Tensor::full({2}, 1.0), 0.1L};
  ls::Checkpoint ck;
  CHECK_THROWS_AS(ls::add_to_checkpoint(ck, x, "net"), ls::InvalidArgument);
  CHECK_THROWS_WITH(ls::add_to_checkpoint(ck, x, "net"),
                    Catch::Contains("leaf 'net.ld' is a long double") && Catch::Contains("store it as a double"));
  CHECK(ck.tensors.empty());  // all or nothing: "net.w" was not added either
  cku::Wide y{ls::Tensor::full({2}, 1.0), 1};
  CHECK_THROWS_WITH(ls::add_to_checkpoint(ck, y), Catch::Contains("leaf 'big' is a 128-bit integer"));
  CHECK(ck.tensors.empty());
  // Restoring into one is refused the same way, before anything is written.
  ls::Checkpoint file;
  file.add("w", ls::Tensor::full({2}, 7.0));
  file.add("ld", ls::Tensor::full(ls::Shape{}, 7.0, ls::DType::f64));
  CHECK_THROWS_WITH(ls::restore_from_checkpoint(file, x), Catch::Contains("leaf 'ld' is a long double"));
  CHECK(x.w.span<float>()[0] == 1.f);
}

TEST_CASE("a moved-from tensor is an empty tensor: saved as one, and refused where the file differs",
          "[checkpoint]") {
  ScratchDir dir("moved");
  const fs::path p = dir.path / "ck.safetensors";
  ls::save_checkpoint(p, filled_checkpoint(6.f, 4));
  cku::Pair x{ls::Tensor::full({3}, 1.0), ls::Tensor::full({4}, 2.0)};
  ls::Tensor taken = std::move(x.m);  // x.m is now moved-from: Tensor(), shape [0]
  ls::Checkpoint ck;
  ls::add_to_checkpoint(ck, x);
  CHECK(ck.at("m").numel() == 0);  // an empty tensor, never the memory it moved to
  // Restore: "a" would be written first, then "m" found to differ (a scalar in the file, an
  // empty tensor here); nothing may be written.
  ls::Checkpoint file;
  file.add("a", ls::Tensor::full({3}, 9.0));
  file.add("m", ls::Tensor::full(ls::Shape{}, 9.0));
  CHECK_THROWS(ls::restore_from_checkpoint(file, x));
  CHECK(x.a.span<float>()[0] == 1.f);
  // A moved-from Checkpoint is an empty one: restoring from it names the first missing tensor.
  ls::Checkpoint taken_file = std::move(file);
  x.m = ls::Tensor::full({4}, 2.0);
  CHECK_THROWS_WITH(ls::restore_from_checkpoint(file, x), Catch::Contains("has no tensor \"a\""));
  cku::Pair y{ls::Tensor::full({3}, 1.0), ls::Tensor::full(ls::Shape{}, 2.0)};
  ls::restore_from_checkpoint(taken_file, y);  // the moved-to one holds what file held
  CHECK(y.a.span<float>()[0] == 9.f);
}

TEST_CASE("sizes near the integer limits are refused with the right numbers", "[checkpoint]") {
  auto err = [&](const std::string& header) { return parse_error(as_span(make_file(header, std::string(4, '\0')))); };
  // 2^62 f32 elements need 2^64 bytes: not "0 bytes" (the wrapped product).
  CHECK_THAT(err(R"({"x":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4]}})"),
             Catch::Contains("needs more than 2^64 bytes"));
  CHECK_THAT(err(R"({"x":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,4]}})"),
             Catch::Contains("needs more than 2^64 bytes"));
  CHECK_THAT(err(R"({"x":{"dtype":"U8","shape":[0],"data_offsets":[9223372036854775807,9223372036854775807]}})"),
             Catch::Contains("but the data holds only 4 bytes"));
  CHECK_THAT(err(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,9223372036854775808]}})"),
             Catch::Contains("too large"));
  // A zero extent anywhere is zero elements (as numel_of), whatever the other extents.
  CHECK_THAT(err(R"({"x":{"dtype":"U8","shape":[3037000500,3037000500,0],"data_offsets":[0,4]}})"),
             Catch::Contains("needs 0 bytes"));
}

TEST_CASE("a write that fails midway leaves the old checkpoint and no temporary file", "[checkpoint]") {
  ScratchDir dir("partial");
  const fs::path p = dir.path / "ck.safetensors";
  ls::save_checkpoint(p, filled_checkpoint(7.f, 4));
  // The file size limit makes write() fail with EFBIG after 64 KiB, as a full disk would.
  struct rlimit old {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 64 * 1024;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::string msg;
  try {
    ls::save_checkpoint(p, filled_checkpoint(8.f, 1 << 20));
  } catch (const ls::CheckpointError& e) {
    msg = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  CHECK_THAT(msg, Catch::Contains("cannot write"));
  CHECK(ls::load_checkpoint(p).metadata.at("value") == std::to_string(7.f));
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) files += 1;
  CHECK(files == 1);
}

namespace {
// x = std::move(x) through a reference, so that the compiler sees no self-move to warn about.
template <class T>
void self_move(T& x) {
  T& alias = x;
  x = std::move(alias);
}
}  // namespace

TEST_CASE("a moved-from Checkpoint is empty and usable; self-move keeps it", "[checkpoint][move]") {
  ls::Checkpoint a = sample_checkpoint();
  const std::size_t n = a.tensors.size();
  const std::size_t m = a.metadata.size();
  REQUIRE(n > 0);
  REQUIRE(m > 0);
  const std::string first = a.tensors.front().first;
  const void* data = a.tensors.front().second.raw_data();

  ls::Checkpoint b = std::move(a);
  CHECK(b.tensors.size() == n);
  CHECK(b.metadata.size() == m);
  CHECK(b.at(first).raw_data() == data);
  // The moved-from checkpoint is empty, and behaves as an empty checkpoint.
  CHECK(a.tensors.empty());
  CHECK(a.metadata.empty());
  CHECK(a.find(first) == nullptr);
  CHECK_THROWS_AS(a.at(first), ls::CheckpointError);
  const ls::Checkpoint back = ls::parse_checkpoint(ls::serialize_checkpoint(a));
  CHECK(back.tensors.empty());
  a.add(first, ls::Tensor::full({2}, 1.0));
  CHECK(a.at(first).numel() == 2);

  // Self-move keeps every tensor and every metadata entry (std::vector's self-move empties).
  self_move(b);
  CHECK(b.tensors.size() == n);
  CHECK(b.metadata.size() == m);
  CHECK(b.at(first).raw_data() == data);
  CHECK(same(b, sample_checkpoint()));

  // Move-assignment onto a live checkpoint replaces its contents.
  a = std::move(b);
  CHECK(a.tensors.size() == n);
  CHECK(a.at(first).raw_data() == data);
  CHECK(b.tensors.empty());
  CHECK(b.metadata.empty());
  CHECK(same(a, sample_checkpoint()));
}

TEST_CASE("zero-element tensors round trip whatever their other extents", "[checkpoint][bounds]") {
  // numel_of gives 0 for a zero extent anywhere; the reader agrees, so what is written reads back.
  constexpr std::int64_t big = std::int64_t{1} << 62;
  ls::Checkpoint ck;
  ck.add("zero_last", ls::Tensor::zeros({big, 4, 0}));
  ck.add("zero_first", ls::Tensor::zeros({0, big, 4}));
  ck.add("w", ls::Tensor::full({2}, 3.0));
  const ls::Checkpoint back = ls::parse_checkpoint(ls::serialize_checkpoint(ck));
  REQUIRE(back.tensors.size() == 3);
  CHECK(back.at("zero_last").shape() == ls::Shape{big, 4, 0});
  CHECK(back.at("zero_first").shape() == ls::Shape{0, big, 4});
  CHECK(back.at("zero_last").numel() == 0);
  CHECK(ls::bitwise_equal(back.at("w"), ck.at("w")));
  // Without a zero, the same extents are too many elements.
  const std::string header = "{\"t\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,0]}}";
  CHECK(parse_error(as_span(make_file(header))).find("too many elements") != std::string::npos);
}

TEST_CASE("add_to_checkpoint shares host tensors without copying and keeps their memory alive",
          "[checkpoint][lifetime]") {
  // More than glibc's largest mmap threshold: freed memory is unmapped, so a dangling read faults.
  constexpr std::int64_t n = std::int64_t{12} << 20;
  ls::Checkpoint ck;
  {
    std::vector<ls::Tensor> model;
    model.push_back(ls::Tensor::full({n}, 1.25));
    ls::add_to_checkpoint(ck, model, "m");
    CHECK(ck.at("m[0]").raw_data() == model[0].raw_data());  // a view, not a copy
  }
  CHECK(ck.at("m[0]").numel() == n);
  CHECK(ck.at("m[0]").data<float>()[n - 1] == 1.25f);  // the model is gone; its memory is not
}

TEST_CASE("a save writes the bytes serialize_checkpoint gives, from many small and a few large tensors",
          "[checkpoint][io]") {
  // Thousands of small tensors (more than one writev takes) and tensors larger than the pieces the
  // writer and the reader checksum at a time, of every element size.
  ScratchDir dir("stream");
  ls::Checkpoint ck;
  std::mt19937_64 rng(99);
  for (int i = 0; i < 3000; ++i) {
    const std::int64_t n = static_cast<std::int64_t>(rng() % 5);
    std::vector<std::int32_t> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = static_cast<std::int32_t>(rng());
    ck.add("small." + std::to_string(i), ls::Tensor::from(v, {n}));
  }
  std::vector<double> big(700'001);
  for (auto& x : big) x = static_cast<double>(rng() % 1000) / 7.0;
  ck.add("big.f64", ls::Tensor::from(big, {static_cast<std::int64_t>(big.size())}));
  std::vector<std::uint8_t> odd(3'000'003);
  for (auto& x : odd) x = static_cast<std::uint8_t>(rng());
  ck.add("odd.u8", ls::Tensor::from(odd, {static_cast<std::int64_t>(odd.size())}));
  std::vector<ls::half> h(400'000);
  for (auto& x : h) x = ls::to_half(static_cast<float>(rng() % 100));
  ck.add("h.f16", ls::Tensor::from(h, {400, 1000}));
  ck.metadata["step"] = "5";

  const fs::path p = dir.path / "ck.safetensors";
  ls::save_checkpoint(p, ck);
  const auto bytes = ls::serialize_checkpoint(ck);
  std::ifstream in(p, std::ios::binary);
  const std::string on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(on_disk.size() == bytes.size());
  CHECK(std::memcmp(on_disk.data(), bytes.data(), bytes.size()) == 0);
  // The checksum was written into place: the file passes it, and its digits are not the zeros
  // the header is first written with.
  CHECK(on_disk.find("crc32c:00000000") == std::string::npos);
  const ls::Checkpoint back = ls::load_checkpoint(p);
  CHECK(same(back, ls::parse_checkpoint(bytes)));
  REQUIRE(back.tensors.size() == ck.tensors.size());
  CHECK(back.at("big.f64").data<double>()[700'000] == big[700'000]);
  CHECK(back.at("odd.u8").data<std::uint8_t>()[3'000'002] == odd[3'000'002]);
  CHECK(back.metadata.at("step") == "5");

  // A flipped bit in the middle of a large tensor, on disk: the load names the checksum and the
  // path, and hands out nothing.
  {
    std::fstream f(p, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(static_cast<std::streamoff>(bytes.size() - 2'000'000));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(bytes.size() - 2'000'000));
    c = static_cast<char>(c ^ 0x20);
    f.write(&c, 1);
  }
  CHECK_THROWS_WITH(ls::load_checkpoint(p), Catch::Contains("checksum mismatch") && Catch::Contains(p.string()));
  // Cut short inside the data: refused before any data is read, naming the shortfall.
  fs::resize_file(p, bytes.size() - 1000);
  CHECK_THROWS_WITH(ls::load_checkpoint(p), Catch::Contains("truncated") && Catch::Contains(p.string()));
}
