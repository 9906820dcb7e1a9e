// The mainloop (consumer) of the Hopper grouped GEMM for 16-bit operands (bf16 or fp16): each math
// warpgroup multiplies its 64 rows of the 128 x kBlockN tile with wgmma, one ring stage per k step,
// into fp32 accumulators in registers, and releases each stage once the wgmma reading it retired.
//
// The kernel picks its mainloop by type (grouped_gemm_kernel.cuh's MainloopFor), so another
// mainloop is another type with the same interface, not a branch in this one:
//   Mainloop(const SharedStorage<Pipe>&, const GemmParams&, uint32_t math, uint32_t lane)
//                                                                       once per math thread
//   Accumulators                                                        its register tile
//   run(tile, acc, ring, probe, after_step, after_loop)                 the k-loop of one tile
// The FP8 block-scaled mainloop (mainloop_fp8.cuh) is the other one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

template <class In>
struct InputTraits;
template <>
struct InputTraits<__nv_bfloat16> {
  static constexpr bool kFp16 = false;
};
template <>
struct InputTraits<__half> {
  static constexpr bool kFp16 = true;
};

template <class In, Form kForm, class Pipe>
struct Mainloop16Bit {
  static constexpr int kBN = Pipe::Cfg::kBlockN, kBK = Config::kBlockK;
  static constexpr int kAccRegs = kBN / 2;  // 64 x kBN f32 accumulators over 128 threads
  using Accumulators = float[kAccRegs];
  using Wgmma = ptx::WgmmaSS<kBN, InputTraits<In>::kFp16>;

  static constexpr int kTransA = kForm == Form::kWgrad ? 1 : 0;   // A MN-major (dY^T)
  static constexpr int kTransB = kForm == Form::kForward ? 0 : 1;  // B MN-major (W for dgrad, X for wgrad)
  // Descriptor bases (low word varies by stage and k step).
  static constexpr uint32_t kLeadA = kTransA ? Config::kPanelBytes : 0;
  static constexpr uint32_t kLeadB = kTransB ? Config::kPanelBytes : 0;
  static constexpr uint32_t kStepA = kTransA ? 16 * 128 : 32;  // bytes per k16 step
  static constexpr uint32_t kStepB = kTransB ? 16 * 128 : 32;

  const SharedStorage<Pipe>& smem;
  const uint32_t lane;
  const uint32_t a_offset;  // this warpgroup's 64 rows of A within a stage

  __device__ __forceinline__ Mainloop16Bit(const SharedStorage<Pipe>& smem, const GemmParams&, uint32_t math,
                                           uint32_t lane)
      : smem(smem),
        lane(lane),
        a_offset(kTransA ? tile_slab<typename Pipe::Cfg>(math) * Config::kPanelBytes
                         : tile_slab<typename Pipe::Cfg>(math) * 64 * 128) {}

  // Before the first tile and after the last (the FP8 mainloop's turns; nothing here).
  __device__ __forceinline__ void begin() const {}
  __device__ __forceinline__ void finish() const {}

  // The k-loop of tile t into acc. after_step(kb) runs after step kb has been issued (and the
  // stage before it released); after_loop() once the last step has retired and its stage been
  // released. A tile with no k step (an empty wgrad group) leaves acc zero.
  template <class Probe, class AfterStep, class AfterLoop>
  __device__ __forceinline__ void run(const Tile& t, Accumulators& acc, RingState<Pipe::kStages>& ring,
                                      Probe& probe, AfterStep&& after_step, AfterLoop&& after_loop) const {
    int previous = -1;
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      ptx::mbarrier_wait(&smem.full[ring.stage], ring.phase);
      probe.full_stage(kb);
      const uint32_t a_base = ptx::smem_address(smem.stage_a(ring.stage)) + a_offset;
      const uint32_t b_base = ptx::smem_address(smem.stage_b(ring.stage));
      ptx::fence_accumulators(acc);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t da = ptx::smem_descriptor(a_base + kk * kStepA, kLeadA, 1024);
        const uint64_t db = ptx::smem_descriptor(b_base + kk * kStepB, kLeadB, 1024);
        Wgmma::template mma<kTransA, kTransB>(acc, da, db, (kb > 0 || kk > 0) ? 1u : 0u);
      }
      ptx::wgmma_commit_group();
      ptx::fence_accumulators(acc);
      // The group before this one has retired: its stage can be refilled.
      ptx::wgmma_wait_group<1>();
      if (previous >= 0) smem.release(previous, lane);
      previous = ring.stage;
      ring.advance();
      after_step(kb);
    }
    ptx::wgmma_wait_group<0>();
    ptx::fence_accumulators(acc);
    probe.end_mainloop(t);
    if (previous >= 0) smem.release(previous, lane);
    after_loop();
    if (kForm == Form::kWgrad && t.k_blocks == 0) {  // an empty wgrad group writes zeros (no wgmma in flight)
#pragma unroll
      for (int r = 0; r < kAccRegs; ++r) acc[r] = 0.f;
    }
  }
};

}  // namespace moe::cuda::sm90
