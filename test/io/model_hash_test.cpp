// model_hash (io/model_hash.hpp): the format "crc32c:" + 8 lowercase hex digits; the CRC-32C of
// the tensors' bytes in path order (checked against crc32c over the same bytes by hand), hence
// independent of the fields' declaration order; one flipped bit changes it; scalars are not
// hashed; device tensors without a DeviceRuntime are refused with NotCompiled.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace {

struct Net {
  ls::Tensor w1, b1;
  std::map<std::string, ls::Tensor> heads;
  double temperature = 0.5;
};
LOCKSTEP_FIELDS(Net, w1, b1, heads, temperature)

// The same tensors declared in another order.
struct NetReordered {
  ls::Tensor b1;
  std::map<std::string, ls::Tensor> heads;
  ls::Tensor w1;
};
LOCKSTEP_FIELDS(NetReordered, b1, heads, w1)

ls::Tensor ramp(std::vector<std::int64_t> shape, float start) {
  ls::Tensor t = ls::Tensor::zeros(shape);
  float v = start;
  for (float& x : t.span<float>()) x = (v += 0.25f);
  return t;
}

Net make_net() {
  Net n{ramp({3, 2}, 1), ramp({3}, 10), {}, 0.5};
  n.heads["cls"] = ramp({2}, 20);
  n.heads["box"] = ramp({4}, 30);
  return n;
}

std::string by_hand(const std::vector<const ls::Tensor*>& in_path_order) {
  std::uint32_t crc = 0;
  for (const auto* t : in_path_order)
    crc = ls::crc32c({static_cast<const std::byte*>(t->raw_data()), t->nbytes()}, crc);
  char text[24];
  std::snprintf(text, sizeof text, "crc32c:%08x", static_cast<unsigned>(crc));
  return text;
}

}  // namespace

TEST_CASE("model_hash is the CRC-32C of the tensor bytes in path order", "[model_hash]") {
  Net n = make_net();
  const std::string h = ls::model_hash(n);
  REQUIRE(h.size() == 15);
  CHECK(h.rfind("crc32c:", 0) == 0);
  CHECK(h.find_first_not_of("0123456789abcdef", 7) == std::string::npos);
  // Paths: b1, heads.box, heads.cls, w1 (bytewise order).
  CHECK(h == by_hand({&n.b1, &n.heads.at("box"), &n.heads.at("cls"), &n.w1}));
  CHECK(h != by_hand({&n.w1, &n.b1, &n.heads.at("box"), &n.heads.at("cls")}));  // traversal order

  NetReordered r{n.b1.clone(), {}, n.w1.clone()};
  r.heads["cls"] = n.heads.at("cls").clone();
  r.heads["box"] = n.heads.at("box").clone();
  CHECK(ls::model_hash(r) == h);  // scalars (temperature) are not hashed; field order does not count
  n.temperature = 7;
  CHECK(ls::model_hash(n) == h);
}

TEST_CASE("model_hash changes with one bit and works on Flat, empty and mixed dtypes", "[model_hash]") {
  Net n = make_net();
  const std::string h = ls::model_hash(n);
  auto* bytes = static_cast<unsigned char*>(n.heads.at("cls").raw_data());
  bytes[5] ^= 0x10;
  CHECK(ls::model_hash(n) != h);
  bytes[5] ^= 0x10;
  CHECK(ls::model_hash(n) == h);

  auto flat = ls::flat_copy(n);  // one allocation; same paths, same bytes
  CHECK(ls::model_hash(*flat) == h);
  CHECK(ls::model_hash(flat) == h);

  std::vector<ls::Tensor> none;
  CHECK(ls::model_hash(none) == "crc32c:00000000");
  std::vector<ls::Tensor> mixed;
  mixed.push_back(ls::Tensor::zeros({0}));
  mixed.push_back(ls::Tensor::full({3}, 2.0, ls::DType::f64));
  mixed.push_back(ls::Tensor::zeros({2}, ls::DType::i64));
  CHECK(ls::model_hash(mixed) == by_hand({&mixed[1], &mixed[2]}));
}

TEST_CASE("model_hash refuses a device tensor it cannot copy", "[model_hash]") {
  if (ls::find_device_runtime() != nullptr) {
    WARN("a DeviceRuntime is installed: device tensors are copied, nothing to refuse");
    return;
  }
  // A cuda tensor cannot even be made without a runtime, so the refusal comes from there or
  // from the copy: either way NotCompiled, never a silent hash of nothing.
  CHECK_THROWS_AS(([] {
                    std::vector<ls::Tensor> v;
                    v.push_back(ls::Tensor::zeros({4}, ls::DType::f32, ls::Device::cuda(0)));
                    (void)ls::model_hash(v);
                  }()),
                  ls::NotCompiled);
}
