// The permute ops (docs/design.md section 14): the plan's sizes, validation, then dispatch by
// device.
#include "moe_engine/permute.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "common/permute_order.hpp"
#include "cpu/backend.hpp"
#include "moe_engine/config.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif
#include "ops/validate.hpp"

namespace moe {

namespace {

void check_plan_shape(const char* op, int64_t tokens, int64_t topk, int64_t num_experts) {
  MOE_CHECK(tokens >= 0 && topk >= 1 && num_experts >= 1, ErrorCode::kInvalidArgument, op,
            ": tokens T = ", tokens, ", topk k = ", topk, ", experts E = ", num_experts,
            " (expected T >= 0, k >= 1, E >= 1)");
  // The plan's limit (row_of holds int32 rows); T k cannot overflow past it.
  MOE_CHECK(tokens <= INT32_MAX / topk, ErrorCode::kInvalidArgument, op, ": tokens T = ", tokens, ", topk k = ",
            topk, ": T k is more than 2^31 - 1 assignments (row_of holds int32 rows)");
}

void check_capacity_factor(const char* op, double factor) {
  MOE_CHECK(std::isfinite(factor) && factor > 0, ErrorCode::kInvalidArgument, op,
            ": capacity_factor = ", factor,
            " (expected a finite value > 0, or none for no capacity)");
}

// The plan's CUDA scratch: per-chunk counts of each expert [E, chunks], then each expert's first
// row [E]. With an empty workspace the carver only adds up the sizes.
struct PlanScratch {
  TensorView chunk_counts, expert_rows;
};
PlanScratch carve_plan_scratch(ops::WorkspaceCarver& carver, int64_t assignments,
                               int64_t num_experts) {
  PlanScratch s;
  s.chunk_counts = carver.take({num_experts, detail::plan_chunks(assignments)}, DType::kInt32);
  s.expert_rows = carver.take({num_experts}, DType::kInt32);
  return s;
}

using Named = std::pair<const char*, TensorView>;

// No output overlaps an input or another output (undefined tensors overlap nothing).
void separate(const ops::Validator& v, std::initializer_list<Named> outputs,
              std::initializer_list<Named> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (const Named& in : inputs) v.no_overlap(out->first, out->second, in.first, in.second);
    for (auto other = out + 1; other != outputs.end(); ++other)
      v.distinct_outputs(out->first, out->second, other->first, other->second);
  }
}

// row_of [T, k] int32 and its values; returns k.
int64_t row_map(const ops::Validator& v, const TensorView& row_of, int64_t tokens,
                const GroupLayout& groups) {
  v.index_matrix("row_of", row_of, tokens, -1, "[T, k]", {DType::kInt32});
  if (row_of.size(1) < 1)
    v.fail(ErrorCode::kShape, "row_of: expected k >= 1 choices per token, got ", row_of.describe());
  if (v.device().is_cpu())
    v.row_map_values("row_of", row_of, groups.offsets().data_as<int64_t>()[groups.num_groups()]);
  return row_of.size(1);
}

}  // namespace

namespace {
// ceil(T k / groups * factor), at most T k: a huge factor cannot overflow (inputs checked).
int64_t capped_capacity(int64_t tokens, int64_t topk, int64_t groups, double factor) {
  const double assignments = double(tokens * topk);
  return int64_t(std::min(std::ceil(assignments / double(groups) * factor), assignments));
}
}  // namespace

int64_t expert_capacity(int64_t tokens, int64_t topk, int64_t num_experts, double capacity_factor) {
  check_plan_shape("expert_capacity", tokens, topk, num_experts);
  check_capacity_factor("expert_capacity", capacity_factor);
  return capped_capacity(tokens, topk, num_experts, capacity_factor);
}

int64_t permuted_rows(int64_t tokens, int64_t topk, int64_t num_experts,
                      std::optional<double> capacity_factor) {
  check_plan_shape("permuted_rows", tokens, topk, num_experts);
  const int64_t assignments = tokens * topk;
  if (!capacity_factor) return assignments;
  const int64_t capacity = expert_capacity(tokens, topk, num_experts, *capacity_factor);
  // min(T k, E C) without forming E C when it would pass T k (E may be large).
  return capacity == 0 || num_experts <= assignments / capacity ? std::min(assignments, num_experts * capacity)
                                                                 : assignments;
}

size_t permute_plan_workspace_size(int64_t tokens, int64_t topk, int64_t num_experts) {
  check_plan_shape("permute_plan_workspace_size", tokens, topk, num_experts);
  ops::WorkspaceCarver carver;
  carve_plan_scratch(carver, tokens * topk, num_experts);
  return carver.used();
}

GroupLayout permute_plan(const TensorView& indices, const PermutePlanOutputs& o,
                         std::optional<double> capacity_factor, DeviceErrorFlag* errors,
                         const ExecContext& ctx) {
  const bool have_experts = o.splits.defined() && o.splits.dim() == 1 && o.splits.size(0) >= 1;
  const ops::Validator v("permute_plan", indices.device(), have_experts ? o.splits.size(0) : 0);
  v.index_matrix("indices", indices, -1, -1, "[T, k]", {DType::kInt32, DType::kInt64});
  const int64_t T = indices.size(0), k = indices.size(1), E = v.num_groups();
  if (k < 1)
    v.fail(ErrorCode::kShape, "indices: expected k >= 1 choices per token, got ",
           indices.describe());
  if (T * k > INT32_MAX)
    v.fail(ErrorCode::kShape, "indices: T k = ", T * k,
           " assignments; expected at most 2^31 - 1 (row_of holds int32 rows)");
  if (!have_experts)
    v.fail(ErrorCode::kShape, "splits: expected a 1-D [E] tensor with E >= 1 experts, got ",
           o.splits.describe());
  v.int64_vector("splits", o.splits, E, "[E]");
  v.int64_vector("offsets", o.offsets, E + 1, "[E + 1]");
  if (o.dropped.defined()) v.int64_vector("dropped", o.dropped, E, "[E]");
  v.index_matrix("row_of", o.row_of, T, k, "[T, k]", {DType::kInt32});
  if (capacity_factor) check_capacity_factor("permute_plan", *capacity_factor);
  separate(
      v,
      {{"row_of", o.row_of}, {"splits", o.splits}, {"offsets", o.offsets}, {"dropped", o.dropped}},
      {{"indices", indices}});
  if (errors != nullptr && !(errors->device() == v.device()))
    v.fail(ErrorCode::kDevice, "the error flag is on ", to_string(errors->device()),
           "; expected the indices' device ", to_string(v.device()));
  if (!v.device().is_cpu()) {
    if (errors == nullptr)
      v.fail(ErrorCode::kInvalidArgument,
             "on CUDA a DeviceErrorFlag is required: bad indices cannot be reported otherwise");
    v.workspace(ctx.workspace, permute_plan_workspace_size(T, k, E), "permute_plan_workspace_size");
  }
  v.expert_index_values("indices", indices, E);
  const int64_t capacity = capacity_factor ? expert_capacity(T, k, E, *capacity_factor) : T * k;
  ops::dispatch(
      v, [&] { cpu::permute_plan(indices, capacity, o.row_of, o.splits, o.dropped); },
      [&] {
        ops::WorkspaceCarver carver(ctx.workspace);
        [[maybe_unused]] const PlanScratch s = carve_plan_scratch(carver, T * k, E);
        MOE_CUDA_ONLY(cuda::permute_plan(indices, capacity, o.row_of, o.splits, o.dropped,
                                         s.chunk_counts, s.expert_rows, errors->record(),
                                         ctx.stream));
      });
  return GroupLayout::compute(o.splits, permuted_rows(T, k, E, capacity_factor), o.offsets, errors,
                              ctx.stream);
}

int64_t pair_capacity(int64_t tokens, int64_t topk, int64_t ranks, double factor) {
  MOE_CHECK(tokens >= 0 && topk >= 1 && ranks >= 1, ErrorCode::kInvalidArgument, "pair_capacity: tokens T = ",
            tokens, ", topk k = ", topk, ", ranks P = ", ranks, " (expected T >= 0, k >= 1, P >= 1)");
  MOE_CHECK(std::isfinite(factor) && factor > 0, ErrorCode::kInvalidArgument, "pair_capacity: factor = ", factor,
            " (expected a finite value > 0)");
  return capped_capacity(tokens, topk, ranks, factor);
}

GroupLayout send_plan(const TensorView& indices, const TensorView& row_of_expert, int64_t local_experts,
                      int64_t capacity, const SendPlanOutputs& o, DeviceErrorFlag* errors, const ExecContext& ctx) {
  const bool have_ranks = o.splits.defined() && o.splits.dim() == 1 && o.splits.size(0) >= 1;
  const ops::Validator v("send_plan", indices.device(), have_ranks ? o.splits.size(0) : 0);
  v.index_matrix("indices", indices, -1, -1, "[T, k]", {DType::kInt32, DType::kInt64});
  const int64_t T = indices.size(0), k = indices.size(1), P = v.num_groups(), L = local_experts;
  if (k < 1) v.fail(ErrorCode::kShape, "indices: expected k >= 1 choices per token, got ", indices.describe());
  if (!have_ranks)
    v.fail(ErrorCode::kShape, "splits: expected a 1-D [P] tensor with P >= 1 ranks, got ", o.splits.describe());
  if (L < 1) v.fail(ErrorCode::kInvalidArgument, "local_experts: expected L >= 1, got ", L);
  if (capacity < 0 || capacity > T * k)
    v.fail(ErrorCode::kInvalidArgument, "capacity: expected C in [0, T k] = [0, ", T * k, "], got ", capacity);
  if (P * capacity > INT32_MAX)
    v.fail(ErrorCode::kShape, "P C = ", P * capacity, " send rows; expected at most 2^31 - 1 (int32 rows)");
  v.int64_vector("splits", o.splits, P, "[P]");
  v.int64_vector("offsets", o.offsets, P + 1, "[P + 1]");
  if (o.dropped.defined()) v.int64_vector("dropped", o.dropped, P, "[P]");
  v.index_matrix("row_send", o.row_send, T, k, "[T, k]", {DType::kInt32});
  v.index_matrix("ids", o.ids, P * capacity, 1, "[P C, 1]", {DType::kInt32});
  if (row_of_expert.defined()) v.index_matrix("row_of_expert", row_of_expert, T, k, "[T, k]", {DType::kInt32});
  separate(v,
           {{"row_send", o.row_send}, {"ids", o.ids}, {"splits", o.splits}, {"offsets", o.offsets},
            {"dropped", o.dropped}},
           {{"indices", indices}, {"row_of_expert", row_of_expert}});
  if (errors != nullptr && !(errors->device() == v.device()))
    v.fail(ErrorCode::kDevice, "the error flag is on ", to_string(errors->device()), "; expected the indices' device ",
           to_string(v.device()));
  if (!v.device().is_cpu() && errors == nullptr)
    v.fail(ErrorCode::kInvalidArgument, "on CUDA a DeviceErrorFlag is required: bad indices cannot be reported otherwise");
  v.expert_index_values("indices", indices, P * L);
  ops::dispatch(
      v, [&] { cpu::send_plan(indices, row_of_expert, L, capacity, o.row_send, o.ids, o.splits, o.dropped); },
      [&] {
        MOE_CUDA_ONLY(cuda::send_plan(indices, row_of_expert, L, capacity, o.row_send, o.ids, o.splits, o.dropped,
                                      errors->record(), ctx.stream));
      });
  return GroupLayout::compute(o.splits, P * capacity, o.offsets, errors, ctx.stream);
}

void permute(const TensorView& x, const TensorView& probs, const TensorView& row_of,
             const GroupLayout& groups, const TensorView& x_sorted, const TensorView& probs_sorted,
             [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("permute", groups);
  v.matrix("x", x, -1, -1, "[T, H]");
  const int64_t T = x.size(0), H = x.size(1);
  v.matrix("x_sorted", x_sorted, v.capacity(), H, "[R, H]");
  v.same_dtype("x_sorted", x_sorted.dtype(), "x", x.dtype());
  const int64_t k = row_map(v, row_of, T, groups);
  if (probs.defined() != probs_sorted.defined())
    v.fail(ErrorCode::kInvalidArgument,
           probs.defined() ? "probs is given but probs_sorted is not"
                           : "probs_sorted is given but probs is not",
           " (expected both, to carry the router probs into expert order, or neither)");
  if (probs.defined()) {
    v.probs_matrix("probs", probs, T, k, "[T, k]");
    v.row_scale("probs_sorted", probs_sorted, "[R]");
    v.same_dtype("probs_sorted", probs_sorted.dtype(), "probs", probs.dtype());
  }
  separate(v, {{"x_sorted", x_sorted}, {"probs_sorted", probs_sorted}},
           {{"x", x}, {"probs", probs}, {"row_of", row_of}});
  ops::dispatch(
      v, [&] { cpu::permute(x, probs, row_of, groups, x_sorted, probs_sorted); },
      [&] {
        MOE_CUDA_ONLY(cuda::permute(x, probs, row_of, groups, x_sorted, probs_sorted, ctx.stream));
      });
}

void unpermute(const TensorView& out, const TensorView& probs, const TensorView& row_of,
               const GroupLayout& groups, const TensorView& y,
               [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("unpermute", groups);
  v.matrix("out", out, v.capacity(), -1, "[R, H]");
  const int64_t H = out.size(1);
  v.matrix("y", y, -1, H, "[T, H]");
  v.same_dtype("y", y.dtype(), "out", out.dtype());
  const int64_t T = y.size(0), k = row_map(v, row_of, T, groups);
  if (probs.defined()) v.probs_matrix("probs", probs, T, k, "[T, k]");
  separate(v, {{"y", y}}, {{"out", out}, {"probs", probs}, {"row_of", row_of}});
  ops::dispatch(
      v, [&] { cpu::unpermute(out, probs, row_of, groups, y, {}, {}); },
      [&] { MOE_CUDA_ONLY(cuda::unpermute(out, probs, row_of, groups, y, {}, {}, ctx.stream)); });
}

void permute_backward(const TensorView& d_sorted, const TensorView& d_probs_sorted,
                      const TensorView& row_of, const GroupLayout& groups, const TensorView& dx,
                      const TensorView& d_probs, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("permute_backward", groups);
  v.matrix("d_sorted", d_sorted, v.capacity(), -1, "[R, H]");
  const int64_t H = d_sorted.size(1);
  v.matrix("dx", dx, -1, H, "[T, H]");
  v.same_dtype("dx", dx.dtype(), "d_sorted", d_sorted.dtype());
  const int64_t T = dx.size(0), k = row_map(v, row_of, T, groups);
  if (d_probs_sorted.defined() != d_probs.defined())
    v.fail(ErrorCode::kInvalidArgument,
           d_probs.defined() ? "d_probs is requested but no d_probs_sorted was given"
                             : "d_probs_sorted is given but d_probs is not",
           " (expected both, to carry the sorted probs' gradient back to the router, or neither)");
  if (d_probs.defined()) {
    v.row_scale("d_probs_sorted", d_probs_sorted, "[R]");
    v.probs_matrix("d_probs", d_probs, T, k, "[T, k]");
    v.same_dtype("d_probs", d_probs.dtype(), "d_probs_sorted", d_probs_sorted.dtype());
  }
  separate(v, {{"dx", dx}, {"d_probs", d_probs}},
           {{"d_sorted", d_sorted}, {"d_probs_sorted", d_probs_sorted}, {"row_of", row_of}});
  ops::dispatch(
      v, [&] { cpu::unpermute(d_sorted, {}, row_of, groups, dx, d_probs_sorted, d_probs); },
      [&] {
        MOE_CUDA_ONLY(
            cuda::unpermute(d_sorted, {}, row_of, groups, dx, d_probs_sorted, d_probs, ctx.stream));
      });
}

void unpermute_backward(const TensorView& dy, const TensorView& out, const TensorView& probs,
                        const TensorView& row_of, const GroupLayout& groups,
                        const TensorView& d_out, const TensorView& d_probs,
                        [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("unpermute_backward", groups);
  v.matrix("dy", dy, -1, -1, "[T, H]");
  const int64_t T = dy.size(0), H = dy.size(1);
  v.matrix("d_out", d_out, v.capacity(), H, "[R, H]");
  v.same_dtype("d_out", d_out.dtype(), "dy", dy.dtype());
  const int64_t k = row_map(v, row_of, T, groups);
  if (probs.defined()) v.probs_matrix("probs", probs, T, k, "[T, k]");
  if (d_probs.defined()) {
    if (!probs.defined())
      v.fail(ErrorCode::kInvalidArgument, "d_probs is requested but no probs were given");
    if (!out.defined())
      v.fail(ErrorCode::kInvalidArgument,
             "d_probs is requested but out is undefined (expected the experts' outputs that "
             "unpermute combined)");
    v.probs_matrix("d_probs", d_probs, T, k, "[T, k]");
    v.same_dtype("d_probs", d_probs.dtype(), "probs", probs.dtype());
  }
  if (out.defined()) {
    v.matrix("out", out, v.capacity(), H, "[R, H]");
    v.same_dtype("out", out.dtype(), "dy", dy.dtype());
  }
  separate(v, {{"d_out", d_out}, {"d_probs", d_probs}},
           {{"dy", dy}, {"out", out}, {"probs", probs}, {"row_of", row_of}});
  ops::dispatch(
      v, [&] { cpu::unpermute_backward(dy, out, probs, row_of, groups, d_out, d_probs); },
      [&] {
        MOE_CUDA_ONLY(
            cuda::unpermute_backward(dy, out, probs, row_of, groups, d_out, d_probs, ctx.stream));
      });
}

}  // namespace moe
