// The mainloop (consumer) of the Hopper FP8 grouped GEMM with block scaling: each math warpgroup
// multiplies its 64 rows of the 128 x 128 tile, one 128-wide k step (one scale block) per ring
// stage. The tensor core sums a step into a partial tile (4 wgmma of k32, the first overwriting);
// the step's scales then promote it into the fp32 running sum, acc += partial * scale: FP8 wgmma
// keeps only about 14 bits of its sum, so no sum runs longer than 128 elements inside it.
//   M-grouped: scale = sa[row] * sb, sa the row's scale (M-major: the tile's rows are adjacent),
//              sb the weight's 128 x 128 block scale;
//   K-grouped: scale = sa[row] * sb[col], the step's row scales of dY^T and column scales of X^T.
// The producer warpgroup's scale warp has put the step's scales into the stage; each thread reads
// those of its accumulator rows and columns while its wgmma runs. The other math warpgroup's wgmma
// runs while this one promotes, so the tensor core stays busy.
// Same interface as Mainloop16Bit (mainloop_16bit.cuh).
#pragma once

#include <cstdint>

#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

template <Form kForm, class Pipe>
struct MainloopFp8 {
  using Cfg = typename Pipe::Cfg;
  static constexpr int kBN = Cfg::kBlockN, kBK = Cfg::kBlockK;
  static constexpr int kAccRegs = kBN / 2;  // 64 x kBN f32 over 128 threads
  static constexpr bool kKGrouped = kForm == Form::kWgrad;
  using Accumulators = float[kAccRegs];
  using Wgmma = ptx::WgmmaFp8SS<kBN>;
  static constexpr int kK32Steps = kBK / 32;

  const SharedStorage<Pipe>& smem;
  const GemmParams& p;
  const uint32_t lane;
  const uint32_t a_offset;  // this warpgroup's 64 rows of A within a stage
  const uint32_t row;       // this thread's first accumulator row within the tile (and row + 8)

  __device__ __forceinline__ MainloopFp8(const SharedStorage<Pipe>& smem, const GemmParams& p, uint32_t math,
                                         uint32_t lane)
      : smem(smem),
        p(p),
        lane(lane),
        a_offset(math * 64 * 128),
        row(64 * math + 16 * ((threadIdx.x / 32) % 4) + lane / 4) {}

  // The scales of the stage's step (stored by the producer's scale warp): sa for rows row and
  // row + 8, sc per accumulator column pair (K-grouped) or sc[0] = the weight's block scale.
  template <int kCols>
  __device__ __forceinline__ void read_scales(int stage, float (&sa)[2], float (&sc)[kCols]) const {
    const uint32_t scales = smem.stage_scales(stage);
#pragma unroll
    for (int h = 0; h < 2; ++h) sa[h] = __uint_as_float(ptx::ld_shared_b32(scales + 4 * (row + 8 * h)));
    if constexpr (kKGrouped) {
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
        const uint32_t col = Cfg::kBlockM + 8 * j + 2 * (lane % 4);
        sc[2 * j] = __uint_as_float(ptx::ld_shared_b32(scales + 4 * col));
        sc[2 * j + 1] = __uint_as_float(ptx::ld_shared_b32(scales + 4 * (col + 1)));
      }
    } else {
      sc[0] = __uint_as_float(ptx::ld_shared_b32(scales + 4 * Cfg::kBlockM));
    }
  }

  template <class Probe, class AfterStep, class AfterLoop>
  __device__ __forceinline__ void run(const Tile& t, Accumulators& acc, RingState<Pipe::kStages>& ring,
                                      Probe& probe, AfterStep&& after_step, AfterLoop&& after_loop) const {
    float partial[kAccRegs];
#pragma unroll
    for (int r = 0; r < kAccRegs; ++r) acc[r] = 0.f;
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      ptx::mbarrier_wait(&smem.full[ring.stage], ring.phase);
      probe.full_stage(kb);
      const uint32_t a_base = ptx::smem_address(smem.stage_a(ring.stage)) + a_offset;
      const uint32_t b_base = ptx::smem_address(smem.stage_b(ring.stage));
      ptx::fence_accumulators(partial);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kK32Steps; ++kk) {
        const uint64_t da = ptx::smem_descriptor(a_base + kk * 32, 0, 1024);
        const uint64_t db = ptx::smem_descriptor(b_base + kk * 32, 0, 1024);
        Wgmma::mma(partial, da, db, kk > 0 ? 1u : 0u);
      }
      ptx::wgmma_commit_group();
      float sa[2], sc[kKGrouped ? kBN / 4 : 1];
      read_scales(ring.stage, sa, sc);  // while the tensor core works
      ptx::wgmma_wait_group<0>();
      ptx::fence_accumulators(partial);
      smem.release(ring.stage, lane);
      ring.advance();
      // Promotion: acc[4j + 2h + c] is row (row + 8h), column 8j + 2 (lane % 4) + c.
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float s = kKGrouped ? sa[h] * sc[2 * j + c] : sa[h] * sc[0];
            acc[4 * j + 2 * h + c] = __fmaf_rn(partial[4 * j + 2 * h + c], s, acc[4 * j + 2 * h + c]);
          }
        }
      }
      after_step(kb);
    }
    probe.end_mainloop(t);
    after_loop();
  }
};

}  // namespace moe::cuda::sm90
