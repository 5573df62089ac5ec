// Remote calls: the out-of-line half of the codec (remote/detail/codec.hpp): the tensor table
// of a message being built, and the checked reads of one received.
#include <algorithm>
#include <cstring>

#include "lockstep/remote/detail/codec.hpp"
#include "remote/wire.hpp"

namespace lockstep::detail::remote {

Encoder::Encoder() { bytes_.resize(kHead); }

void Encoder::tensor(const Tensor& t) {
  u32(static_cast<std::uint32_t>(tensors_.size()));
  if (t.device().is_cpu())
    tensors_.push_back(t.slice_view(0, t.shape()));  // shares (and keeps alive) t's memory
  else
    tensors_.push_back(t.to(Device::cpu()));  // device tensors are staged once
}

void Decoder::fail(const std::string& what) const {
  throw DecodeError(concat("expected ", what, " at byte ", pos_, " of ", n_));
}

void Decoder::get(void* out, std::size_t n) {
  if (n > n_ - pos_) fail(concat(n, " more bytes (the message is shorter)"));
  if (n > 0) std::memcpy(out, p_ + pos_, n);
  pos_ += n;
}

void Decoder::expect(std::uint8_t want, const char* what) {
  if (pos_ >= n_) fail(concat(what, " (the message ended)"));
  const auto got = static_cast<std::uint8_t>(p_[pos_]);
  if (got != want) fail(concat(what, " (wire tag 0x", std::hex, int(want), ", found 0x", int(got), std::dec, ")"));
  ++pos_;
}

std::uint64_t Decoder::count(std::size_t min_each) {
  const auto n = u64();
  if (n > (n_ - pos_) / std::max<std::size_t>(min_each, 1)) fail(concat("a count that fits the message (got ", n, ")"));
  return n;
}

Tensor Decoder::tensor() {
  const auto i = u32();
  if (tensors_ == nullptr || i != next_tensor_ || i >= tensors_->size()) fail("the next tensor of the message");
  ++next_tensor_;
  return std::move((*tensors_)[i]);
}

void Decoder::finish() {
  if (pos_ != n_) fail(concat("the end of the message (", n_ - pos_, " bytes left over)"));
  if (tensors_ != nullptr && next_tensor_ != tensors_->size()) fail("no more tensors");
}

}  // namespace lockstep::detail::remote
