// GLU activations: layouts, names, validation, dispatch.
#include "moe_engine/glu.hpp"

#include <charconv>
#include <sstream>

#include "cpu/backend.hpp"
#include "moe_engine/config.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif
#include "ops/validate.hpp"

namespace moe {

const char* activation_name(GluActivation activation) {
  switch (activation) {
    case GluActivation::kSwiGLU:
      return "swiglu";
    case GluActivation::kClampedQGeGLU:
      return "clamped_qgeglu";
  }
  return "unknown";
}

GluActivation parse_activation(std::string_view name) {
  if (name == "swiglu") return GluActivation::kSwiGLU;
  if (name == "clamped_qgeglu") return GluActivation::kClampedQGeGLU;
  throw_error(ErrorCode::kInvalidArgument, "unknown activation '", name,
              "'; expected swiglu or clamped_qgeglu");
}

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
  if (spec.activation == GluActivation::kClampedQGeGLU)
    os << "(limit=" << spec.limit << ", alpha=" << spec.alpha << ", offset=" << spec.offset << ")";
  os << ", " << spec.layout.name();
  return os.str();
}

void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("glu_forward", groups);
  v.matrix("out", out, v.capacity(), -1, "[T, F]");
  const int64_t F = out.size(1);
  v.matrix("h", h, v.capacity(), 2 * F, "[T, 2F]");
  if (probs.defined()) v.row_scale("probs", probs);
  v.glu_spec(spec, F);
  v.no_overlap("out", out, "h", h);
  ops::dispatch(
      v, [&] { cpu::glu_forward(h, probs, groups, out, spec); },
      [&] { MOE_CUDA_ONLY(cuda::glu_forward(h, probs, groups, out, spec, ctx.stream)); });
}

void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& outputs, const GluSpec& spec,
                  [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("glu_backward", groups);
  v.matrix("d_out", d_out, v.capacity(), -1, "[T, F]");
  const int64_t F = d_out.size(1);
  v.matrix("h", h, v.capacity(), 2 * F, "[T, 2F]");
  v.matrix("dh", outputs.dh, v.capacity(), 2 * F, "[T, 2F]");
  if (probs.defined()) v.row_scale("probs", probs);
  if (outputs.dprobs.defined()) {
    if (!probs.defined())
      v.fail(ErrorCode::kInvalidArgument, "dprobs is requested but no probs were given");
    v.row_scale("dprobs", outputs.dprobs);
  }
  if (outputs.out.defined()) v.matrix("out", outputs.out, v.capacity(), F, "[T, F]");
  v.glu_spec(spec, F);
  v.in_place_or_separate("dh", outputs.dh, "h", h);
  v.no_overlap("dh", outputs.dh, "d_out", d_out);
  if (outputs.out.defined()) {
    v.in_place_or_separate("out", outputs.out, "d_out", d_out);
    v.no_overlap("out", outputs.out, "h", h);
    v.no_overlap("out", outputs.out, "dh", outputs.dh);
  }
  ops::dispatch(
      v, [&] { cpu::glu_backward(h, probs, d_out, groups, outputs, spec); },
      [&] { MOE_CUDA_ONLY(cuda::glu_backward(h, probs, d_out, groups, outputs, spec, ctx.stream)); });
}

}  // namespace moe
