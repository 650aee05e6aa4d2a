// The content-adaptive patterns as values (TopK, BlockTopK, ReLUAttention, MixedAttention): their nodes, checked
// constructors and repr. Running them is src/sparse/adaptive.cpp's part.
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "sattn/error.hpp"
#include "sparse/adaptive.hpp"

namespace sattn::sparse {

std::string AdaptiveNode::repr() const {
  switch (kind) {
    case kTopK: return sattn::message::concat("TopK(", k, ")");
    case kBlockTopK: {
      std::string s = sattn::message::concat("BlockTopK(", block, ", ", k_blocks);
      if (!local) s += ", local=False";
      if (causal) s += ", causal=True";
      return s + ")";
    }
    case kReLU: {
      std::string s = "ReLUAttention(";
      bool any = false;
      if (power != 2.0) {
        s += sattn::message::concat("power=", format_double(power));
        any = true;
      }
      if (normalize != 0) s += std::string(any ? ", " : "") + "normalize='" + (normalize == 1 ? "sum" : "length") + "'";
      return s + ")";
    }
    case kMixed:
      if (logit_softmax == 0.0 && logit_relu == 0.0) return "MixedAttention()";
      return "MixedAttention(logits=(" + format_double(logit_softmax) + ", " + format_double(logit_relu) + "))";
  }
  return "?";
}

bool AdaptiveNode::allowed(int64_t, int64_t, int64_t, int64_t, int64_t) const {
  fail(ErrorKind::kInvalidArgument, "pattern ", repr(), ": a content-adaptive pattern has no fixed element predicate");
}

std::string format_double(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  std::string s = buf;
  // Shortest representation that reads back exactly.
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) {
      s = buf;
      break;
    }
  }
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

namespace {
std::shared_ptr<AdaptiveNode> make_node(AdaptiveNode::Kind kind) {
  auto n = std::make_shared<AdaptiveNode>();
  n->kind = kind;
  return n;
}
std::shared_ptr<AdaptiveNode> topk_node(int64_t k) {
  detail::check_param("TopK", "k", k, 1);
  auto n = make_node(AdaptiveNode::kTopK);
  n->k = k;
  return n;
}
std::shared_ptr<AdaptiveNode> blocktopk_node(int64_t block, int64_t k_blocks, bool local, bool causal) {
  detail::check_param("BlockTopK", "block", block, 1);
  detail::check_param("BlockTopK", "k_blocks", k_blocks, 1);
  auto n = make_node(AdaptiveNode::kBlockTopK);
  n->block = block;
  n->k_blocks = k_blocks;
  n->local = local;
  n->causal = causal;
  return n;
}
std::shared_ptr<AdaptiveNode> relu_node(double power, const std::string& normalize) {
  check(std::isfinite(power) && power >= 1.0, ErrorKind::kInvalidArgument, "ReLUAttention: expected power >= 1, got ",
        power);
  check(normalize == "none" || normalize == "sum" || normalize == "length", ErrorKind::kInvalidArgument,
        "ReLUAttention: expected normalize 'none', 'sum' or 'length', got '", normalize, "'");
  auto n = make_node(AdaptiveNode::kReLU);
  n->power = power;
  n->normalize = normalize == "none" ? 0 : normalize == "sum" ? 1 : 2;
  return n;
}
std::shared_ptr<AdaptiveNode> mixed_node(double a1, double a2) {
  check(std::isfinite(a1) && std::isfinite(a2), ErrorKind::kInvalidArgument,
        "MixedAttention: expected finite logits, got (", a1, ", ", a2, ")");
  auto n = make_node(AdaptiveNode::kMixed);
  n->logit_softmax = a1;
  n->logit_relu = a2;
  return n;
}
}  // namespace

TopK::TopK(int64_t k) : Pattern(topk_node(k)) {}
BlockTopK::BlockTopK(int64_t block, int64_t k_blocks, bool local, bool causal)
    : Pattern(blocktopk_node(block, k_blocks, local, causal)) {}
ReLUAttention::ReLUAttention(double power, const std::string& normalize) : Pattern(relu_node(power, normalize)) {}
MixedAttention::MixedAttention(double a1, double a2) : Pattern(mixed_node(a1, a2)) {}

}  // namespace sattn::sparse
