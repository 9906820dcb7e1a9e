// The activation vocabulary: GLU layouts and their row permutations, spec descriptions and checks.
#include "moe_engine/glu_spec.hpp"

#include <charconv>
#include <cmath>
#include <sstream>

namespace moe {

GluLayout GluLayout::blocks(int64_t s) {
  MOE_CHECK(s >= 1, ErrorCode::kInvalidArgument, "GLU layout blocks:", s,
            ": the block size must be >= 1");
  return GluLayout(Kind::kBlocks, s);
}

GluLayout GluLayout::parse(std::string_view text) {
  if (text == "halves") return halves();
  if (text == "pairs") return pairs();
  if (text.rfind("blocks:", 0) == 0) {
    const std::string_view digits = text.substr(7);
    int64_t s = 0;
    auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), s);
    if (ec == std::errc() && ptr == digits.data() + digits.size() && !digits.empty() && s >= 1)
      return blocks(s);
  }
  throw_error(ErrorCode::kInvalidArgument, "unknown GLU layout '", text,
              "'; expected halves, pairs or blocks:S with S >= 1 (e.g. blocks:32)");
}

std::vector<int64_t> glu_row_permutation(const GluLayout& from, const GluLayout& to, int64_t ffn) {
  for (const GluLayout* l : {&from, &to})
    MOE_CHECK(ffn >= 1 && ffn % l->block_size(ffn) == 0, ErrorCode::kShape, "GLU layout ", l->name(),
              " needs F divisible by ", l->block_size(ffn), ", got F = ", ffn);
  std::vector<int64_t> perm(size_t(2 * ffn));
  for (int64_t j = 0; j < ffn; ++j) {
    perm[size_t(to.gate_column(j, ffn))] = from.gate_column(j, ffn);
    perm[size_t(to.linear_column(j, ffn))] = from.linear_column(j, ffn);
  }
  return perm;
}

int64_t GluLayout::block_size(int64_t ffn) const {
  switch (kind_) {
    case Kind::kHalves:
      return ffn;
    case Kind::kPairs:
      return 1;
    case Kind::kBlocks:
      return block_;
  }
  return 0;
}

int64_t GluLayout::gate_column(int64_t j, int64_t ffn) const {
  const int64_t s = block_size(ffn);
  return (j / s) * 2 * s + j % s;
}

int64_t GluLayout::linear_column(int64_t j, int64_t ffn) const {
  return gate_column(j, ffn) + block_size(ffn);
}

std::string GluLayout::name() const {
  switch (kind_) {
    case Kind::kHalves:
      return "halves";
    case Kind::kPairs:
      return "pairs";
    case Kind::kBlocks:
      return "blocks:" + std::to_string(block_);
  }
  return "unknown";
}

std::string describe(const GluSpec& spec) {
  std::ostringstream os;
  os << activation_name(spec.activation);
  if (spec.activation == Activation::kClampedQGeGLU)
    os << "(limit=" << spec.limit << ", alpha=" << spec.alpha << ", offset=" << spec.offset << ")";
  if (spec.gated()) os << ", " << spec.layout.name();
  return os.str();
}

void check_glu_spec(const GluSpec& spec, int64_t ffn, std::string_view who) {
  if (!spec.gated()) {
    MOE_CHECK(spec.layout == GluLayout::halves(), ErrorCode::kInvalidArgument, who, ": GLU layout ",
              spec.layout.name(), " given for ", activation_name(spec.activation),
              ", which is not gated (FC1 has F columns, no gate/linear pairs); expected the default layout halves");
    return;
  }
  const int64_t s = spec.layout.block_size(ffn);
  MOE_CHECK(ffn <= 0 || ffn % s == 0, ErrorCode::kShape, who, ": GLU layout ", spec.layout.name(),
            " needs F divisible by ", s, ", got F = ", ffn);
  if (spec.activation == Activation::kClampedQGeGLU) {
    MOE_CHECK(spec.limit > 0 && !std::isnan(spec.limit), ErrorCode::kInvalidArgument, who,
              ": clamped_qgeglu limit must be > 0, got ", spec.limit);
    MOE_CHECK(std::isfinite(spec.alpha) && std::isfinite(spec.offset), ErrorCode::kInvalidArgument, who,
              ": clamped_qgeglu alpha and offset must be finite, got alpha = ", spec.alpha, ", offset = ",
              spec.offset);
  }
}

}  // namespace moe
