#include <vector>

#include "common/glu_math.hpp"
#include "cpu/backend.hpp"
#include "cpu/convert.hpp"

namespace moe::cpu {
namespace {

// Gate column j sits at (j / s) * 2s + j % s, its linear partner s columns later.
struct ColumnMap {
  int64_t s;
  int64_t gate(int64_t j) const { return (j / s) * 2 * s + j % s; }
  int64_t linear(int64_t j) const { return gate(j) + s; }
};

template <class Acc>
void forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
             const TensorView& out, const GluSpec& spec) {
  const int64_t F = out.size(1);
  const int64_t rows = groups.offsets().data_as<int64_t>()[groups.num_groups()];
  const ColumnMap cols{spec.layout.block_size(F)};
  const auto math = detail::GluMath<Acc>::from(spec);
#pragma omp parallel
  {
    std::vector<Acc> in(static_cast<size_t>(2 * F)), act(static_cast<size_t>(F));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      load(element_ptr(h, r, 0), h.dtype(), 2 * F, 1, in.data());
      const Acc p = probs.defined() ? load_at<Acc>(probs, r) : Acc(1);
      for (int64_t j = 0; j < F; ++j)
        act[size_t(j)] = math.forward(in[size_t(cols.gate(j))], in[size_t(cols.linear(j))]) * p;
      store(act.data(), F, element_ptr(out, r, 0), out.dtype());
    }
  }
}

template <class Acc>
void backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
              const GroupLayout& groups, const GluBackwardOutputs& o, const GluSpec& spec) {
  const int64_t F = d_out.size(1);
  const int64_t rows = groups.offsets().data_as<int64_t>()[groups.num_groups()];
  const ColumnMap cols{spec.layout.block_size(F)};
  const auto math = detail::GluMath<Acc>::from(spec);
#pragma omp parallel
  {
    std::vector<Acc> in(static_cast<size_t>(2 * F)), dh(static_cast<size_t>(2 * F));
    std::vector<Acc> dout(static_cast<size_t>(F)), act_p(static_cast<size_t>(F));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      load(element_ptr(h, r, 0), h.dtype(), 2 * F, 1, in.data());
      load(element_ptr(d_out, r, 0), d_out.dtype(), F, 1, dout.data());
      const Acc p = probs.defined() ? load_at<Acc>(probs, r) : Acc(1);
      Acc dp = 0;
      for (int64_t j = 0; j < F; ++j) {
        const int64_t gc = cols.gate(j), lc = cols.linear(j);
        Acc act, dg, dl;
        math.backward(in[size_t(gc)], in[size_t(lc)], dout[size_t(j)] * p, act, dg, dl);
        dh[size_t(gc)] = dg;
        dh[size_t(lc)] = dl;
        dp += act * dout[size_t(j)];
        act_p[size_t(j)] = act * p;
      }
      store(dh.data(), 2 * F, element_ptr(o.dh, r, 0), o.dh.dtype());
      if (o.dprobs.defined()) store(&dp, 1, element_ptr_1d(o.dprobs, r), o.dprobs.dtype());
      if (o.out.defined()) store(act_p.data(), F, element_ptr(o.out, r, 0), o.out.dtype());
    }
  }
}

}  // namespace

void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec) {
  with_accumulator(h.dtype(),
                   [&](auto acc) { forward<decltype(acc)>(h, probs, groups, out, spec); });
}

void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& outputs,
                  const GluSpec& spec) {
  with_accumulator(h.dtype(), [&](auto acc) {
    backward<decltype(acc)>(h, probs, d_out, groups, outputs, spec);
  });
}

}  // namespace moe::cpu
