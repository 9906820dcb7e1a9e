// The store epilogue of the Hopper grouped GEMM: a math warpgroup's 64 x 256 accumulators
// (+ bias / scaled bias) go to 128-byte-swizzled shared memory and out with TMA stores, 128 bytes
// of columns at a time (epilogue_slab.cuh); wgrads into fp32 main_grad reduce-add instead.
//
// An epilogue type (StoreEpilogue here, the GLU ones in epilogue_glu.cuh) has, for the kernel:
//   aggregate {p, map_d, map_e, smem, th}   built once per math thread
//   kLookUpAfter          true: the kernel looks the next tile up after store(), not under the mainloop
//   begin_tile(t)         before the tile's mainloop
//   after_step(t, kb)     after each k step of the mainloop (prefetches of what the epilogue reads)
//   store(t, acc, probe)  the tile's epilogue
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/ptx/tma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/epilogue_slab.cuh"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

// D (+ bias, scaled by row_scale) stored, or reduce-added into main_grad (wgrad, fp32).
template <Form kForm, class In, class Out, class Pipe>
struct StoreEpilogue {
  using Slab = EpilogueSlab<kForm, In, Out, Pipe>;
  static constexpr bool kLookUpAfter = false;
  // Accumulating into main_grad: the epilogue's TMA reduce-adds read the old values. This
  // warpgroup's slab of them is pulled into L2 kMainGradLead k steps before the mainloop ends:
  // early enough to hide the DRAM reads, late enough not to crowd the operands out of L2.
  // Measured: wgrad_acc -11% time over the suite with a lead of 2 or 4 steps (small batch -30%,
  // qwen3 -10..-22%); at the tile's start the long-K GEMMs lost 3-7%.
  static constexpr int kMainGradLead = 2;

  const GemmParams& p;
  const CUtensorMap& map_d;
  const CUtensorMap& map_e;  // unused (the GLU forward's act)
  const SharedStorage<Pipe>& smem;
  const MathThread& th;

  __device__ __forceinline__ void begin_tile(const Tile&) const {}

  __device__ __forceinline__ void after_step(const Tile& t, int kb) const {
    if (kb == max(t.k_blocks - kMainGradLead, 0)) prefetch_main_grad(t);
  }

  __device__ __forceinline__ void prefetch_main_grad(const Tile& t) const {
    if constexpr (kForm == Form::kWgrad && std::is_same_v<Out, float>) {
      const int32_t slab_row = t.m0 + 64 * int32_t(tile_slab<typename Pipe::Cfg>(th.math));
      if (p.reduce_add && th.wg_thread == 0 && slab_row < p.m_out) {
        const CUtensorMap* md = p.d_maps ? p.d_maps + t.group : &map_d;
        const int32_t gd = p.d_maps ? 0 : t.group;
        constexpr int32_t kBoxCols = 128 / int32_t(sizeof(float));  // the epilogue's store boxes
        for (int32_t col = t.n0; col < min(t.n0 + Slab::kBN, p.n_out); col += kBoxCols)
          ptx::tma_prefetch_3d(md, col, slab_row, gd);
      }
    }
  }

  template <class Probe>
  __device__ __forceinline__ void store(const Tile& t, float (&acc)[Slab::kBN / 2], Probe& probe) const {
    auto all_batches = [&](const Slab& s, auto& run_batch, auto& store_batch, auto& batch_live) {
#pragma unroll
      for (int batch = 0; batch < Slab::kChunks / Slab::kBatch; ++batch) {
        if (!s.slab_live || !batch_live(batch)) break;  // uniform
        if (kForm == Form::kForward && p.bias != nullptr)
          store_batch(batch, std::true_type{});
        else
          store_batch(batch, std::false_type{});
      }
    };
    with_store_batches<Slab>(p, smem, th, t, acc, map_d, probe, all_batches);
  }
};

}  // namespace moe::cuda::sm90
