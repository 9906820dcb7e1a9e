// The activation vocabulary shared by every layer that handles the expert MLP's activation: the
// activations (gated GLUs and non-gated elementwise ones), the column layout of a GLU's gate and
// linear halves, and the spec that carries both (docs/design.md section 3).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moe_engine/enum_names.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/tensor.hpp"

namespace moe {

// The expert MLP's activation. Gated activations (GLUs) pair F gate with F linear columns of FC1's
// output, which then has 2F columns in a GluLayout; non-gated ones apply to each of FC1's F
// columns alone (docs/design.md section 3). fc1_width(spec, F) is FC1's output width either way.
enum class Activation {
  kSwiGLU,         // gated: silu(gate) * linear
  kClampedQGeGLU,  // gated, GPT-OSS: g = min(gate, limit), l = clamp(linear, -limit, limit) + offset,
                   //                 g * sigmoid(alpha g) * l
  kSReLU,          // squared ReLU: relu(h)^2 (TransformerEngine's srelu)
  kGeluTanh,       // GELU, tanh approximation: 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3)))
};
using GluActivation = Activation;  // the name before non-gated activations existed
template <>
struct EnumNames<Activation> {
  static constexpr std::string_view kWhat = "activation";
  static constexpr EnumName<Activation> kNames[] = {
      {Activation::kSwiGLU, "swiglu"},
      {Activation::kClampedQGeGLU, "clamped_qgeglu"},
      {Activation::kSReLU, "srelu"},
      {Activation::kGeluTanh, "gelu_tanh"},
  };
};
inline const char* activation_name(Activation activation) { return enum_name(activation); }
inline Activation parse_activation(std::string_view name) { return parse_enum<Activation>(name); }
// True for the GLUs (FC1 has 2F columns: gate and linear), false for the elementwise activations.
constexpr bool is_gated(Activation activation) {
  return activation == Activation::kSwiGLU || activation == Activation::kClampedQGeGLU;
}

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

// The activation of the expert MLP with its parameters and, for a gated one, the column layout of
// FC1's gate and linear halves (a non-gated activation has no pairs: its layout must stay halves,
// the default, and is not part of its description).
struct GluSpec {
  Activation activation = Activation::kSwiGLU;
  float limit = 7.0f;    // clamped_qgeglu only
  float alpha = 1.702f;  // clamped_qgeglu only
  float offset = 1.0f;   // clamped_qgeglu only
  GluLayout layout = GluLayout::halves();

  bool gated() const { return is_gated(activation); }
};
// "clamped_qgeglu(limit=7, alpha=1.702, offset=1), blocks:32"; "srelu".
MOE_API std::string describe(const GluSpec& spec);

// FC1's output width for an MLP of F features: 2F for a gated activation, F otherwise (the rows of
// the FC1 weight and bias, the columns of the pre-activation h and of dL/dh).
inline int64_t fc1_width(const GluSpec& spec, int64_t ffn) { return spec.gated() ? 2 * ffn : ffn; }

// Throws kShape or kInvalidArgument, the message starting with `who`, where `spec` cannot serve an
// MLP of F = ffn features: a layout whose block size does not divide F, a layout other than halves
// for a non-gated activation, clamped_qgeglu parameters out of range.
MOE_API void check_glu_spec(const GluSpec& spec, int64_t ffn, std::string_view who);

// What glu_backward writes.
struct GluBackwardOutputs {
  TensorView dh;      // [T, fc1_width(spec, F)] (2F gated, F not), required: dL/dh
  TensorView dprobs;  // [T] float32, optional (needs probs): <act[r], d_out[r]>
  TensorView out;     // [T, F], optional: the forward output act * p, recomputed
};

}  // namespace moe
