// The router on CUDA (docs/design.md section 13), after the logits (kernels/router_linear.cu):
//   - forward: one warp per token. Lane l holds experts l, l + 32, ... (slot i: expert 32 i + l).
//     The scores, the group-limited and top-k choices (a warp's maximum of 64-bit keys, one per expert:
//     value and index, common/router_math.hpp) and the probabilities use the CPU backend's
//     functions and sum order, so they are its bits for the same logits. A block of 8 warps takes
//     64 tokens and writes their counts and loss terms, summed per warp in token order then over
//     the warps in order, to one row of partial sums; one block then sums the rows in order.
//   - backward: one warp per token writes dL/dlogits (the CPU backend's formulas and order), and
//     where the products run on the grouped GEMM also its exact three-part bfloat16 split.
//   - the expert-bias update: one block.
// Fixed grids from T and E, no atomics, no host sync: deterministic and CUDA-graph safe.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/router_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/runtime/check.hpp"

namespace moe::cuda {
namespace {

using detail::ieee_add;
using detail::ieee_div;
using detail::ieee_mul;
using detail::ieee_sub;
using detail::kRouterNoKey;
using detail::router_exp;
using detail::router_key;
using detail::router_key_index;
using detail::router_key_value;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int64_t kMaxExperts = 512;  // 16 slots per lane
constexpr int64_t kMaxTopk = 32;      // lane j holds choice j
static_assert(detail::kRouterChunkTokens % kWarps == 0,
              "a chunk's tokens split evenly over the warps");
constexpr int kBackwardBlocks = 2048;  // enough warps to fill a GPU; each strides over the tokens

// ---- warp reductions (every lane ends with the result) ----

// The sum in router_warp_sum's order: each lane's own value (its slots already added in order),
// then the butterfly.
__device__ __forceinline__ float warp_sum(float lane_sum) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    lane_sum = ieee_add(lane_sum, __shfl_xor_sync(kFullMask, lane_sum, offset));
  return lane_sum;
}

__device__ __forceinline__ float warp_fmax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

__device__ __forceinline__ uint64_t warp_max(uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint64_t other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// ---- one token's experts in a lane: slot i is expert 32 i + lane ----

template <int kSlots>
struct Slots {
  int lane, experts;
  __device__ __forceinline__ bool holds(int slot) const { return slot * 32 + lane < experts; }
  __device__ __forceinline__ int expert(int slot) const { return slot * 32 + lane; }

  // sum over the warp of v over the held slots, in router_warp_sum's order.
  __device__ __forceinline__ float sum(const float (&v)[kSlots]) const {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (holds(i)) s = ieee_add(s, v[i]);
    return warp_sum(s);
  }
  __device__ __forceinline__ uint64_t max_key(const uint64_t (&key)[kSlots]) const {
    uint64_t best = kRouterNoKey;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) best = key[i] > best ? key[i] : best;
    return warp_max(best);
  }
  // v[slot] of the lane that holds expert e, in every lane (e uniform over the warp).
  __device__ __forceinline__ float of_expert(const float (&v)[kSlots], int e) const {
    const int slot = e / 32;
    float mine = v[0];
#pragma unroll
    for (int i = 1; i < kSlots; ++i)
      if (i == slot) mine = v[i];
    return __shfl_sync(kFullMask, mine, e % 32);
  }
  // fn(i) for the slot i holding expert e, in the lane that holds it.
  template <class Fn>
  __device__ __forceinline__ void at_expert(int e, Fn&& fn) const {
    if (lane != e % 32) return;
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (i == e / 32) fn(i);
  }
};

// e^(l - max) into ex, with the max (fmax: NaN skipped, as the CPU's) and the sum of ex.
template <int kSlots>
__device__ __forceinline__ void exp_parts(const Slots<kSlots>& at, const float (&l)[kSlots],
                                          float (&ex)[kSlots], float& max, float& sum) {
  float m = __int_as_float(0x7fffffff);  // NaN: fmax's neutral value
#pragma unroll
  for (int i = 0; i < kSlots; ++i)
    if (at.holds(i)) m = fmaxf(m, l[i]);
  max = warp_fmax(m);
#pragma unroll
  for (int i = 0; i < kSlots; ++i) ex[i] = at.holds(i) ? router_exp(ieee_sub(l[i], max)) : 0.f;
  sum = at.sum(ex);
}

// The scores of l into s (in place is fine); for softmax also the logsumexp's parts.
template <int kSlots>
__device__ __forceinline__ void scores(const Slots<kSlots>& at, bool softmax,
                                       const float (&l)[kSlots], float (&s)[kSlots], float& max,
                                       float& sum) {
  if (softmax) {
    exp_parts(at, l, s, max, sum);
#pragma unroll
    for (int i = 0; i < kSlots; ++i) s[i] = ieee_div(s[i], sum);
  } else {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) s[i] = detail::router_sigmoid(l[i]);
  }
}

template <int kSlots>
__device__ __forceinline__ void load_logits(const Slots<kSlots>& at, const float* row,
                                            float (&l)[kSlots]) {
#pragma unroll
  for (int i = 0; i < kSlots; ++i) l[i] = at.holds(i) ? row[at.expert(i)] : 0.f;
}

// ---- forward ----

template <class Index>
struct ForwardArgs {
  const float* logits;
  int64_t ld_logits;
  const float* bias;  // optional
  Index* indices;
  int64_t ld_indices;
  float* probs;
  int64_t ld_probs;
  // This block's row of partial sums: [chunks, E] (z: [chunks]); scores and aux_counts with aux.
  float* partial_scores;
  int32_t* partial_counts;
  int32_t* partial_aux_counts;
  float* partial_z;
  int64_t tokens;
  int experts, topk, num_groups, topk_groups;
  float scaling;
  bool softmax, norm, aux, z;
  bool aux_is_routing;  // the load-balancing loss's top-k is the routing's (softmax, no bias, no
                        // groups)
};

// Group-limited routing: clears the keys of the experts outside the topk_groups best groups (a
// group scored by the sum of its two best selection scores' canonical values, or its one score).
template <int kSlots>
__device__ __forceinline__ void keep_best_groups(const Slots<kSlots>& at, int groups, int kept,
                                                 uint64_t (&key)[kSlots]) {
  const int size = at.experts / groups;
  uint64_t group_key[kSlots];  // group g in lane g % 32, slot g / 32
#pragma unroll
  for (int i = 0; i < kSlots; ++i) group_key[i] = kRouterNoKey;
  for (int g = 0; g < groups; ++g) {
    uint64_t mine[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      mine[i] = at.holds(i) && at.expert(i) / size == g ? key[i] : kRouterNoKey;
    const uint64_t first = at.max_key(mine);
#pragma unroll
    for (int i = 0; i < kSlots; ++i) mine[i] = mine[i] == first ? kRouterNoKey : mine[i];
    float score = router_key_value(first);
    if (size > 1) score = ieee_add(score, router_key_value(at.max_key(mine)));
    at.at_expert(g, [&](int i) { group_key[i] = router_key(score, uint32_t(g)); });
  }
  uint32_t eligible = 0;  // bit i: slot i's expert is in a kept group
  for (int j = 0; j < kept; ++j) {
    const uint64_t best = at.max_key(group_key);
    const int g = int(router_key_index(best));
    at.at_expert(g, [&](int i) { group_key[i] = kRouterNoKey; });
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (at.holds(i) && at.expert(i) / size == g) eligible |= 1u << i;
  }
#pragma unroll
  for (int i = 0; i < kSlots; ++i)
    if (!(eligible >> i & 1u)) key[i] = kRouterNoKey;
}

template <int kSlots, class Index>
__global__ void __launch_bounds__(kThreads) router_forward_kernel(ForwardArgs<Index> a) {
  __shared__ float chunk_scores[kMaxExperts];
  __shared__ int32_t chunk_counts[kMaxExperts], chunk_aux_counts[kMaxExperts];
  __shared__ float chunk_z[kWarps];
  const int warp = threadIdx.x / 32;
  const Slots<kSlots> at{int(threadIdx.x % 32), a.experts};
  const int lane = at.lane;
  const float eps = float(detail::kRouterNormEpsilon);
  // This warp's sums over its tokens of the chunk, in token order.
  float score_sum[kSlots] = {}, z_sum = 0.f;
  int32_t count[kSlots] = {}, aux_count[kSlots] = {};
  const int64_t chunk = blockIdx.x;
  for (int64_t t = chunk * detail::kRouterChunkTokens + warp;
       t < a.tokens && t < (chunk + 1) * detail::kRouterChunkTokens; t += kWarps) {
    float l[kSlots], s[kSlots], max = 0.f, sum = 0.f;
    load_logits(at, a.logits + t * a.ld_logits, l);
    scores(at, a.softmax, l, s, max, sum);
    uint64_t key[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      key[i] = at.holds(i) ? router_key(a.bias ? ieee_add(s[i], a.bias[at.expert(i)]) : s[i],
                                        uint32_t(at.expert(i)))
                           : kRouterNoKey;
    if (a.num_groups > 1) keep_best_groups(at, a.num_groups, a.topk_groups, key);
    int choice = 0;
    float chosen_score = 0.f;  // lane j: choice j and its score
    for (int j = 0; j < a.topk; ++j) {
      const int e = int(router_key_index(at.max_key(key)));
      const float se = at.of_expert(s, e);
      if (lane == j) {
        choice = e;
        chosen_score = se;
      }
      at.at_expert(e, [&](int i) {
        key[i] = kRouterNoKey;
        ++count[i];
        if (a.aux_is_routing) ++aux_count[i];
      });
    }
    float p = chosen_score;
    if (a.norm)
      p = ieee_div(p, ieee_add(warp_sum(lane < a.topk ? ieee_add(0.f, chosen_score) : 0.f), eps));
    p = ieee_mul(p, a.scaling);
    if (lane < a.topk) {
      a.indices[t * a.ld_indices + lane] = Index(choice);
      a.probs[t * a.ld_probs + lane] = p;
    }
    if (a.aux) {  // the load-balancing loss's scores: the softmax, or the sigmoid scores over their
                  // sum
      if (!a.softmax) {
        const float total = ieee_add(at.sum(s), eps);
#pragma unroll
        for (int i = 0; i < kSlots; ++i) s[i] = ieee_div(s[i], total);
      }
#pragma unroll
      for (int i = 0; i < kSlots; ++i)
        if (at.holds(i)) score_sum[i] = ieee_add(score_sum[i], s[i]);
      if (!a.aux_is_routing) {  // their own plain top-k
#pragma unroll
        for (int i = 0; i < kSlots; ++i)
          key[i] = at.holds(i) ? router_key(s[i], uint32_t(at.expert(i))) : kRouterNoKey;
        for (int j = 0; j < a.topk; ++j) {
          const int e = int(router_key_index(at.max_key(key)));
          at.at_expert(e, [&](int i) {
            key[i] = kRouterNoKey;
            ++aux_count[i];
          });
        }
      }
    }
    if (a.z) {
      if (!a.softmax) exp_parts(at, l, s, max, sum);
      const float lse = ieee_add(max, logf(sum));
      z_sum = ieee_add(z_sum, ieee_mul(lse, lse));
    }
  }
  // The warps' sums, added in warp order, then one row of partial sums.
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        if (!at.holds(i)) continue;
        const int e = at.expert(i);
        chunk_counts[e] = (w == 0 ? 0 : chunk_counts[e]) + count[i];
        chunk_aux_counts[e] = (w == 0 ? 0 : chunk_aux_counts[e]) + aux_count[i];
        chunk_scores[e] = w == 0 ? score_sum[i] : ieee_add(chunk_scores[e], score_sum[i]);
      }
      if (lane == 0) chunk_z[w] = z_sum;
    }
    __syncthreads();
  }
  const int64_t row = chunk * a.experts;
  for (int e = threadIdx.x; e < a.experts; e += kThreads) {
    a.partial_counts[row + e] = chunk_counts[e];
    if (a.aux) {
      a.partial_aux_counts[row + e] = chunk_aux_counts[e];
      a.partial_scores[row + e] = chunk_scores[e];
    }
  }
  if (a.z && threadIdx.x == 0) {
    float z = chunk_z[0];
    for (int w = 1; w < kWarps; ++w) z = ieee_add(z, chunk_z[w]);
    a.partial_z[chunk] = z;
  }
}

// The block's sum of one value per thread: each warp's butterfly, then the warps' sums in order.
__device__ float block_sum(float v, float* warp_sums) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) total = ieee_add(total, warp_sums[w]);
  __syncthreads();  // warp_sums may be reused
  return total;
}

struct FinishArgs {
  const float* partial_scores;
  const int32_t* partial_counts;
  const int32_t* partial_aux_counts;
  const float* partial_z;
  int64_t chunks;
  int experts;
  int64_t* counts;
  int64_t* aux_counts;    // with aux_loss
  int64_t* counts_total;  // optional: counts added into it
  float* aux_loss;        // optional
  float* z_loss;          // optional
  float* total_loss;      // optional: aux_loss + z_loss (those requested)
  float aux_factor, z_factor;
};

// One block: the rows of partial sums in chunk order, into the counts and the losses.
__global__ void __launch_bounds__(kThreads) router_finish_kernel(FinishArgs a) {
  __shared__ float warp_sums[kWarps];
  float aux_terms = 0.f;
  for (int e = threadIdx.x; e < a.experts; e += kThreads) {
    int64_t count = 0, aux_count = 0;
    float score_sum = 0.f;
    for (int64_t b = 0; b < a.chunks; ++b) {
      count += a.partial_counts[b * a.experts + e];
      if (a.aux_loss) {
        aux_count += a.partial_aux_counts[b * a.experts + e];
        score_sum = ieee_add(score_sum, a.partial_scores[b * a.experts + e]);
      }
    }
    a.counts[e] = count;
    if (a.counts_total) a.counts_total[e] += count;  // one thread per expert: no race
    if (a.aux_loss) {
      a.aux_counts[e] = aux_count;
      aux_terms = ieee_add(aux_terms, ieee_mul(score_sum, float(aux_count)));
    }
  }
  float aux_value = 0.f, z_value = 0.f;
  if (a.aux_loss) {
    const float total = block_sum(aux_terms, warp_sums);
    aux_value = ieee_mul(total, a.aux_factor);
    if (threadIdx.x == 0) *a.aux_loss = aux_value;
  }
  if (a.z_loss) {
    float z = 0.f;
    for (int64_t b = threadIdx.x; b < a.chunks; b += kThreads) z = ieee_add(z, a.partial_z[b]);
    const float total = block_sum(z, warp_sums);
    z_value = ieee_mul(total, a.z_factor);
    if (threadIdx.x == 0) *a.z_loss = z_value;
  }
  if (a.total_loss && threadIdx.x == 0) *a.total_loss = ieee_add(aux_value, z_value);
}

// ---- backward ----

// v = hi + mid + lo exactly for finite v (three 8-bit significands cover float32's 24, and each
// remainder is exact in float32), up to bfloat16's smallest subnormal (2^-133): the grouped GEMM's
// products with them are exact, as the SIMT kernels' products of v.
__device__ __forceinline__ void split_exactly(float v, __nv_bfloat16& hi, __nv_bfloat16& mid, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(v);
  const float rest = __fsub_rn(v, __bfloat162float(hi));
  mid = __float2bfloat16_rn(rest);
  lo = __float2bfloat16_rn(__fsub_rn(rest, __bfloat162float(mid)));
}

template <class Index>
struct BackwardArgs {
  const float* logits;
  int64_t ld_logits;
  const Index* indices;
  int64_t ld_indices;
  const float* d_probs;  // optional
  int64_t ld_d_probs;
  const float* d_aux_loss;  // optional, with aux_counts
  const int64_t* aux_counts;
  const float* d_z_loss;  // optional
  float* d_logits;        // [T, E]
  __nv_bfloat16* d_split;  // optional [T, ld_split]: [hi | mid | lo] of d_logits (split_exactly)
  int64_t ld_split;
  int64_t tokens;
  int experts, topk;
  float scaling, aux_factor, z_factor_twice;
  bool softmax, norm;
};

template <int kSlots, class Index>
__global__ void __launch_bounds__(kThreads) router_backward_kernel(BackwardArgs<Index> a) {
  const Slots<kSlots> at{int(threadIdx.x % 32), a.experts};
  const int lane = at.lane;
  const float eps = float(detail::kRouterNormEpsilon);
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; t < a.tokens; t += warps) {
    float l[kSlots], s[kSlots], ds[kSlots] = {}, max = 0.f, sum = 0.f;
    load_logits(at, a.logits + t * a.ld_logits, l);
    scores(at, a.softmax, l, s, max, sum);
    if (a.d_probs) {  // lane j: choice j, its score r_j and g_j = scaling * d_probs[t, j]
      int choice = -1;
      float r = 0.f, g = 0.f;
      for (int j = 0; j < a.topk; ++j) {
        const int64_t e = int64_t(a.indices[t * a.ld_indices + j]);
        if (e < 0 || e >= a.experts) continue;  // not router_forward's indices: skipped
        const float se = at.of_expert(s, int(e));
        if (lane == j) {
          choice = int(e);
          r = se;
          g = ieee_mul(a.scaling, a.d_probs[t * a.ld_d_probs + j]);
        }
      }
      float dr = g;
      if (a.norm) {  // p_j = r_j / D: dL/dr_i = (g_i - sum_j g_j p_j) / D
        const float denominator = ieee_add(warp_sum(lane < a.topk ? ieee_add(0.f, r) : 0.f), eps);
        const float term = ieee_mul(g, ieee_div(r, denominator));
        const float dot = warp_sum(lane < a.topk ? ieee_add(0.f, term) : 0.f);
        dr = ieee_div(ieee_sub(g, dot), denominator);
      }
      for (int j = 0; j < a.topk; ++j) {  // ds[choice_j] += dr_j, j in order
        const int e = __shfl_sync(kFullMask, choice, j);
        const float d = __shfl_sync(kFullMask, dr, j);
        if (e >= 0) at.at_expert(e, [&](int i) { ds[i] = ieee_add(ds[i], d); });
      }
    }
    if (a.d_aux_loss) {  // dL/dq_e = d_aux * factor * count_e
      const float scale = ieee_mul(*a.d_aux_loss, a.aux_factor);
      float dq[kSlots];
#pragma unroll
      for (int i = 0; i < kSlots; ++i)
        dq[i] = at.holds(i) ? ieee_mul(scale, float(a.aux_counts[at.expert(i)])) : 0.f;
      if (a.softmax) {
#pragma unroll
        for (int i = 0; i < kSlots; ++i) ds[i] = ieee_add(ds[i], dq[i]);
      } else {  // q = s / Q: dL/ds_i = (dq_i - sum_e dq_e q_e) / Q
        const float total = ieee_add(at.sum(s), eps);
        float terms[kSlots];
#pragma unroll
        for (int i = 0; i < kSlots; ++i) terms[i] = ieee_mul(dq[i], ieee_div(s[i], total));
        const float dot = at.sum(terms);
#pragma unroll
        for (int i = 0; i < kSlots; ++i)
          ds[i] = ieee_add(ds[i], ieee_div(ieee_sub(dq[i], dot), total));
      }
    }
    float dl[kSlots];
    if (a.softmax) {  // dl_e = s_e (ds_e - sum_j ds_j s_j)
      float terms[kSlots];
#pragma unroll
      for (int i = 0; i < kSlots; ++i) terms[i] = ieee_mul(ds[i], s[i]);
      const float dot = at.sum(terms);
#pragma unroll
      for (int i = 0; i < kSlots; ++i) dl[i] = ieee_mul(s[i], ieee_sub(ds[i], dot));
    } else {  // dl_e = ds_e s_e (1 - s_e)
#pragma unroll
      for (int i = 0; i < kSlots; ++i) dl[i] = ieee_mul(ds[i], ieee_mul(s[i], ieee_sub(1.f, s[i])));
    }
    if (a.d_z_loss) {  // dl_e += d_z * 2 factor * lse * softmax_e
      if (!a.softmax) {
        exp_parts(at, l, s, max, sum);
#pragma unroll
        for (int i = 0; i < kSlots; ++i) s[i] = ieee_div(s[i], sum);
      }
      const float c = ieee_mul(ieee_mul(*a.d_z_loss, a.z_factor_twice), ieee_add(max, logf(sum)));
#pragma unroll
      for (int i = 0; i < kSlots; ++i) dl[i] = ieee_add(dl[i], ieee_mul(c, s[i]));
    }
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (at.holds(i)) a.d_logits[t * a.experts + at.expert(i)] = dl[i];
    if (a.d_split) {
      __nv_bfloat16* row = a.d_split + t * a.ld_split;
#pragma unroll
      for (int i = 0; i < kSlots; ++i)
        if (at.holds(i)) {
          const int e = at.expert(i);
          split_exactly(dl[i], row[e], row[a.experts + e], row[2 * a.experts + e]);
        }
    }
  }
}

// ---- the expert-bias update ----

__global__ void __launch_bounds__(kThreads)
    router_update_bias_kernel(float* bias, const int64_t* counts, int experts, float rate) {
  __shared__ int64_t warp_totals[kWarps];
  int64_t total = 0;
  for (int e = threadIdx.x; e < experts; e += kThreads) total += counts[e];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(kFullMask, total, offset);
  if (threadIdx.x % 32 == 0) warp_totals[threadIdx.x / 32] = total;
  __syncthreads();
  total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_totals[w];
  for (int e = threadIdx.x; e < experts; e += kThreads) {
    const int64_t below_mean =
        total - int64_t(experts) * counts[e];  // sign(mean - counts[e]), exactly
    const float sign = below_mean > 0 ? 1.f : below_mean < 0 ? -1.f : 0.f;
    bias[e] = ieee_add(bias[e], ieee_mul(rate, sign));
  }
}

// ---- launchers ----

void check_limits(const char* op, DType dtype, int64_t experts, int64_t topk) {
  if (dtype == DType::kFloat64)
    throw_error(ErrorCode::kNotImplemented, op,
                " on CUDA: float64 inputs (the CPU backend takes them)");
  if (experts > kMaxExperts)
    throw_error(ErrorCode::kNotImplemented, op, " on CUDA: E = ", experts, " experts (at most ",
                kMaxExperts, ")");
  if (topk > kMaxTopk)
    throw_error(ErrorCode::kNotImplemented, op, " on CUDA: topk = ", topk, " (at most ", kMaxTopk,
                ")");
}

// fn(std::integral_constant<int, slots>) with the fewest slots per lane (a power of two) holding E.
template <class Fn>
void with_slots(int64_t experts, Fn&& fn) {
  if (experts <= 32) return fn(std::integral_constant<int, 1>{});
  if (experts <= 64) return fn(std::integral_constant<int, 2>{});
  if (experts <= 128) return fn(std::integral_constant<int, 4>{});
  if (experts <= 256) return fn(std::integral_constant<int, 8>{});
  return fn(std::integral_constant<int, 16>{});
}

template <class Fn>
void with_index_type(DType dtype, Fn&& fn) {
  if (dtype == DType::kInt32) return fn(int32_t{});
  return fn(int64_t{});
}

}  // namespace

void router_forward(const TensorView& x, const TensorView& weight, const TensorView& expert_bias,
                    const RouterOutputs& out, const RouterSpec& spec,
                    const detail::RouterForwardScratch& partials, Stream stream) {
  const int64_t T = x.size(0), E = weight.size(0);
  check_limits("router_forward", x.dtype(), E, spec.topk);
  router_logits(x, weight, out.logits, partials.gemm_offsets, stream);
  const bool aux = out.aux_loss.defined();
  const int64_t chunks = (T + detail::kRouterChunkTokens - 1) / detail::kRouterChunkTokens;
  if (chunks > 0) {
    with_index_type(out.indices.dtype(), [&](auto index) {
      using Index = decltype(index);
      ForwardArgs<Index> a{};
      a.logits = out.logits.data_as<float>();
      a.ld_logits = out.logits.stride(0);
      a.bias = expert_bias.defined() ? expert_bias.data_as<float>() : nullptr;
      a.indices = out.indices.data_as<Index>();
      a.ld_indices = out.indices.stride(0);
      a.probs = out.probs.data_as<float>();
      a.ld_probs = out.probs.stride(0);
      a.partial_scores = partials.scores.data_as<float>();
      a.partial_counts = partials.counts.data_as<int32_t>();
      a.partial_aux_counts = partials.aux_counts.data_as<int32_t>();
      a.partial_z = partials.z_terms.data_as<float>();
      a.tokens = T;
      a.experts = int(E);
      a.topk = int(spec.topk);
      a.num_groups = int(spec.num_groups);
      a.topk_groups = int(spec.topk_groups);
      a.scaling = spec.scaling_factor;
      a.softmax = spec.score == RouterScore::kSoftmax;
      a.norm = spec.norm_topk_prob;
      a.aux = aux;
      a.z = out.z_loss.defined();
      a.aux_is_routing = a.softmax && !expert_bias.defined() && !spec.group_limited();
      with_slots(E, [&](auto slots) {
        router_forward_kernel<decltype(slots)::value, Index>
            <<<unsigned(chunks), kThreads, 0, stream>>>(a);
        MOE_CUDA_CHECK_LAUNCH("router_forward_kernel");
      });
    });
  }
  FinishArgs f{};
  f.partial_scores = partials.scores.data_as<float>();
  f.partial_counts = partials.counts.data_as<int32_t>();
  f.partial_aux_counts = partials.aux_counts.data_as<int32_t>();
  f.partial_z = partials.z_terms.data_as<float>();
  f.chunks = chunks;
  f.experts = int(E);
  f.counts = out.counts.data_as<int64_t>();
  f.aux_counts = aux ? out.aux_loss_counts.data_as<int64_t>() : nullptr;
  f.counts_total = out.counts_total.defined() ? out.counts_total.data_as<int64_t>() : nullptr;
  f.aux_loss = aux ? out.aux_loss.data_as<float>() : nullptr;
  f.z_loss = out.z_loss.defined() ? out.z_loss.data_as<float>() : nullptr;
  f.total_loss = out.total_loss.defined() ? out.total_loss.data_as<float>() : nullptr;
  f.aux_factor = float(detail::router_aux_factor(spec, T, E));
  f.z_factor = float(detail::router_z_factor(spec, T));
  router_finish_kernel<<<1, kThreads, 0, stream>>>(f);
  MOE_CUDA_CHECK_LAUNCH("router_finish_kernel");
}

void router_backward(const RouterOutputGrads& d_out, const TensorView& x, const TensorView& weight,
                     const TensorView& logits, const TensorView& indices,
                     const TensorView& aux_loss_counts, const RouterGrads& grads,
                     const RouterSpec& spec, const detail::RouterBackwardScratch& scratch, Stream stream) {
  const int64_t T = x.size(0), E = weight.size(0);
  check_limits("router_backward", x.dtype(), E, spec.topk);
  const RouterBackwardPlan plan = router_backward_plan(x, weight, grads, scratch);
  if (T > 0) {
    with_index_type(indices.dtype(), [&](auto index) {
      using Index = decltype(index);
      BackwardArgs<Index> a{};
      a.logits = logits.data_as<float>();
      a.ld_logits = logits.stride(0);
      a.indices = indices.data_as<Index>();
      a.ld_indices = indices.stride(0);
      a.d_probs = d_out.d_probs.defined() ? d_out.d_probs.data_as<float>() : nullptr;
      a.ld_d_probs = d_out.d_probs.defined() ? d_out.d_probs.stride(0) : 0;
      a.d_aux_loss = d_out.d_aux_loss.defined() ? d_out.d_aux_loss.data_as<float>() : nullptr;
      a.aux_counts = d_out.d_aux_loss.defined() ? aux_loss_counts.data_as<int64_t>() : nullptr;
      a.d_z_loss = d_out.d_z_loss.defined() ? d_out.d_z_loss.data_as<float>() : nullptr;
      a.d_logits = scratch.d_logits.data_as<float>();
      a.d_split = plan.splits() ? scratch.d_split.data_as<__nv_bfloat16>() : nullptr;
      a.ld_split = scratch.d_split.defined() ? scratch.d_split.stride(0) : 0;
      a.tokens = T;
      a.experts = int(E);
      a.topk = int(spec.topk);
      a.scaling = spec.scaling_factor;
      a.aux_factor = float(detail::router_aux_factor(spec, T, E));
      a.z_factor_twice = float(2 * detail::router_z_factor(spec, T));
      a.softmax = spec.score == RouterScore::kSoftmax;
      a.norm = spec.norm_topk_prob;
      const int64_t blocks = std::min<int64_t>((T + kWarps - 1) / kWarps, kBackwardBlocks);
      with_slots(E, [&](auto slots) {
        router_backward_kernel<decltype(slots)::value, Index>
            <<<unsigned(blocks), kThreads, 0, stream>>>(a);
        MOE_CUDA_CHECK_LAUNCH("router_backward_kernel");
      });
    });
  }
  router_backward_products(plan, x, weight, grads, scratch, stream);
}

void router_update_expert_bias(const TensorView& expert_bias, const TensorView& counts, float rate,
                               Stream stream) {
  router_update_bias_kernel<<<1, kThreads, 0, stream>>>(
      expert_bias.data_as<float>(), counts.data_as<int64_t>(), int(expert_bias.size(0)), rate);
  MOE_CUDA_CHECK_LAUNCH("router_update_bias_kernel");
}

}  // namespace moe::cuda
