// The FP8 module suites' common parts (CPU backend): batches, recipes naming GEMMs, main_grad
// buffers, the byte comparisons of FP8 copies (only the bytes a quantizer writes), and the
// GroupedMLP reference of a recipe leaving some GEMM unquantized.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "fp8_support.hpp"
#include "moe_engine/glu.hpp"
#include "moe_engine/modules.hpp"

namespace moe::test {

inline Tensor packed_of(const GroupedParam& p) {  // a packed CPU copy of any grouped parameter
  Shape s{p.num_groups()};
  for (int64_t d : p.expert_shape()) s.push_back(d);
  Tensor out = Tensor::zeros(s, p.dtype());
  for (int64_t g = 0; g < p.num_groups(); ++g) copy_tensor(out.view().select(g), p.expert(g));
  return out;
}

// The bytes a quantizer writes of FP8 columns: the offsets, and the columns of the experts'
// segments (the rest of the buffer is whatever the allocation held).
inline bool same_columns(const Fp8Columns& a, const Fp8Columns& b) {
  if (!a.data.defined() || !b.data.defined() || !bitwise_equal(a.offsets, b.offsets)) return false;
  const int64_t G = a.offsets.numel() - 1, used = a.offsets.data_as<int64_t>()[G];
  const int64_t K = a.data.size(0), C = a.data.size(1);
  if (b.data.size(0) != K || b.data.size(1) != C) return false;
  for (int64_t k = 0; k < K; ++k)
    if (std::memcmp(a.data.data_as<uint8_t>() + k * C, b.data.data_as<uint8_t>() + k * C, size_t(used)) != 0)
      return false;
  return std::memcmp(a.scales.data(), b.scales.data(), size_t(used / kFp8Block * K) * sizeof(float)) == 0;
}

// The bytes a quantizer writes of FP8 rows: the first `rows` rows and their scales.
inline bool same_rows(const Fp8Rows& a, const Fp8Rows& b, int64_t rows) {
  if (!a.data.defined() || !b.data.defined() || a.data.shape() != b.data.shape()) return false;
  const int64_t K = a.data.size(1), blocks = a.scales.size(0);
  if (std::memcmp(a.data.data(), b.data.data(), size_t(rows * K)) != 0) return false;
  for (int64_t kb = 0; kb < blocks; ++kb)
    if (std::memcmp(a.scales.data_as<float>() + kb * a.scales.size(1),
                    b.scales.data_as<float>() + kb * b.scales.size(1), size_t(rows) * sizeof(float)) != 0)
      return false;
  return true;
}

inline int64_t columns_bytes(int64_t T, int64_t G, int64_t K) {
  const int64_t C = fp8_columns_capacity(T, G);
  return K * C + 4 * (C / kFp8Block) * K + 8 * (G + 1);
}
inline int64_t rows_bytes(int64_t T, int64_t K) { return T * K + 4 * blocks_of(K) * fp8_scales_pitch(T); }

// A float32 main_grad for `p`, packed, zero.
inline Tensor main_grad_for(Parameter& p) {
  Shape s{p.num_groups()};
  for (int64_t d : p.expert_shape()) s.push_back(d);
  Tensor t = Tensor::zeros(s, DType::kFloat32);
  p.set_main_grad(GroupedParam::packed(t));
  return t;
}

inline Tensor doubled(const Tensor& t) {  // 2 * t, exactly (float32)
  Tensor out = Tensor::zeros(t.shape(), DType::kFloat32);
  for (int64_t i = 0; i < t.numel(); ++i) out.data_as<float>()[i] = 2 * t.data_as<float>()[i];
  return out;
}

// One batch: x [T, in], dy [T, out] in the module's dtype, row scales / probs [T] float32.
struct Batch {
  Routing routing;
  Tensor x, dy, scales;
  Batch(Rng& rng, std::vector<int64_t> splits, int64_t capacity, int64_t in, int64_t out, DType dt)
      : routing(std::move(splits), capacity),
        x(random_tensor({capacity, in}, dt, rng)),
        dy(random_tensor({capacity, out}, dt, rng)),
        scales(uniform_tensor({capacity}, DType::kFloat32, rng, 0.05, 1.0)) {}
  const GroupLayout& groups() const { return routing.layout; }
  int64_t T() const { return routing.capacity; }
};

inline Fp8ModuleRecipe gemms(bool forward, bool dgrad, bool wgrad) {
  Fp8ModuleRecipe r;
  r.forward = forward;
  r.dgrad = dgrad;
  r.wgrad = wgrad;
  return r;
}

inline const char* layout_name(ExpertLayout l) { return l == ExpertLayout::kPacked ? "packed" : "per_expert"; }


// FP8 copies made by the quantizers, for the references.
inline OwnedWeight quantized_weight(const GroupedParam& w, const Fp8Recipe& recipe) {
  OwnedWeight q(w.num_groups(), w.expert_shape()[0], w.expert_shape()[1]);
  quantize_fp8_weight(w, q.view(), recipe);
  return q;
}
inline OwnedRows quantized_rows(const Tensor& x, const GroupLayout& groups, const Fp8Recipe& recipe) {
  OwnedRows q(x.size(0), x.size(1));
  quantize_fp8(x, groups, q.view(), {}, recipe);
  return q;
}
inline OwnedColumns quantized_columns(const Tensor& x, const GroupLayout& groups, const Fp8Recipe& recipe) {
  OwnedColumns q(x.size(0), groups.num_groups(), x.size(1));
  quantize_fp8(x, groups, {}, q.view(), recipe);
  return q;
}

// One layer's GEMMs from the ops, in FP8 where `r` names them (the weight quantized here).
inline Tensor layer_forward(const GroupedParam& w, const BiasEpilogue& bias, const Tensor& x,
                            const GroupLayout& groups, const Fp8ModuleRecipe& r, DType dt) {
  Tensor y = Tensor::zeros({x.size(0), w.expert_shape()[0]}, dt);
  if (r.forward)
    grouped_linear_forward(quantized_rows(x, groups, r.quantizer).view(), quantized_weight(w, r.quantizer).view(),
                           groups, y, bias);
  else
    grouped_linear_forward(x, w, groups, y, bias);
  return y;
}

inline Tensor layer_dgrad(const GroupedParam& w, const Tensor& dy, const GroupLayout& groups,
                          const Fp8ModuleRecipe& r, DType dt) {
  Tensor dx = Tensor::zeros({dy.size(0), w.expert_shape()[1]}, dt);
  if (r.dgrad)
    grouped_linear_dgrad(quantized_rows(dy, groups, r.quantizer).view(), quantized_weight(w, r.quantizer).view(),
                         groups, dx);
  else
    grouped_linear_dgrad(dy, w, groups, dx);
  return dx;
}

// dW = dy^T x into `dw` per `mode`.
inline void layer_wgrad(const Tensor& dy, const Tensor& x, const GroupLayout& groups, const Fp8ModuleRecipe& r,
                        const GroupedParam& dw, GradMode mode) {
  if (r.wgrad)
    grouped_linear_wgrad(quantized_columns(dy, groups, r.quantizer).view(),
                         quantized_columns(x, groups, r.quantizer).view(), groups, dw, mode);
  else
    grouped_linear_wgrad(dy, x, groups, dw, mode);
}

// A GroupedMLP's results computed from the ops on its parameters (weights quantized here), every
// gradient written, the weight gradients as `wdtype`; the FP8 copies kept, where the FP8 MLP op made
// them.
struct MlpReference {
  Tensor y, dx, dprobs, dw1, dw2, db1, db2;
  OwnedColumns x_columns;  // x's columns, or (x kept as rows) undefined
  OwnedRows x_rows;        // x's rows, or undefined
  OwnedRows h_rows;
};

// A recipe leaving some GEMM unquantized: FC1, the activation (x probs), FC2 with p * b2; backward
// FC2's dgrad / db2, the activation's backward (dprobs, then <dy, b2> added), FC1's dgrad / db1,
// the two wgrads; each GEMM in FP8 where the recipe names it.
inline MlpReference mlp_layers_reference(GroupedMLP& m, const Batch& b, DType wdtype) {
  const Fp8ModuleRecipe& r = *m.options().fp8;
  const GluSpec& glu = m.options().glu;
  const DType dt = m.options().dtype;
  const GroupLayout& groups = b.groups();
  const int64_t T = b.T(), G = m.num_groups(), H = m.hidden(), F = m.ffn(), W = fc1_width(glu, F);
  const GroupedParam w1 = m.fc1_weight().value(), w2 = m.fc2_weight().value();
  const GroupedParam b1 = m.fc1_bias().value(), b2 = m.fc2_bias().value();
  MlpReference out;
  const Tensor h = layer_forward(w1, {b1, {}}, b.x, groups, r, dt);
  const Tensor act = Tensor::zeros({T, F}, dt);
  glu_forward(h, b.scales, groups, act, glu);
  out.y = layer_forward(w2, {b2, b.scales}, act, groups, r, dt);
  const Tensor d_act = layer_dgrad(w2, b.dy, groups, r, dt);
  out.db2 = Tensor::zeros({G, H}, dt);
  grouped_linear_dbias(b.dy, groups, GroupedParam::packed(out.db2), GradMode::kWrite, b.scales);
  const Tensor dh = Tensor::zeros({T, W}, dt);
  out.dprobs = Tensor::zeros({T}, DType::kFloat32);
  glu_backward(h, b.scales, d_act, groups, {dh, out.dprobs, {}}, glu);
  grouped_linear_dscales(b.dy, b2, groups, out.dprobs, /*accumulate=*/true);
  out.db1 = Tensor::zeros({G, W}, dt);
  grouped_linear_dbias(dh, groups, GroupedParam::packed(out.db1), GradMode::kWrite);
  out.dx = layer_dgrad(w1, dh, groups, r, dt);
  out.dw1 = Tensor::zeros({G, W, H}, wdtype);
  out.dw2 = Tensor::zeros({G, H, F}, wdtype);
  layer_wgrad(dh, b.x, groups, r, GroupedParam::packed(out.dw1), GradMode::kWrite);
  layer_wgrad(b.dy, act, groups, r, GroupedParam::packed(out.dw2), GradMode::kWrite);
  return out;
}

// A GroupedMLP backward that computed every gradient: dx, dprobs and the four gradients equal the
// reference's, bit for bit.
inline void expect_backward_equals(const MlpBackwardResult& r, const MlpReference& ref) {
  EXPECT_TRUE(bitwise_equal(r.dx, ref.dx));
  EXPECT_TRUE(bitwise_equal(r.dprobs, ref.dprobs));
  for (auto [got, want, name] : {std::tuple{&r.fc1_weight, &ref.dw1, "dw1"},
                                 {&r.fc2_weight, &ref.dw2, "dw2"},
                                 {&r.fc1_bias, &ref.db1, "db1"},
                                 {&r.fc2_bias, &ref.db2, "db2"}}) {
    EXPECT_EQ(got->kind, GradKind::kGrad) << name;
    EXPECT_TRUE(bitwise_equal(packed_of(got->grad.view()), *want)) << name;
  }
}

}  // namespace moe::test
