// The activations on the CPU backend, one row at a time: a GLU maps each gate/linear column pair
// of h to one output feature, a non-gated activation each column of h to the feature of the same
// index (common/glu_math.hpp holds the math both backends share).
#include <vector>

#include "common/glu_math.hpp"
#include "cpu/backend.hpp"
#include "cpu/convert.hpp"

namespace moe::cpu {
namespace {

// A GLU's features: gate column j sits at (j / s) * 2s + j % s, its linear partner s columns later.
template <class Acc>
struct GatedFeatures {
  int64_t s;
  detail::GluMath<Acc> math;
  int64_t gate(int64_t j) const { return (j / s) * 2 * s + j % s; }
  Acc forward(const Acc* h, int64_t j) const { return math.forward(h[gate(j)], h[gate(j) + s]); }
  // act of feature j; its gradient columns into dh.
  Acc backward(const Acc* h, int64_t j, Acc d_act, Acc* dh) const {
    Acc act;
    math.backward(h[gate(j)], h[gate(j) + s], d_act, act, dh[gate(j)], dh[gate(j) + s]);
    return act;
  }
};

// A non-gated activation's features: feature j is column j.
template <class Acc, class Fn>
struct ElementwiseFeatures {
  Fn fn;
  Acc forward(const Acc* h, int64_t j) const { return fn.forward(h[j]); }
  Acc backward(const Acc* h, int64_t j, Acc d_act, Acc* dh) const {
    Acc act;
    fn.backward(h[j], d_act, act, dh[j]);
    return act;
  }
};

// fn(features) for the spec's activation.
template <class Acc, class Fn>
void with_features(const GluSpec& spec, int64_t ffn, Fn&& fn) {
  if (spec.gated()) return fn(GatedFeatures<Acc>{spec.layout.block_size(ffn), detail::GluMath<Acc>::from(spec)});
  detail::with_elementwise<Acc>(spec.activation,
                                [&](auto f) { fn(ElementwiseFeatures<Acc, decltype(f)>{f}); });
}

template <class Acc, class Features>
void forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups, const TensorView& out,
             const Features& features) {
  const int64_t F = out.size(1), width = h.size(1);
  const int64_t rows = groups.offsets().data_as<int64_t>()[groups.num_groups()];
#pragma omp parallel
  {
    std::vector<Acc> in(static_cast<size_t>(width)), act(static_cast<size_t>(F));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      load(element_ptr(h, r, 0), h.dtype(), width, 1, in.data());
      const Acc p = probs.defined() ? load_at<Acc>(probs, r) : Acc(1);
      for (int64_t j = 0; j < F; ++j) act[size_t(j)] = features.forward(in.data(), j) * p;
      store(act.data(), F, element_ptr(out, r, 0), out.dtype());
    }
  }
}

template <class Acc, class Features>
void backward(const TensorView& h, const TensorView& probs, const TensorView& d_out, const GroupLayout& groups,
              const GluBackwardOutputs& o, const Features& features) {
  const int64_t F = d_out.size(1), width = h.size(1);
  const int64_t rows = groups.offsets().data_as<int64_t>()[groups.num_groups()];
#pragma omp parallel
  {
    std::vector<Acc> in(static_cast<size_t>(width)), dh(static_cast<size_t>(width));
    std::vector<Acc> dout(static_cast<size_t>(F)), act_p(static_cast<size_t>(F));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      load(element_ptr(h, r, 0), h.dtype(), width, 1, in.data());
      load(element_ptr(d_out, r, 0), d_out.dtype(), F, 1, dout.data());
      const Acc p = probs.defined() ? load_at<Acc>(probs, r) : Acc(1);
      Acc dp = 0;
      for (int64_t j = 0; j < F; ++j) {
        const Acc act = features.backward(in.data(), j, dout[size_t(j)] * p, dh.data());
        dp += act * dout[size_t(j)];
        act_p[size_t(j)] = act * p;
      }
      store(dh.data(), width, element_ptr(o.dh, r, 0), o.dh.dtype());
      if (o.dprobs.defined()) store(&dp, 1, element_ptr_1d(o.dprobs, r), o.dprobs.dtype());
      if (o.out.defined()) store(act_p.data(), F, element_ptr(o.out, r, 0), o.out.dtype());
    }
  }
}

}  // namespace

void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec) {
  with_accumulator(h.dtype(), [&](auto acc) {
    using Acc = decltype(acc);
    with_features<Acc>(spec, out.size(1), [&](const auto& f) { forward<Acc>(h, probs, groups, out, f); });
  });
}

void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& outputs,
                  const GluSpec& spec) {
  with_accumulator(h.dtype(), [&](auto acc) {
    using Acc = decltype(acc);
    with_features<Acc>(spec, d_out.size(1),
                       [&](const auto& f) { backward<Acc>(h, probs, d_out, groups, outputs, f); });
  });
}

}  // namespace moe::cpu
