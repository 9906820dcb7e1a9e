// FP8 block scaling on the CPU (moe_engine/fp8.hpp): the quantizers and the rows' dequantizer,
// whose bytes the CUDA kernels reproduce (both use common/fp8_math.hpp), and the three GEMMs in the
// GPU kernel's order of operations: each 128-long block of the contraction summed in float32, times
// the product of its two scales, added into a float32 accumulator.
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "common/fp8_math.hpp"
#include "cpu/backend.hpp"
#include "cpu/epilogue.hpp"
#include "cpu/tiled_gemm.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kBlock = kFp8Block;

int64_t blocks_of(int64_t n) { return (n + kBlock - 1) / kBlock; }

uint8_t* byte_at(const TensorView& t, int64_t row, int64_t col) {
  return reinterpret_cast<uint8_t*>(element_ptr(t, row, col));
}
float& float_at(const TensorView& t, int64_t row, int64_t col) {
  return *reinterpret_cast<float*>(element_ptr(t, row, col));
}

const int64_t* offsets_of(const GroupLayout& groups) { return groups.offsets().data_as<int64_t>(); }

// The first column of each expert in the columnwise layout (fp8.hpp), from the routing's offsets.
std::vector<int64_t> column_offsets(const GroupLayout& groups) {
  const int64_t* off = offsets_of(groups);
  std::vector<int64_t> columns(size_t(groups.num_groups() + 1), 0);
  for (int64_t g = 0; g < groups.num_groups(); ++g)
    columns[size_t(g + 1)] = columns[size_t(g)] + detail::fp8_column_span(off[g + 1] - off[g]);
  return columns;
}

struct ScaleRule {
  bool pow2;
  float epsilon;
  explicit ScaleRule(const Fp8Recipe& r) : pow2(r.pow2_scales), epsilon(r.amax_epsilon) {}
  detail::Fp8TileScale operator()(uint32_t amax_bits) const { return detail::fp8_tile_scale(amax_bits, pow2, epsilon); }
};

// amax bits of v[i * stride], i < n.
uint32_t amax_bits(const float* v, int64_t n, int64_t stride = 1) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, detail::fp8_abs_bits(v[i * stride]));
  return m;
}

// Rows [0, offsets[G]): one scale per row and 128 features.
void quantize_rows(const TensorView& x, const GroupLayout& groups, const Fp8Rows& rows, ScaleRule scale) {
  const int64_t routed = offsets_of(groups)[groups.num_groups()], K = x.size(1);
#pragma omp parallel
  {
    std::vector<float> v(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < routed; ++r) {
      load(element_ptr(x, r, 0), x.dtype(), K, 1, v.data());
      uint8_t* q = byte_at(rows.data, r, 0);
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t n = std::min(kBlock, K - k0);
        const detail::Fp8TileScale s = scale(amax_bits(v.data() + k0, n));
        float_at(rows.scales, k0 / kBlock, r) = s.scale;
        for (int64_t k = k0; k < k0 + n; ++k) q[k] = detail::fp8_quantize(v[size_t(k)], s.multiplier);
      }
    }
  }
}

// Each expert's tokens in blocks of 128 that restart at its first token, stored transposed from
// its column offset on; the columns up to the next multiple of 128 are zeros.
void quantize_columns(const TensorView& x, const GroupLayout& groups, const Fp8Columns& columns,
                      ScaleRule scale) {
  const int64_t* off = offsets_of(groups);
  const std::vector<int64_t> first_column = column_offsets(groups);
  std::memcpy(columns.offsets.data(), first_column.data(), first_column.size() * sizeof(int64_t));
  struct Task {
    int64_t first_row, rows, first_column;
  };
  std::vector<Task> tasks;
  for (int64_t g = 0; g < groups.num_groups(); ++g)
    for (int64_t i = 0; i < off[g + 1] - off[g]; i += kBlock)
      tasks.push_back({off[g] + i, std::min(kBlock, off[g + 1] - off[g] - i), first_column[size_t(g)] + i});
  const int64_t K = x.size(1), num_tasks = int64_t(tasks.size());
#pragma omp parallel
  {
    std::vector<float> panel(static_cast<size_t>(kBlock * K));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tasks; ++t) {
      const Task task = tasks[size_t(t)];
      for (int64_t i = 0; i < task.rows; ++i)
        load(element_ptr(x, task.first_row + i, 0), x.dtype(), K, 1, panel.data() + i * K);
      for (int64_t k = 0; k < K; ++k) {
        const detail::Fp8TileScale s = scale(amax_bits(panel.data() + k, task.rows, K));
        float_at(columns.scales, task.first_column / kBlock, k) = s.scale;
        uint8_t* q = byte_at(columns.data, k, task.first_column);
        for (int64_t i = 0; i < kBlock; ++i)
          q[i] = i < task.rows ? detail::fp8_quantize(panel[size_t(i * K + k)], s.multiplier) : uint8_t(0);
      }
    }
  }
}

// E4M3 byte -> float, all 256 codes.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = detail::e4m3_to_float(uint8_t(c));
    return t;
  }();
  return table;
}

// panel[i * l + k] = t(row0 + i, col0 + k) decoded, i < nrows, k < l.
void decode_rows(const TensorView& t, int64_t row0, int64_t nrows, int64_t col0, int64_t l, float* panel) {
  const std::array<float, 256>& table = e4m3_table();
  for (int64_t i = 0; i < nrows; ++i) {
    const uint8_t* q = byte_at(t, row0 + i, col0);
    for (int64_t k = 0; k < l; ++k) panel[i * l + k] = table[q[k]];
  }
}

// The sum over 128-long blocks b of <a_b, b_b> * scale(b): the FP8 GEMMs' contraction.
template <class BlockScale>
float block_scaled_dot(const float* a, const float* b, int64_t l, BlockScale scale) {
  float acc = 0.f;
  for (int64_t k0 = 0; k0 < l; k0 += kBlock) {
    const float partial = dot(a + k0, b + k0, std::min(kBlock, l - k0));
    acc += partial * scale(k0 / kBlock);
  }
  return acc;
}

}  // namespace

void quantize_fp8(const TensorView& x, const GroupLayout& groups, const Fp8Rows& rows, const Fp8Columns& columns,
                  const Fp8Recipe& recipe) {
  if (rows.data.defined()) quantize_rows(x, groups, rows, ScaleRule(recipe));
  if (columns.data.defined()) quantize_columns(x, groups, columns, ScaleRule(recipe));
}

// Rows [0, offsets[G]): out[r][k] = q[r][k] * scales[k / 128][r], rounded once to float and once
// to out's dtype.
void dequantize_fp8(const Fp8Rows& rows, const GroupLayout& groups, const TensorView& out) {
  const int64_t routed = offsets_of(groups)[groups.num_groups()], K = rows.data.size(1);
  const std::array<float, 256>& table = e4m3_table();
#pragma omp parallel
  {
    std::vector<float> v(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < routed; ++r) {
      const uint8_t* q = byte_at(rows.data, r, 0);
      for (int64_t k = 0; k < K; ++k)
        v[size_t(k)] = detail::fp8_dequantize(table[q[k]], float_at(rows.scales, k / kBlock, r));
      store(v.data(), K, element_ptr(out, r, 0), out.dtype());
    }
  }
}

void quantize_fp8_weight(const GroupedParam& weight, const Fp8Weight& out, const Fp8Recipe& recipe) {
  const ScaleRule scale(recipe);
  const int64_t G = weight.num_groups(), N = weight.expert_shape()[0], K = weight.expert_shape()[1];
  const int64_t row_blocks = blocks_of(N), num_tasks = G * row_blocks;
#pragma omp parallel
  {
    std::vector<float> panel(static_cast<size_t>(kBlock * K));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tasks; ++t) {
      const int64_t g = t / row_blocks, n0 = t % row_blocks * kBlock, rows = std::min(kBlock, N - n0);
      const TensorView w = weight.expert(g);
      for (int64_t i = 0; i < rows; ++i) load(element_ptr(w, n0 + i, 0), w.dtype(), K, 1, panel.data() + i * K);
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t cols = std::min(kBlock, K - k0);
        uint32_t m = 0;
        for (int64_t i = 0; i < rows; ++i) m = std::max(m, amax_bits(panel.data() + i * K + k0, cols));
        const detail::Fp8TileScale s = scale(m);
        if (out.data.defined()) float_at(out.scales.select(g), n0 / kBlock, k0 / kBlock) = s.scale;
        if (out.data_t.defined()) float_at(out.scales_t.select(g), k0 / kBlock, n0 / kBlock) = s.scale;
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t k = k0; k < k0 + cols; ++k) {
            const uint8_t q = detail::fp8_quantize(panel[size_t(i * K + k)], s.multiplier);
            if (out.data.defined()) *byte_at(out.data.select(g), n0 + i, k) = q;
            if (out.data_t.defined()) *byte_at(out.data_t.select(g), k, n0 + i) = q;
          }
      }
    }
  }
}

namespace {

// out[r] = a[r] W_g^T over a packed weight copy [G, N_out, L] with its block scales (+ bias): the
// forward (W), and the dgrad over the transposed copy (W^T), as on the GPU.
void rows_times_weight(const Fp8Rows& a, const TensorView& w, const TensorView& w_scales, const GroupLayout& groups,
                       const TensorView& out, const BiasEpilogue& bias) {
  const int64_t* off = offsets_of(groups);
  const int64_t L = a.data.size(1), N = out.size(1);
  grouped_gemm_tiles<float>(
      groups.num_groups(), [&](int64_t g) { return GemmExtent{off[g + 1] - off[g], N, L}; },
      [&](int64_t g, int64_t i0, int64_t ni, float* p) { decode_rows(a.data, off[g] + i0, ni, 0, L, p); },
      [&](int64_t g, int64_t j0, int64_t nj, float* p) { decode_rows(w.select(g), j0, nj, 0, L, p); },
      [&](int64_t g, int64_t i, int64_t j, const float* x, const float* y, int64_t l) {
        const TensorView scales_g = w_scales.select(g);
        return block_scaled_dot(x, y, l, [&](int64_t kb) {
          return float_at(a.scales, kb, off[g] + i) * float_at(scales_g, j / kBlock, kb);
        });
      },
      [&](int64_t g, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const float* c) {
        emit_forward_tile(out, bias, g, off[g] + i0, ni, j0, nj, c);
      });
}

}  // namespace

void grouped_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const GroupLayout& groups,
                            const TensorView& y, const BiasEpilogue& bias) {
  rows_times_weight(x, weight.data, weight.scales, groups, y, bias);
}

void grouped_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const GroupLayout& groups,
                          const TensorView& dx) {
  rows_times_weight(dy, weight.data_t, weight.scales_t, groups, dx, {});
}

void grouped_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode) {
  const int64_t* off = offsets_of(groups);
  const std::vector<int64_t> first_column = column_offsets(groups);
  const int64_t N = dy.data.size(0), K = x.data.size(0);
  auto columns_of = [&](int64_t g) { return first_column[size_t(g + 1)] - first_column[size_t(g)]; };
  grouped_gemm_tiles<float>(
      groups.num_groups(), [&](int64_t g) { return GemmExtent{N, K, columns_of(g)}; },
      [&](int64_t g, int64_t i0, int64_t ni, float* p) {
        decode_rows(dy.data, i0, ni, first_column[size_t(g)], columns_of(g), p);
      },
      [&](int64_t g, int64_t j0, int64_t nj, float* p) {
        decode_rows(x.data, j0, nj, first_column[size_t(g)], columns_of(g), p);
      },
      [&](int64_t g, int64_t i, int64_t j, const float* a, const float* b, int64_t l) {
        const int64_t first_block = first_column[size_t(g)] / kBlock;
        return block_scaled_dot(a, b, l, [&](int64_t blk) {
          return float_at(dy.scales, first_block + blk, i) * float_at(x.scales, first_block + blk, j);
        });
      },
      [&](int64_t g, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const float* c) {
        emit_wgrad_tile(dweight, mode, g, off[g + 1] == off[g], i0, ni, j0, nj, c);
      });
}

}  // namespace moe::cpu
