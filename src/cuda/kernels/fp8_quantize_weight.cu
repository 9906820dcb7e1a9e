// The FP8 weight quantizer (moe_engine/fp8.hpp): 128 x 128 blocks of every expert, one scale each,
// the data and its transpose data_t (what dgrad's FP8 GEMM reads), from one read of the weight;
// on the tile stream of fp8_tile_stream.cuh.
#include <type_traits>

#include "cuda/backend.hpp"
#include "cuda/gemm/expert_address.hpp"
#include "cuda/kernels/fp8_tile_stream.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

using namespace fp8_tiles;

// ---- weights: 128 x 128 blocks, data and / or data_t ----

struct WeightParams {
  ExpertAddress w;  // G x [N, K] contiguous
  int64_t N, K, row_blocks, col_blocks, items;
  uint8_t* data;  // [G, N, K]
  float* scales;  // [G, ceil(N/128), ceil(K/128)]
  uint8_t* data_t;  // [G, K, N]
  float* scales_t;  // [G, ceil(K/128), ceil(N/128)]
  int stages;
  Recipe recipe;
};

struct WeightShared {
  Slot slot[kMaxStages];
  uint32_t warp_amax[kWarps];
};

// Items: (expert, row block, column block), column blocks fastest; the row layout. One scale per
// block: a warp reduction, then the 8 warps' through shared memory. Each value quantized once: the
// rows' bytes go to data, their 8 x 8 transposes through the consumed stage to data_t.
template <class T, bool kVector>
__global__ void __launch_bounds__(kThreads, 2) quantize_weight_kernel(const WeightParams p) {
  using V = Words<T>;
  using Staged = Stage<T, false>;
  extern __shared__ __align__(16) uint8_t stages[];
  __shared__ WeightShared shared;
  int64_t begin, end;
  share_of(p.items, begin, end);
  if (begin >= end) return;
  const ExpertAddress address = p.w;  // a local copy: calling a member on a kernel parameter spills it
  int64_t next_kb = begin % p.col_blocks, next_nb = begin / p.col_blocks % p.row_blocks;
  int64_t next_g = begin / p.col_blocks / p.row_blocks;

  auto issue = [&](int stage) {
    const int64_t g = next_g, row0 = next_nb * kTile, k0 = next_kb * kTile;
    if (++next_kb == p.col_blocks) {
      next_kb = 0;
      if (++next_nb == p.row_blocks) next_nb = 0, ++next_g;
    }
    const int rows = int(std::min<int64_t>(kTile, p.N - row0)), features = int(std::min<int64_t>(kTile, p.K - k0));
    if (threadIdx.x == 0) shared.slot[stage] = Slot{row0, g, k0, rows, features};
    Staged::template load<kVector>(stages + stage * Staged::kBytes, address.at<const T>(g) + row0 * p.K + k0, p.K,
                                   rows, features);
  };
  auto process = [&](int stage) {
    const Slot tile = shared.slot[stage];
    const int64_t g = tile.block, nb = tile.row0 / kTile, kb = tile.k0 / kTile;
    uint8_t* staged = stages + stage * Staged::kBytes;
    const RowLayout<T> at;
    uint32_t words[8][RowLayout<T>::kWords];
    Staged::read(staged, at, words);
    uint32_t a = V::fold(words[0]);
#pragma unroll
    for (int i = 1; i < 8; ++i) a = V::max(a, V::fold(words[i]));
    a = __reduce_max_sync(~0u, V::amax_bits(a));
    if (threadIdx.x % 32 == 0) shared.warp_amax[threadIdx.x / 32] = a;
    __syncthreads();  // partials complete; every thread has read its values out of the stage
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = max(a, shared.warp_amax[w]);
    const detail::Fp8TileScale s = p.recipe.scale(a);
    if (threadIdx.x == 0) {
      if (p.scales) p.scales[(g * p.row_blocks + nb) * p.col_blocks + kb] = s.scale;
      if (p.scales_t) p.scales_t[(g * p.col_blocks + kb) * p.row_blocks + nb] = s.scale;
    }
    uint32_t q[8][2];
#pragma unroll
    for (int i = 0; i < 8; ++i) quantize_run<T, 8>(words[i], s.multiplier, q[i]);
    if (p.data && 8 * at.m < tile.features) {
      uint8_t* out = p.data + (g * p.N + tile.row0 + 8 * at.group) * p.K + tile.k0 + 8 * at.m;
#pragma unroll
      for (int i = 0; i < 8; ++i, out += p.K)
        if (8 * at.group + i < tile.rows) *reinterpret_cast<uint2*>(out) = make_uint2(q[i][0], q[i][1]);
    }
    if (p.data_t) {
      const TransposeTile transposed{staged};
#pragma unroll
      for (int j = 0; j < 8; ++j) transposed.put(8 * at.m + j, at.group, byte_column(q, j));
      __syncthreads();
      transposed.store(tile.features, tile.rows / 16, p.data_t + (g * p.K + tile.k0) * p.N + tile.row0, p.N);
    }
  };
  run_stages(begin, end, p.stages, issue, process);
}

template <class T, bool kVector>
void launch_weight(WeightParams params, int device, Stream stream) {
  constexpr auto kernel = quantize_weight_kernel<T, kVector>;
  const LaunchPlan& plan = launch_plan<kernel>(device, Stage<T, false>::kBytes, "quantize_weight_kernel");
  params.stages = plan.stages;
  kernel<<<plan.grid, kThreads, plan.shared_bytes, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH("quantize_weight_kernel");
}

}  // namespace

void quantize_fp8_weight(const GroupedParam& weight, const Fp8Weight& out, const Fp8Recipe& recipe, Stream stream) {
  const int64_t G = weight.num_groups(), N = weight.expert_shape()[0], K = weight.expert_shape()[1];
  if (G == 0 || N == 0 || K == 0) return;
  WeightParams p{};
  p.w = expert_address("quantize_fp8_weight", "weight", weight);
  p.N = N;
  p.K = K;
  p.row_blocks = blocks_of(N);
  p.col_blocks = blocks_of(K);
  p.items = G * p.row_blocks * p.col_blocks;
  p.data = out.data.defined() ? out.data.data_as<uint8_t>() : nullptr;
  p.scales = out.scales.defined() ? out.scales.data_as<float>() : nullptr;
  p.data_t = out.data_t.defined() ? out.data_t.data_as<uint8_t>() : nullptr;
  p.scales_t = out.scales_t.defined() ? out.scales_t.data_as<float>() : nullptr;
  p.recipe = {recipe.pow2_scales, recipe.amax_epsilon};
  bool vector = true;
  for (int64_t g = 0; g < G; ++g) vector = vector && is_aligned(weight.expert(g).data(), 16);
  const int device = weight.device().index;
  with_cuda_type(weight.dtype(), "quantize_fp8_weight", [&](auto type) {
    using T = decltype(type);
    // K is a multiple of 16 (validated): with aligned experts every row is 16-byte aligned.
    if (vector)
      launch_weight<T, true>(p, device, stream);
    else
      launch_weight<T, false>(p, device, stream);
  });
}

}  // namespace moe::cuda
