// The GLU vocabulary shared by every layer that handles a GLU: the activation, the column layout
// of the gate and linear halves, and the spec that carries both (docs/design.md, "GLU").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moe_engine/enum_names.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/tensor.hpp"

namespace moe {

enum class GluActivation {
  kSwiGLU,         // silu(gate) * linear
  kClampedQGeGLU,  // GPT-OSS: g = min(gate, limit), l = clamp(linear, -limit, limit) + offset,
                   //          g * sigmoid(alpha g) * l
};
template <>
struct EnumNames<GluActivation> {
  static constexpr std::string_view kWhat = "activation";
  static constexpr EnumName<GluActivation> kNames[] = {
      {GluActivation::kSwiGLU, "swiglu"},
      {GluActivation::kClampedQGeGLU, "clamped_qgeglu"},
  };
};
inline const char* activation_name(GluActivation activation) { return enum_name(activation); }
inline GluActivation parse_activation(std::string_view name) { return parse_enum<GluActivation>(name); }

// Where gate column j and linear column j (0 <= j < F) sit among the 2F columns.
// Every layout is "alternating blocks of s gate and s linear columns" for some s:
// halves is s = F, pairs is s = 1, blocks:s is s.
class MOE_API GluLayout {
 public:
  enum class Kind { kHalves, kBlocks, kPairs };

  static GluLayout halves() { return GluLayout(Kind::kHalves, 0); }  // Megatron / TE default
  static GluLayout blocks(int64_t s);                                // moe_mlp_glu_interleave_size
  static GluLayout pairs() { return GluLayout(Kind::kPairs, 0); }    // HF GPT-OSS
  static GluLayout parse(std::string_view text);  // "halves", "pairs", "blocks:32"

  Kind kind() const { return kind_; }
  int64_t block() const { return block_; }  // s of blocks:s (0 for the others)
  int64_t block_size(int64_t ffn) const;    // s for this F (F for halves, 1 for pairs)
  int64_t gate_column(int64_t j, int64_t ffn) const;
  int64_t linear_column(int64_t j, int64_t ffn) const;
  std::string name() const;  // parse(name()) == *this
  friend bool operator==(const GluLayout& a, const GluLayout& b) {
    return a.kind_ == b.kind_ && a.block_ == b.block_;
  }

 private:
  GluLayout(Kind kind, int64_t block) : kind_(kind), block_(block) {}
  Kind kind_;
  int64_t block_;
};

// The FC1 row order between GLU layouts for F gate/linear pairs: row i in `to` is row perm[i] in
// `from` (weights [2F, H] and biases [2F] are permuted this way). kShape if F does not fit either.
MOE_API std::vector<int64_t> glu_row_permutation(const GluLayout& from, const GluLayout& to, int64_t ffn);

struct GluSpec {
  GluActivation activation = GluActivation::kSwiGLU;
  float limit = 7.0f;    // clamped_qgeglu only
  float alpha = 1.702f;  // clamped_qgeglu only
  float offset = 1.0f;   // clamped_qgeglu only
  GluLayout layout = GluLayout::halves();
};
MOE_API std::string describe(
    const GluSpec& spec);  // "clamped_qgeglu(limit=7, alpha=1.702, offset=1), blocks:32"

// What glu_backward writes.
struct GluBackwardOutputs {
  TensorView dh;      // [T, 2F], required: dL/dh
  TensorView dprobs;  // [T] float32, optional (needs probs): <act[r], d_out[r]>
  TensorView out;     // [T, F], optional: the forward output act * p, recomputed
};

}  // namespace moe
