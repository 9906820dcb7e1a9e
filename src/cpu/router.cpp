// The router on the CPU backend (docs/design.md section 13). The logits are plain dot products over
// H in order; each token is then routed on its own with common/router_math.hpp's functions, its
// sums over experts and over its k choices taken in the CUDA warp's order, so that for the same
// logits the choice and the probabilities are the CUDA backend's bits. Sums over tokens (counts,
// losses, the weight gradient) run in token order. This file is compiled with -ffp-contract=off
// (src/CMakeLists.txt): a fused multiply-add would round differently from the device's IEEE steps.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/router_math.hpp"
#include "cpu/backend.hpp"
#include "cpu/convert.hpp"
#include "cpu/epilogue.hpp"

namespace moe::cpu {
namespace {

using detail::router_better;
using detail::router_canonical;
using detail::router_exp;
using detail::router_warp_sum;

int64_t load_index(const TensorView& indices, int64_t t, int64_t j) {
  const int64_t at = t * indices.stride(0) + j;
  return indices.dtype() == DType::kInt32 ? indices.data_as<int32_t>()[at]
                                          : indices.data_as<int64_t>()[at];
}

void store_index(const TensorView& indices, int64_t t, int64_t j, int64_t value) {
  const int64_t at = t * indices.stride(0) + j;
  if (indices.dtype() == DType::kInt32)
    indices.data_as<int32_t>()[at] = int32_t(value);
  else
    indices.data_as<int64_t>()[at] = value;
}

template <class Acc>
Acc load_scalar(const TensorView& t) {
  Acc v;
  load(t.data(), t.dtype(), 1, 1, &v);
  return v;
}

// panel[r * cols + c] = t(r, c): a matrix in the accumulator type.
template <class Acc>
std::vector<Acc> load_matrix(const TensorView& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  std::vector<Acc> panel(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    load(element_ptr(t, r, 0), t.dtype(), cols, 1, panel.data() + r * cols);
  return panel;
}

// The softmax of one token's logits into s, through e^(l - max) (into `exps`). Returns the max and
// the sum of exps: logsumexp = max + log(sum). The max is fmax's, which skips NaN (as the
// device's).
template <class Acc>
struct SoftmaxParts {
  Acc max, sum;
};
template <class Acc>
SoftmaxParts<Acc> softmax(const Acc* logits, int64_t E, Acc* exps, Acc* s) {
  Acc m = std::numeric_limits<Acc>::quiet_NaN();
  for (int64_t e = 0; e < E; ++e) m = std::fmax(m, logits[e]);
  for (int64_t e = 0; e < E; ++e) exps[e] = router_exp(logits[e] - m);
  const Acc sum = router_warp_sum(exps, E);
  for (int64_t e = 0; e < E; ++e) s[e] = exps[e] / sum;
  return {m, sum};
}

// One token's routing, with buffers for one thread.
template <class Acc>
class TokenRouter {
 public:
  TokenRouter(const RouterSpec& spec, int64_t num_experts, const Acc* bias)
      : spec_(spec),
        E_(num_experts),
        bias_(bias),
        s_(size_t(E_)),
        sel_(size_t(E_)),
        tmp_(size_t(E_)),
        tmp2_(size_t(E_)),
        eligible_(size_t(E_)),
        taken_(size_t(E_)),
        r_(size_t(spec.topk)) {}

  // The scores of logits l into s_ (and, for softmax, the logsumexp's parts).
  SoftmaxParts<Acc> scores(const Acc* l) {
    if (spec_.score == RouterScore::kSoftmax) return softmax(l, E_, tmp_.data(), s_.data());
    for (int64_t e = 0; e < E_; ++e) s_[size_t(e)] = detail::router_sigmoid(l[e]);
    return {};
  }
  const Acc* score() const { return s_.data(); }

  // Routes one token of logits l: choice[0..k) best first, prob[0..k); with aux_scores the
  // load-balancing loss's scores (E) and its own top-k (aux_choice); with lse the logsumexp.
  void route(const Acc* l, int64_t* choice, Acc* prob, Acc* aux_scores, int64_t* aux_choice,
             Acc* lse) {
    const int64_t k = spec_.topk;
    const SoftmaxParts<Acc> parts = scores(l);
    for (int64_t e = 0; e < E_; ++e)
      sel_[size_t(e)] = bias_ ? s_[size_t(e)] + bias_[e] : s_[size_t(e)];
    mark_eligible();
    top_k(sel_.data(), choice);
    for (int64_t j = 0; j < k; ++j) r_[size_t(j)] = s_[size_t(choice[j])];
    const Acc denominator =
        spec_.norm_topk_prob ? router_warp_sum(r_.data(), k) + Acc(detail::kRouterNormEpsilon) : 0;
    for (int64_t j = 0; j < k; ++j)
      prob[j] = (spec_.norm_topk_prob ? r_[size_t(j)] / denominator : r_[size_t(j)]) *
                Acc(spec_.scaling_factor);
    if (aux_scores) {
      load_balancing_scores(aux_scores);
      std::fill(eligible_.begin(), eligible_.end(), char(1));
      top_k(aux_scores, aux_choice);
    }
    if (lse) {
      const SoftmaxParts<Acc> p =
          spec_.score == RouterScore::kSoftmax ? parts : softmax(l, E_, tmp_.data(), tmp2_.data());
      *lse = p.max + std::log(p.sum);
    }
  }

  // The load-balancing loss's scores of the token whose scores() ran last: the softmax, or the
  // sigmoid scores over their sum (+ 1e-20), as Megatron-LM normalizes them for this loss.
  void load_balancing_scores(Acc* q) const {
    if (spec_.score == RouterScore::kSoftmax) {
      std::copy(s_.begin(), s_.end(), q);
      return;
    }
    const Acc total = router_warp_sum(s_.data(), E_) + Acc(detail::kRouterNormEpsilon);
    for (int64_t e = 0; e < E_; ++e) q[e] = s_[size_t(e)] / total;
  }

 private:
  // Group-limited routing: the experts of the topk_groups best groups, a group scored by the sum of
  // its two best selection scores (canonical values; its one score for groups of one).
  void mark_eligible() {
    if (!spec_.group_limited()) {
      std::fill(eligible_.begin(), eligible_.end(), char(1));
      return;
    }
    const int64_t groups = spec_.num_groups, size = E_ / groups;
    std::vector<Acc>& group_score = tmp2_;
    for (int64_t g = 0; g < groups; ++g) {
      int64_t best = -1, second = -1;
      for (int64_t e = g * size; e < (g + 1) * size; ++e) {
        if (best < 0 || router_better(sel_[size_t(e)], e, sel_[size_t(best)], best)) {
          second = best;
          best = e;
        } else if (second < 0 || router_better(sel_[size_t(e)], e, sel_[size_t(second)], second)) {
          second = e;
        }
      }
      const Acc top = router_canonical(sel_[size_t(best)]);
      group_score[size_t(g)] = second < 0 ? top : top + router_canonical(sel_[size_t(second)]);
    }
    std::fill(eligible_.begin(), eligible_.end(), char(0));
    std::fill(taken_.begin(), taken_.begin() + groups, char(0));
    for (int64_t i = 0; i < spec_.topk_groups; ++i) {
      int64_t best = -1;
      for (int64_t g = 0; g < groups; ++g)
        if (!taken_[size_t(g)] &&
            (best < 0 || router_better(group_score[size_t(g)], g, group_score[size_t(best)], best)))
          best = g;
      taken_[size_t(best)] = 1;
      std::fill(eligible_.begin() + best * size, eligible_.begin() + (best + 1) * size, char(1));
    }
  }

  // The k best eligible experts by (value, index), best first.
  void top_k(const Acc* value, int64_t* choice) {
    std::fill(taken_.begin(), taken_.end(), char(0));
    for (int64_t j = 0; j < spec_.topk; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E_; ++e)
        if (eligible_[size_t(e)] && !taken_[size_t(e)] &&
            (best < 0 || router_better(value[e], e, value[best], best)))
          best = e;
      taken_[size_t(best)] = 1;
      choice[j] = best;
    }
  }

  const RouterSpec& spec_;
  int64_t E_;
  const Acc* bias_;
  std::vector<Acc> s_, sel_, tmp_, tmp2_;
  std::vector<char> eligible_, taken_;
  std::vector<Acc> r_;
};

// logits[t, e] = <x[t], w[e]>, summed over H in order (the CUDA kernel's order).
template <class Acc>
void logits_of(const TensorView& x, const TensorView& weight, const TensorView& logits) {
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0);
  const std::vector<Acc> w = load_matrix<Acc>(weight);
  std::vector<Acc> wt(static_cast<size_t>(H * E));  // [H, E]: the inner loop runs over the experts
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h) wt[size_t(h * E + e)] = w[size_t(e * H + h)];
#pragma omp parallel
  {
    std::vector<Acc> row(static_cast<size_t>(H)), acc(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      load(element_ptr(x, t, 0), x.dtype(), H, 1, row.data());
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (int64_t h = 0; h < H; ++h) {
        const Acc xv = row[size_t(h)];
        const Acc* wh = wt.data() + h * E;
        for (int64_t e = 0; e < E; ++e) acc[size_t(e)] = acc[size_t(e)] + xv * wh[e];
      }
      store(acc.data(), E, element_ptr(logits, t, 0), logits.dtype());
    }
  }
}

template <class Acc>
void forward(const TensorView& x, const TensorView& weight, const TensorView& expert_bias,
             const RouterOutputs& out, const RouterSpec& spec) {
  const int64_t T = x.size(0), E = weight.size(0), k = spec.topk;
  logits_of<Acc>(x, weight, out.logits);
  std::vector<Acc> bias;
  if (expert_bias.defined()) {
    bias.resize(size_t(E));
    load(expert_bias.data(), expert_bias.dtype(), E, 1, bias.data());
  }
  const bool aux = out.aux_loss.defined(), z = out.z_loss.defined();
  std::vector<int64_t> choice(static_cast<size_t>(T * k)), aux_choice(aux ? size_t(T * k) : 0);
  std::vector<Acc> aux_scores(aux ? size_t(T * E) : 0), lse(z ? size_t(T) : 0);
#pragma omp parallel
  {
    TokenRouter<Acc> router(spec, E, bias.empty() ? nullptr : bias.data());
    std::vector<Acc> l(static_cast<size_t>(E)), p(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      load(element_ptr(out.logits, t, 0), out.logits.dtype(), E, 1, l.data());
      router.route(l.data(), choice.data() + t * k, p.data(),
                   aux ? aux_scores.data() + t * E : nullptr,
                   aux ? aux_choice.data() + t * k : nullptr, z ? lse.data() + t : nullptr);
      for (int64_t j = 0; j < k; ++j) store_index(out.indices, t, j, choice[size_t(t * k + j)]);
      store(p.data(), k, element_ptr(out.probs, t, 0), out.probs.dtype());
    }
  }
  auto count = [&](const std::vector<int64_t>& chosen, const TensorView& counts) {
    int64_t* c = counts.data_as<int64_t>();
    std::fill(c, c + E, int64_t(0));
    for (int64_t i : chosen) ++c[i];
  };
  count(choice, out.counts);
  if (out.counts_total.defined()) {
    int64_t* total = out.counts_total.data_as<int64_t>();
    for (int64_t e = 0; e < E; ++e) total[e] += out.counts.data_as<int64_t>()[e];
  }
  Acc aux_value = 0, z_value = 0;  // the losses as written, for total_loss
  if (aux) {
    count(aux_choice, out.aux_loss_counts);
    std::vector<Acc> per_expert(static_cast<size_t>(E));
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < E; ++e) {
      Acc sum = 0;
      for (int64_t t = 0; t < T; ++t) sum += aux_scores[size_t(t * E + e)];
      per_expert[size_t(e)] = sum;
    }
    Acc total = 0;
    for (int64_t e = 0; e < E; ++e)
      total += per_expert[size_t(e)] * Acc(out.aux_loss_counts.data_as<int64_t>()[e]);
    aux_value = total * Acc(detail::router_aux_factor(spec, T, E));
    store(&aux_value, 1, out.aux_loss.data(), out.aux_loss.dtype());
  }
  if (z) {
    Acc total = 0;
    for (Acc v : lse) total += v * v;
    z_value = total * Acc(detail::router_z_factor(spec, T));
    store(&z_value, 1, out.z_loss.data(), out.z_loss.dtype());
  }
  if (out.total_loss.defined()) {
    const Acc sum = aux_value + z_value;
    store(&sum, 1, out.total_loss.data(), out.total_loss.dtype());
  }
}

// dL/dlogits of every token into d_logits ([T, E], contiguous).
template <class Acc>
void logits_grad(const RouterOutputGrads& d_out, const TensorView& logits,
                 const TensorView& indices, const TensorView& aux_loss_counts,
                 const RouterSpec& spec, const TensorView& d_logits) {
  const int64_t T = logits.size(0), E = logits.size(1), k = spec.topk;
  const bool softmax_scores = spec.score == RouterScore::kSoftmax;
  const bool aux = d_out.d_aux_loss.defined(), z = d_out.d_z_loss.defined(),
             probs = d_out.d_probs.defined();
  const Acc aux_scale =
      aux ? load_scalar<Acc>(d_out.d_aux_loss) * Acc(detail::router_aux_factor(spec, T, E)) : 0;
  const Acc z_scale =
      z ? load_scalar<Acc>(d_out.d_z_loss) * Acc(2 * detail::router_z_factor(spec, T)) : 0;
  const Acc eps = Acc(detail::kRouterNormEpsilon), scaling = Acc(spec.scaling_factor);
  std::vector<Acc> aux_count(aux ? size_t(E) : 0);
  for (int64_t e = 0; e < int64_t(aux_count.size()); ++e)
    aux_count[size_t(e)] = Acc(aux_loss_counts.data_as<int64_t>()[e]);
#pragma omp parallel
  {
    TokenRouter<Acc> router(spec, E, nullptr);
    const auto experts = static_cast<size_t>(E), choices = static_cast<size_t>(k);
    std::vector<Acc> l(experts), ds(experts), terms(experts), exps(experts), sm(experts);
    std::vector<Acc> g(choices), r(choices), dr(choices);
    std::vector<int64_t> choice(choices);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      load(element_ptr(logits, t, 0), logits.dtype(), E, 1, l.data());
      const SoftmaxParts<Acc> parts = router.scores(l.data());
      const Acc* s = router.score();
      std::fill(ds.begin(), ds.end(), Acc(0));
      if (probs) {
        load(element_ptr(d_out.d_probs, t, 0), d_out.d_probs.dtype(), k, 1, g.data());
        for (int64_t j = 0; j < k; ++j) {
          choice[size_t(j)] = load_index(indices, t, j);
          r[size_t(j)] = s[choice[size_t(j)]];
          g[size_t(j)] = scaling * g[size_t(j)];
        }
        if (spec.norm_topk_prob) {
          // p_j = r_j / D: dL/dr_i = (g_i - sum_j g_j p_j) / D
          const Acc denominator = router_warp_sum(r.data(), k) + eps;
          for (int64_t j = 0; j < k; ++j)
            terms[size_t(j)] = g[size_t(j)] * (r[size_t(j)] / denominator);
          const Acc dot = router_warp_sum(terms.data(), k);
          for (int64_t j = 0; j < k; ++j) dr[size_t(j)] = (g[size_t(j)] - dot) / denominator;
        } else {
          dr = g;
        }
        for (int64_t j = 0; j < k; ++j) ds[size_t(choice[size_t(j)])] += dr[size_t(j)];
      }
      if (aux) {  // aux = factor * sum_e count_e sum_t q_te: dL/dq_te = d_aux * factor * count_e
        if (softmax_scores) {
          for (int64_t e = 0; e < E; ++e) ds[size_t(e)] += aux_scale * aux_count[size_t(e)];
        } else {  // q = s / Q, Q = sum_e s_e + eps: dL/ds_i = (dq_i - sum_e dq_e q_e) / Q
          const Acc total = router_warp_sum(s, E) + eps;
          for (int64_t e = 0; e < E; ++e)
            terms[size_t(e)] = (aux_scale * aux_count[size_t(e)]) * (s[e] / total);
          const Acc dot = router_warp_sum(terms.data(), E);
          for (int64_t e = 0; e < E; ++e)
            ds[size_t(e)] += (aux_scale * aux_count[size_t(e)] - dot) / total;
        }
      }
      Acc* dl = d_logits.data_as<Acc>() + t * E;
      if (softmax_scores) {  // dl_e = s_e (ds_e - sum_j ds_j s_j)
        for (int64_t e = 0; e < E; ++e) terms[size_t(e)] = ds[size_t(e)] * s[e];
        const Acc dot = router_warp_sum(terms.data(), E);
        for (int64_t e = 0; e < E; ++e) dl[e] = s[e] * (ds[size_t(e)] - dot);
      } else {  // dl_e = ds_e s_e (1 - s_e)
        for (int64_t e = 0; e < E; ++e) dl[e] = ds[size_t(e)] * (s[e] * (Acc(1) - s[e]));
      }
      if (z) {  // z = factor * sum_t lse_t^2: dl_te += d_z * 2 factor * lse_t * softmax_te
        const SoftmaxParts<Acc> p =
            softmax_scores ? parts : softmax(l.data(), E, exps.data(), sm.data());
        const Acc* softmax_of_logits = softmax_scores ? s : sm.data();
        const Acc c = z_scale * (p.max + std::log(p.sum));
        for (int64_t e = 0; e < E; ++e) dl[e] = dl[e] + c * softmax_of_logits[e];
      }
    }
  }
}

template <class Acc>
void backward(const RouterOutputGrads& d_out, const TensorView& x, const TensorView& weight,
              const TensorView& logits, const TensorView& indices,
              const TensorView& aux_loss_counts, const RouterGrads& grads, const RouterSpec& spec,
              const TensorView& d_logits) {
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0);
  if (T > 0) logits_grad<Acc>(d_out, logits, indices, aux_loss_counts, spec, d_logits);
  const Acc* dl = T > 0 ? d_logits.data_as<Acc>() : nullptr;
  if (grads.dx.defined()) {  // dx[t] = sum_e dl[t, e] w[e], over E in order
    const std::vector<Acc> w = load_matrix<Acc>(weight);
#pragma omp parallel
    {
      std::vector<Acc> acc(static_cast<size_t>(H)), old(grads.accumulate_dx ? size_t(H) : 0);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t e = 0; e < E; ++e) {
          const Acc d = dl[t * E + e];
          const Acc* we = w.data() + e * H;
          for (int64_t h = 0; h < H; ++h) acc[size_t(h)] = acc[size_t(h)] + d * we[h];
        }
        if (grads.accumulate_dx) {  // dx's value + the sum, as the CUDA kernel's epilogue adds
          load(element_ptr(grads.dx, t, 0), grads.dx.dtype(), H, 1, old.data());
          for (int64_t h = 0; h < H; ++h) acc[size_t(h)] = old[size_t(h)] + acc[size_t(h)];
        }
        store(acc.data(), H, element_ptr(grads.dx, t, 0), grads.dx.dtype());
      }
    }
  }
  // dweight[e] = sum_t dl[t, e] x[t], over T in order; no tokens: zeros, main_grad left untouched.
  if (grads.dweight.defined() && !(T == 0 && grads.dweight_mode == GradMode::kAccumulate)) {
    const std::vector<Acc> xs = load_matrix<Acc>(x);
#pragma omp parallel
    {
      std::vector<Acc> acc(static_cast<size_t>(H)), scratch(static_cast<size_t>(H));
#pragma omp for schedule(static)
      for (int64_t e = 0; e < E; ++e) {
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t t = 0; t < T; ++t) {
          const Acc d = dl[t * E + e];
          const Acc* xt = xs.data() + t * H;
          for (int64_t h = 0; h < H; ++h) acc[size_t(h)] = acc[size_t(h)] + d * xt[h];
        }
        emit_grad(acc.data(), H, element_ptr(grads.dweight, e, 0), grads.dweight.dtype(),
                  grads.dweight_mode, scratch.data());
      }
    }
  }
}

}  // namespace

void router_forward(const TensorView& x, const TensorView& weight, const TensorView& expert_bias,
                    const RouterOutputs& out, const RouterSpec& spec) {
  with_accumulator(x.dtype(),
                   [&](auto acc) { forward<decltype(acc)>(x, weight, expert_bias, out, spec); });
}

void router_backward(const RouterOutputGrads& d_out, const TensorView& x, const TensorView& weight,
                     const TensorView& logits, const TensorView& indices,
                     const TensorView& aux_loss_counts, const RouterGrads& grads,
                     const RouterSpec& spec, const TensorView& d_logits) {
  const int64_t T = x.size(0), E = weight.size(0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < spec.topk; ++j) {
      const int64_t e = load_index(indices, t, j);
      MOE_CHECK(e >= 0 && e < E, ErrorCode::kInvalidArgument, "router_backward: indices[", t, ", ",
                j, "] = ", e, " is not an expert (expected 0 <= index < E = ", E,
                "; pass router_forward's indices)");
    }
  with_accumulator(x.dtype(), [&](auto acc) {
    backward<decltype(acc)>(d_out, x, weight, logits, indices, aux_loss_counts, grads, spec,
                            d_logits);
  });
}

void router_update_expert_bias(const TensorView& expert_bias, const TensorView& counts,
                               float rate) {
  const int64_t E = expert_bias.size(0);
  const int64_t* c = counts.data_as<int64_t>();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += c[e];
  with_accumulator(expert_bias.dtype(), [&](auto acc) {
    using Acc = decltype(acc);
    Acc* bias = expert_bias.data_as<Acc>();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t below_mean = total - E * c[e];  // sign(mean - c[e]), exactly
      const Acc sign = below_mean > 0 ? Acc(1) : below_mean < 0 ? Acc(-1) : Acc(0);
      bias[e] = bias[e] + Acc(rate) * sign;
    }
  });
}

}  // namespace moe::cpu
