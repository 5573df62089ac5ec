// The byte-level GPT of examples/torch/gpt.cpp, in LibTorch's C++ frontend: token and positional
// embeddings, `layers` pre-LayerNorm blocks of causal self-attention and an MLP, a last LayerNorm
// and an output head tied to the token embedding.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include <cstdint>
#include <string>

namespace gpt {

constexpr std::int64_t kVocab = 256;  // bytes

struct Config {
  std::int64_t layers, heads, width, block;
  double dropout;
};

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc_proj{nullptr};
  torch::nn::Dropout attn_drop{nullptr}, resid_drop{nullptr};
  std::int64_t heads;
  torch::Tensor causal;  // [block, block], true above the diagonal (masked); not a buffer: derived

  explicit BlockImpl(const Config& c) : heads(c.heads) {
    const std::int64_t w = c.width;
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
    qkv = register_module("qkv", torch::nn::Linear(w, 3 * w));
    proj = register_module("proj", torch::nn::Linear(w, w));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
    fc = register_module("fc", torch::nn::Linear(w, 4 * w));
    fc_proj = register_module("fc_proj", torch::nn::Linear(4 * w, w));
    attn_drop = register_module("attn_drop", torch::nn::Dropout(c.dropout));
    resid_drop = register_module("resid_drop", torch::nn::Dropout(c.dropout));
    causal = torch::ones({c.block, c.block}, torch::kBool).triu(1);
  }

  torch::Tensor forward(torch::Tensor x) {
    const std::int64_t B = x.size(0), T = x.size(1), C = x.size(2), D = C / heads;
    // [B, T, 3C] -> three [B, heads, T, D]
    auto parts = qkv->forward(ln1->forward(x)).view({B, T, 3, heads, D}).permute({2, 0, 3, 1, 4});
    auto q = parts[0], k = parts[1], v = parts[2];
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
    att = att.masked_fill(causal.narrow(0, 0, T).narrow(1, 0, T), -std::numeric_limits<float>::infinity());
    att = attn_drop->forward(torch::softmax(att, -1));
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
    x = x + resid_drop->forward(proj->forward(y));
    auto h = fc_proj->forward(torch::gelu(fc->forward(ln2->forward(x))));
    return x + resid_drop->forward(h);
  }
};
TORCH_MODULE(Block);

// The output head: a linear map (no bias) whose weight is registered as the given tensor, so the
// module lists the token embedding's weight a second time, as "head.weight".
struct TiedHeadImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit TiedHeadImpl(const torch::Tensor& shared) { weight = register_parameter("weight", shared); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }
};
TORCH_MODULE(TiedHead);

struct GPTImpl : torch::nn::Module {
  Config cfg;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  TiedHead head{nullptr};
  torch::Tensor step_done;  // optimizer steps taken: saved and loaded with the weights

  explicit GPTImpl(const Config& c) : cfg(c) {
    wte = register_module("wte", torch::nn::Embedding(kVocab, c.width));
    wpe = register_module("wpe", torch::nn::Embedding(c.block, c.width));
    drop = register_module("drop", torch::nn::Dropout(c.dropout));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    head = register_module("head", TiedHead(wte->weight));
    step_done = register_buffer("step_done", torch::zeros({1}, torch::kLong));
    // GPT-2's initialization: N(0, 0.02) for matrices, zero biases; the residual projections
    // scaled down by sqrt(2 * layers).
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      const std::string& n = p.key();
      if (p.value().dim() >= 2) {
        const bool residual = n.ends_with("proj.weight");
        p.value().normal_(0.0, residual ? 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers)) : 0.02);
      } else if (n.ends_with(".bias")) {
        p.value().zero_();
      }
    }
  }

  // idx: [B, T] int64 bytes (T <= block) -> logits [B, T, 256].
  torch::Tensor forward(const torch::Tensor& idx) {
    const std::int64_t T = idx.size(1);
    auto pos = torch::arange(T, torch::kLong);
    auto x = drop->forward(wte->forward(idx) + wpe->forward(pos));
    for (const auto& b : *blocks) x = b->as<Block>()->forward(x);
    return head->forward(ln_f->forward(x));
  }
};
TORCH_MODULE(GPT);

// Parameters counted once each (the tied weight once).
inline std::int64_t count_parameters(const torch::nn::Module& m) {
  std::int64_t n = 0;
  std::vector<const void*> seen;
  for (const auto& p : m.named_parameters()) {
    if (std::find(seen.begin(), seen.end(), p.value().unsafeGetTensorImpl()) != seen.end()) continue;
    seen.push_back(p.value().unsafeGetTensorImpl());
    n += p.value().numel();
  }
  return n;
}

// `bytes` bytes sampled at `temperature` after a newline, from a generator seeded with `seed`;
// bytes that do not print are shown as '?'. Local, in eval mode (no dropout).
inline std::string generate(GPTImpl& net, std::int64_t bytes, double temperature, std::uint64_t seed) {
  torch::NoGradGuard no_grad;
  const bool was_training = net.is_training();
  net.eval();
  auto gen = at::detail::createCPUGenerator(seed);
  std::vector<std::int64_t> ctx{'\n'};
  std::string out;
  for (std::int64_t i = 0; i < bytes; ++i) {
    const std::int64_t from = std::max<std::int64_t>(0, static_cast<std::int64_t>(ctx.size()) - net.cfg.block);
    auto idx = torch::tensor(std::vector<std::int64_t>(ctx.begin() + from, ctx.end()), torch::kLong).unsqueeze(0);
    auto logits = net.forward(idx).select(1, idx.size(1) - 1).squeeze(0) / temperature;
    const auto next = torch::multinomial(torch::softmax(logits, -1), 1, false, gen).item<std::int64_t>();
    ctx.push_back(next);
    const char c = static_cast<char>(next);
    out += (c == '\n' || c == '\t' || (next >= 32 && next < 127)) ? c : '?';
  }
  if (was_training) net.train();
  return out;
}

}  // namespace gpt
