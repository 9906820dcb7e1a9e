// The router's products on the Hopper grouped GEMM (docs/design.md section 13), each a grouped
// problem over one weight: the logits as the forward of one group, dx as the dgrad of one group
// over the split d_logits [T, 3E] and the stacked weight [3E, H], the weight gradient as the wgrad
// of token-slice groups into float32 partial sums [S', 3E, H].
#include "cuda/backend.hpp"
#include "cuda/gemm/grouped_gemm_problem.hpp"
#include "cuda/sm90/grouped_gemm.hpp"

namespace moe::cuda {
namespace {

// Rows that TMA reads or writes whole: unit column stride (the kernel checks the rest).
bool unit_columns(const TensorView& t) { return t.stride(1) == 1; }

// A problem over one b (the weight, its stack, or x) with a's rows T; n and k as the form reads
// them (grouped_gemm_problem.hpp), d's rows `d_row_stride` apart.
GroupedGemmProblem one_weight_problem(Form form, const TensorView& a, const TensorView& b, const TensorView& d,
                                      int64_t n, int64_t k, int64_t d_row_stride, int64_t groups,
                                      const int64_t* offsets) {
  GroupedGemmProblem p;
  p.form = form;
  p.in_dtype = a.dtype();
  p.out_dtype = d.dtype();
  p.num_groups = groups;
  p.capacity = a.size(0);
  p.offsets = offsets;
  p.device = a.device().index;
  p.a = a.data();
  p.a_row_stride = a.stride(0);
  p.b = {b.data(), 0, nullptr};
  p.b_row_stride = b.stride(0);
  p.d = {d.data(), 0, nullptr};
  p.d_row_stride = d_row_stride;
  p.n = n;
  p.k = k;
  return p;
}

// logits [T, E] = x [T, H] W [E, H]^T: the forward of one group (a [1, E, H] weight), float32 out.
GroupedGemmProblem logits_problem(const TensorView& x, const TensorView& weight, const TensorView& logits,
                                  const int64_t* offsets) {
  return one_weight_problem(Form::kForward, x, weight, logits, weight.size(0), x.size(1), logits.stride(0), 1,
                            offsets);
}

// dx [T, H] = d_split [T, 3E] weight_stack [3E, H] (or dx += it): the dgrad of one group.
GroupedGemmProblem dgrad_problem(const TensorView& d_split, const TensorView& weight_stack, const TensorView& dx,
                                 bool accumulate, const int64_t* offsets) {
  GroupedGemmProblem p = one_weight_problem(Form::kDgrad, d_split, weight_stack, dx, d_split.size(1), dx.size(1),
                                            dx.stride(0), 1, offsets);
  p.accumulate = accumulate;
  return p;
}

// partials [S', 3E, H]: slice s = d_split[slice s]^T x[slice s], the wgrad of S' groups.
GroupedGemmProblem wgrad_problem(const TensorView& d_split, const TensorView& x, const TensorView& partials,
                                 const int64_t* offsets) {
  return one_weight_problem(Form::kWgrad, d_split, x, partials, d_split.size(1), x.size(1), partials.stride(1),
                            partials.size(0), offsets);
}

}  // namespace

bool router_logits_gemm_can_run(const TensorView& x, const TensorView& weight, const TensorView& logits) {
  // The weight's rows are read as one expert of n rows of stride k: they must be contiguous.
  if (!weight.is_contiguous() || !unit_columns(x) || !unit_columns(logits)) return false;
  return sm90::can_run(logits_problem(x, weight, logits, nullptr), nullptr);
}

void router_logits_gemm(const TensorView& x, const TensorView& weight, const TensorView& logits,
                        const int64_t* offsets, Stream stream) {
  sm90::run(logits_problem(x, weight, logits, offsets), stream);
}

bool router_dgrad_gemm_can_run(const TensorView& d_split, const TensorView& weight_stack, const TensorView& dx,
                               bool accumulate) {
  if (!weight_stack.is_contiguous() || !unit_columns(d_split) || !unit_columns(dx) ||
      d_split.dtype() != weight_stack.dtype())
    return false;
  return sm90::can_run(dgrad_problem(d_split, weight_stack, dx, accumulate, nullptr), nullptr);
}

void router_dgrad_gemm(const TensorView& d_split, const TensorView& weight_stack, const TensorView& dx,
                       bool accumulate, const int64_t* offsets, Stream stream) {
  sm90::run(dgrad_problem(d_split, weight_stack, dx, accumulate, offsets), stream);
}

bool router_wgrad_gemm_can_run(const TensorView& d_split, const TensorView& x, const TensorView& partials) {
  if (!partials.is_contiguous() || partials.dtype() != DType::kFloat32 || !unit_columns(d_split) ||
      !unit_columns(x) || d_split.dtype() != x.dtype())
    return false;
  return sm90::can_run(wgrad_problem(d_split, x, partials, nullptr), nullptr);
}

void router_wgrad_gemm(const TensorView& d_split, const TensorView& x, const TensorView& partials,
                       const int64_t* offsets, Stream stream) {
  sm90::run(wgrad_problem(d_split, x, partials, offsets), stream);
}

}  // namespace moe::cuda
