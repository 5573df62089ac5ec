// The scikit-learn digits for the LibTorch examples (torch_digits, torch_digits_bn): the gzipped
// CSV that Debian's python3-sklearn ships (64 pixel values 0-16, then the label, per row), read
// with zlib, and the fixed train/test split's permutation.
#pragma once

#include <torch/torch.h>
#include <zlib.h>

#include <charconv>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace digits {

inline constexpr const char* kDefaultData = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz";
inline constexpr std::int64_t kPixels = 64;
inline constexpr std::int64_t kClasses = 10;
inline constexpr std::int64_t kTestRows = 297;
inline constexpr std::uint64_t kSplitSeed = 20240601;  // the train/test split does not depend on --seed

/// The digits: images as float rows of 64 values scaled to [0, 1], labels as int64.
struct Digits {
  torch::Tensor x, y;
};

/// Reads sklearn's digits.csv.gz (no header; 64 pixel values then the label per line). Returns
/// an error message instead of throwing, so that the ranks can agree on failure before any
/// collective (a file missing on one node only would otherwise leave the others waiting).
inline std::string read_digits(const std::string& path, Digits& out) {
  if (!std::filesystem::exists(path)) {
    std::string msg = "the digits data set " + path + " does not exist";
    if (path == kDefaultData) msg += " (Debian/Ubuntu: apt-get install python3-sklearn, or pass --data PATH)";
    return msg;
  }
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return "cannot open " + path;
  std::vector<float> pixels;
  std::vector<std::int64_t> labels;
  std::string error;
  char line[4096];
  std::int64_t lineno = 0;
  while (error.empty() && gzgets(f, line, sizeof line) != nullptr) {
    ++lineno;
    std::string_view s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.remove_suffix(1);
    if (s.empty()) continue;
    std::vector<double> fields;
    while (true) {
      const auto comma = s.find(',');
      const std::string_view field = s.substr(0, comma);
      double v = 0;
      auto [p, ec] = std::from_chars(field.data(), field.data() + field.size(), v);
      if (ec != std::errc{} || p != field.data() + field.size() || field.empty()) {
        error = path + ":" + std::to_string(lineno) + ": \"" + std::string(field) + "\" is not a number";
        break;
      }
      fields.push_back(v);
      if (comma == std::string_view::npos) break;
      s.remove_prefix(comma + 1);
    }
    if (!error.empty()) break;
    if (static_cast<std::int64_t>(fields.size()) != kPixels + 1) {
      error = path + ":" + std::to_string(lineno) + ": " + std::to_string(fields.size()) + " values, expected " +
              std::to_string(kPixels + 1) + " (64 pixels and the label)";
      break;
    }
    const double label = fields.back();
    if (label < 0 || label >= kClasses || label != static_cast<double>(static_cast<std::int64_t>(label))) {
      error = path + ":" + std::to_string(lineno) + ": label " + std::to_string(label) + " is not 0-9";
      break;
    }
    for (std::int64_t i = 0; i < kPixels; ++i) pixels.push_back(static_cast<float>(fields[i] / 16.0));
    labels.push_back(static_cast<std::int64_t>(label));
  }
  int zerr = Z_OK;
  const char* zmsg = gzerror(f, &zerr);
  if (error.empty() && zerr != Z_OK && zerr != Z_STREAM_END) error = path + ": " + zmsg;
  gzclose(f);
  if (!error.empty()) return error;
  const auto rows = static_cast<std::int64_t>(labels.size());
  if (rows <= kTestRows) return path + ": " + std::to_string(rows) + " rows, too few for a " + std::to_string(kTestRows) + "-row test set";
  out.x = torch::from_blob(pixels.data(), {rows, kPixels}, torch::kFloat).clone();
  out.y = torch::from_blob(labels.data(), {rows}, torch::kLong).clone();
  return "";
}

/// A permutation of 0..n-1 from a seed, the same on every platform (std::shuffle's is not).
inline std::vector<std::int64_t> permutation(std::int64_t n, std::uint64_t seed) {
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = i;
  std::mt19937_64 rng(seed);
  for (std::int64_t i = n - 1; i > 0; --i)
    std::swap(p[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(rng() % static_cast<std::uint64_t>(i + 1))]);
  return p;
}

inline torch::Tensor index_tensor(const std::int64_t* first, std::int64_t n) {
  return torch::from_blob(const_cast<std::int64_t*>(first), {n}, torch::kLong).clone();
}

}  // namespace digits
